"""`jaxpar generate`: ask a trained model something, from a run directory or a Hugging
Face checkpoint, through a KV cache.

Decoding: the prompts of a batch are left-padded to a bucket of P ids (a power of two,
at least 16) and prefilled in one pass, writing their keys and values into a cache of M
= P + the new tokens (rounded up to 16) slots; then CHUNK steps a dispatch, in a loop on
the device that samples each row's next id there, each step written at the next slot,
every row at its own positions (counted from its first real id) behind a mask of its
padding. Each layer reads its weights and its own cache where they lie (by_layer; the
cache donated and written in place). A Decoder compiles a bucket (rows, P, M, the
sampling's cut) once and keeps it. Decoding stops where every row has met a stop id (the
tokenizer's end of text; with a chat template, its end-of-turn token too), checked after
each chunk, or at --max-new-tokens. Greedy at temperature 0; otherwise sampled from
softmax(logits / temperature), cut to the top k and to the smallest set of top-p mass,
with a key from (--seed, row, step), or a key per row given: the same seed, the same
text, whatever else is in the batch.

Layout: the devices as data x tensor. tensor is the largest count of devices that
divides the model's heads, key/value heads, MLP width and vocab (Megatron's split of
heads and MLP, the cache split by key/value head); the rest split the prompts over
`data` (the batch padded to a multiple). parallel.data and parallel.tensor override it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar import hf
from jaxpar.adapters import lora
from jaxpar.config import presets, registry
from jaxpar.config.registry import CacheDims
from jaxpar.config.sections import AdapterKind, Config, Model, Offload
from jaxpar.errors import ConfigError
from jaxpar.names import BATCH, HEAD_DIM, KV_HEADS, LAYERS, SEQ
from jaxpar.nn.attention import CACHE_NAMES
from jaxpar.nn.problem import Problem, registered
from jaxpar.parallel.axes import DATA
from jaxpar.parallel.mesh import build_mesh, serving_layout
from jaxpar.parallel.sharding import RULES, compute_spec, named, pick, plan
from jaxpar.training import export

PROMPT_BUCKET = 16  # the smallest prompt bucket; buckets double from it
NEW_BUCKET = 16  # cache slots for new tokens come in multiples of this
CHUNK = NEW_BUCKET  # decode steps per dispatch (a device-side loop); the bucket holds them
# XLA:CPU's options for the prefill and the decode loop: their products by Eigen rather
# than the YNNPACK fusions. A decode step of 8 rows runs 1.5x faster (8x512 Llama, this
# machine's CPU). A YNNPACK program packs every weight on its first run, which is the
# command's only run: a prefill of 1 prompt of 65 ids took 0.18 s with them and 0.08 s
# without (0.05 s either way when warm), 8 prompts of 448 ids 0.52 s and 0.38 s.
CPU_DECODE_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
MAX_TEMPERATURE = 100.0  # --temperature: past this every draw is all but uniform


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ConfigError(
                f"--temperature {self.temperature}: give 0 (greedy) to {MAX_TEMPERATURE:g} "
                "(1 samples the model's own distribution; past it, nearly uniform)"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p {self.top_p}: give a share of the mass in (0, 1]")
        if not 0 <= self.top_k <= 2**31 - 1:
            raise ConfigError(f"--top-k {self.top_k}: give a count of tokens, or 0 for all")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"--seed {self.seed}: give 0 to 2**63 - 1")

    def check_vocab(self, vocab: int) -> None:
        """The cut against the model's vocabulary (known once the model is read)."""
        if self.top_k > vocab:
            raise ConfigError(
                f"--top-k {self.top_k}: the model has {vocab} ids; give at most {vocab}, "
                "or 0 for all"
            )


def sample(logits_BxV: jax.Array, keys_B: jax.Array, s: Sampling) -> jax.Array:
    """The next id of each row: the argmax at temperature 0, else a draw with the row's
    own key (so a row's ids never depend on the others in its batch)."""
    if s.temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = logits_BxV.astype(jnp.float32) / s.temperature
    if s.top_k:
        kth_Bx1 = jax.lax.top_k(logits_BxV, s.top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    if s.top_p < 1:
        sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        mass_BxV = jnp.cumsum(jax.nn.softmax(sorted_BxV, axis=-1), axis=-1)
        # the smallest top set whose mass reaches top_p: keep a token while the mass
        # before it is below top_p
        kept_B = jnp.sum(mass_BxV - jax.nn.softmax(sorted_BxV, axis=-1) < s.top_p, axis=-1)
        cut_Bx1 = jnp.take_along_axis(sorted_BxV, kept_B[:, None] - 1, axis=-1)
        logits_BxV = jnp.where(logits_BxV < cut_Bx1, -jnp.inf, logits_BxV)
    draw = jax.vmap(lambda k, row: jax.random.categorical(k, row))
    return draw(keys_B, logits_BxV).astype(jnp.int32)


def row_keys(seed: int, rows: int) -> jax.Array:
    """[rows] each row's key: (seed, row)."""
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(rows))


def at_step(keys_B: jax.Array, t) -> jax.Array:
    """[rows] each row's key for decode step t."""
    return jax.vmap(lambda k: jax.random.fold_in(k, t))(keys_B)


@dataclass
class Loaded:
    """A model ready to decode: its config, parameters (placed), mesh, and limits."""

    cfg: Config
    problem: Problem
    params: dict | None  # placed, layer stacks as tuples of their layers (by_layer); None: let go
    mesh: jax.sharding.Mesh
    positions: int  # the most positions it takes (prompt and new tokens)
    cache_dims: CacheDims
    source: str


def load(
    source: str,
    overrides: list[str],
    step: int | None = None,
    devices=None,
    command: str = "generate",
) -> Loaded:
    """A run directory's newest checkpoint (or `step`), or hf:DIR, placed for decoding
    on `devices` (default: all); `command` names the asker in an error."""
    if source.startswith(hf.SCHEME):
        directory = hf.directory_of(source)
        config = hf.read_config(directory)
        spec = _spec_of(config, source, command)
        given = {o.partition("=")[0][6:] for o in overrides if o.startswith("model.")}
        cfg = presets.load(spec.tiny, [f"model.init={source}", *overrides])
        cfg = presets.resolve_init(cfg, given)
        problem = registered(cfg.model, cfg.train.seq_len)
        fill = hf.initial_params(spec.hf, cfg.model, directory, problem.shapes)
        positions = hf.model_config(spec.hf, config).get("max_position_embeddings")
    else:
        run = Path(source)
        if not run.is_dir():
            raise ConfigError(f"{command}: {source}: no such run directory (or give hf:DIR)")
        saved, meta = export.run_params(run, step)
        cfg = presets.from_dict(meta["config"], overrides)
        if cfg.adapter.kind is AdapterKind.LORA:  # decoded with the adapters added in
            base = registered(cfg.model, cfg.train.seq_len)
            merged = lora.merged(base, cfg.adapter, cfg.model, saved)
            saved = {k: np.asarray(v) for k, v in merged.items()}

        def fill(targets):
            changed = [
                f"{k} {tuple(saved[k].shape)} as saved, {tuple(t.shape)} as configured"
                for k, t in targets.items()
                if k in saved and tuple(saved[k].shape) != tuple(t.shape)
            ]
            missing = sorted(set(targets) - set(saved))
            others = sorted(set(saved) - set(targets))
            if missing and others:  # leaves of another objective (a classifier head)
                raise ConfigError(
                    f"{command}: {source} was trained with train.objective="
                    f"{cfg.train.objective}: its checkpoint holds {others[0]} and no "
                    f"{missing[0]}, which decoding needs; give a language model's run"
                )
            if changed or missing:
                given = [o for o in overrides if o.startswith("model.")]
                raise ConfigError(
                    f"{command}: {source}'s checkpoint is not this model: "
                    + "; ".join(changed[:2] + [f"no {k}" for k in missing[:2]])
                    + f"; drop the overrides that change it ({' '.join(given) or 'none given'})"
                )
            return {k: jax.device_put(saved[k], t.sharding) for k, t in targets.items()}

        positions = None
    return placed(cfg, fill, overrides, devices, source, positions)


def random(preset: str, overrides: list[str] = (), devices=None) -> Loaded:
    """A preset's model with its random initial parameters (train.seed), for decoding."""
    cfg = presets.load(preset, list(overrides))
    problem = registered(cfg.model, cfg.train.seq_len)

    def fill(targets):
        shardings = {k: t.sharding for k, t in targets.items()}
        return jax.jit(problem.init, out_shardings=shardings)(jax.random.key(cfg.train.seed))

    return placed(cfg, fill, list(overrides), devices, f"--config {preset}")


def placed(cfg: Config, fill, overrides, devices, source: str, positions=None) -> Loaded:
    """The model of `cfg` on a decoding layout of `devices` (default: all), its
    parameters from fill(targets: key -> ShapeDtypeStruct with its sharding)."""
    spec = registry.get(cfg.model.name)
    positions = positions_of(cfg.model, cfg.train.seq_len) if positions is None else positions
    cfg, mesh, problem, shardings = layout(cfg, overrides, devices)
    targets = {
        k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[k])
        for k, s in problem.shapes.items()
    }
    params = by_layer(fill(targets), problem.names)
    return Loaded(cfg, problem, params, mesh, int(positions), spec.cache_dims(cfg.model), source)


def positions_of(model: Model, seq_len: int) -> int:
    """The most positions `model` takes, trained at `seq_len`: what its export writes
    (the trained length, or more)."""
    spec = registry.get(model.name)
    to_hf = spec.hf.config_to_hf if spec.hf else None
    if to_hf is None:
        return seq_len
    return int(to_hf(model, seq_len)["max_position_embeddings"])


def layout(cfg: Config, overrides, devices=None, problem: Problem | None = None):
    """(cfg with decoding's parallel.*, its mesh over `devices` (default: all; in their
    order), the model as a Problem (or `problem`, the same model with adapters), each
    parameter's sharding there): data x tensor, as the module's docstring says."""
    devices = jax.devices() if devices is None else devices
    spec = registry.get(cfg.model.name)
    if spec.cache_dims is None:
        raise ConfigError(
            f"model.name={cfg.model.name} has no decoder with a KV cache, which generate "
            f"and eval read it through; these do: {', '.join(_decoders())}"
        )
    data, tensor = degrees(cfg.model, len(devices), overrides)
    # decoding's own layout, whatever the training layout was (pipeline, context, expert
    # and ZeRO are training's)
    par = dataclasses.replace(
        cfg.parallel,
        replica=1,
        data=data,
        expert=1,
        pipeline=1,
        context=1,
        tensor=tensor,
        zero=0,
        offload=Offload.NONE,
        sequence_parallel=False,
    )
    cfg = dataclasses.replace(cfg, parallel=par)
    mesh = build_mesh(par, devices[: data * tensor])
    problem = problem or registered(cfg.model, cfg.train.seq_len)
    specs = plan(problem.names, {k: s.shape for k, s in problem.shapes.items()}, zero=0,
                 mesh_shape=dict(mesh.shape))  # fmt: skip
    return cfg, mesh, problem, named(mesh, pick(specs, "storage"))


def layer_sharding(sharding: NamedSharding) -> NamedSharding:
    """A layer's sharding, of a layer stack placed as `sharding`."""
    return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))


def by_layer(params: dict, names: dict) -> dict:
    """`params` with each layer-stacked one (`layers` its first logical name) as a tuple
    of its layers' arrays, placed as the stack was: decoding unrolls its layers
    (jaxpar.nn.layers.unrolled), and each reads its weights where they lie, where a slice
    of the stack would be a copy each step. One parameter at a time, so the memory is the
    model's and one stack more."""
    for k in list(params):
        if names[k][:1] == (LAYERS,):
            stack = params.pop(k)
            split = lambda a: tuple(a)  # noqa: E731
            params[k] = jax.jit(split, out_shardings=layer_sharding(stack.sharding))(stack)
    return params


def restacked(params: dict) -> dict:
    """by_layer's parameters as the model takes them, inside a jitted program: XLA drops
    the stack where each layer takes its slice by a static index."""
    return {k: jnp.stack(v) if isinstance(v, tuple) else v for k, v in params.items()}


def degrees(model: Model, devices: int, overrides: list[str]) -> tuple[int, int]:
    """serving_layout()'s degrees, or those parallel.data / parallel.tensor among
    `overrides` set."""
    data, tensor = serving_layout(model, devices)
    given = presets.parse_overrides([o for o in overrides if o.startswith("parallel.")])
    given_d, given_t = (given.get("parallel", {}).get(k) for k in ("data", "tensor"))
    for key, value in (("data", given_d), ("tensor", given_t)):
        if value is not None and value != -1 and not 1 <= value <= devices:
            raise ConfigError(
                f"parallel.{key}={value}: generate runs on {devices} devices; give 1 to "
                f"{devices}, or -1 for the devices the other degree leaves"
            )
    if given_d == given_t == -1:
        raise ConfigError("parallel.data and parallel.tensor are both -1: give one of them")
    given_d, given_t = (None if v == -1 else v for v in (given_d, given_t))
    if given_t is not None or given_d is not None:
        tensor = given_t or max(1, devices // given_d)
        data = given_d or devices // tensor
    if data * tensor > devices:
        raise ConfigError(
            f"parallel.data={data} x parallel.tensor={tensor} = {data * tensor} devices, "
            f"but there are {devices}; give degrees whose product is at most {devices}"
        )
    return data, tensor


def _decoders() -> list[str]:
    return [n for n in registry.names() if registry.get(n).cache_dims is not None]


def _spec_of(config: dict, source: str, command: str):
    """The registered model whose Hugging Face format reads this config.json."""
    archs = config.get("architectures") or [config.get("model_type", "?")]
    formats = {
        a: n
        for n in registry.names()
        if registry.get(n).hf
        for a in registry.get(n).hf.architectures
    }
    name = next((formats[a] for a in archs if a in formats), None)
    if name is None:
        raise ConfigError(
            f"{command}: {source}: config.json says {archs[0]}, which jaxpar does not read; "
            f"supported: {', '.join(sorted(formats))}"
        )
    return registry.get(name)


@dataclass
class Generated:
    """What one batch of prompts gave."""

    completions: list[list[int]]  # new ids of each prompt (up to and with its stop id)
    prefill_tokens: int  # real prompt ids
    prefill_s: float
    decode_tokens: int  # new ids kept from the decode loop (each row's first: the prefill's)
    decode_s: float
    decode_steps: int  # steps of the decode loop (the first id is the prefill's)
    compile_s: float
    rows: int  # the batch, padded
    prompt_slots: int  # P
    cache_slots: int  # M
    drafted: int = 0  # speculative decoding's drafts (jaxpar.generation.speculative)
    accepted: int = 0  # ... and those the model accepted


def bucket(n: int) -> int:
    """The slots of n prompt ids: the next power of two, at least PROMPT_BUCKET."""
    return max(PROMPT_BUCKET, 1 << (n - 1).bit_length())


class Decoder:
    """The jitted prefill and decode loop of one model (compiled per bucket)."""

    def __init__(self, m: Loaded):
        self.m = m
        self.rows = NamedSharding(m.mesh, PartitionSpec(DATA))
        self.dtype = jnp.float32

        def run(params, tokens, positions, cache, slot, pad):
            model = m.problem.module(restacked(params))
            logits, cache = model.decode(tokens, positions, cache, slot, pad)
            return logits[:, -1].astype(jnp.float32), cache

        def first(params, tokens, positions, cache, pad, keys, sampling):
            """The prefill, and the first new id of each row sampled from it."""
            logits, cache = run(params, tokens, positions, cache, 0, pad)
            return sample(logits, at_step(keys, 0), sampling), cache

        def chunk(params, ids, cache, slot, pad, keys, t, sampling):
            """CHUNK decode steps on the device from step t (slot `slot`): each row's
            last id in, its next sampled with its key of that step; the ids [B, CHUNK]."""
            model = m.problem.module(params)

            def step(carry, i):
                ids, cache = carry
                at = slot + i
                positions = (at - pad)[:, None]
                logits, cache = model.decode(ids[:, None], positions, cache, at, pad)
                keys_i = at_step(keys, t + i + 1)
                nxt = sample(logits[:, -1].astype(jnp.float32), keys_i, sampling)
                return (nxt, cache), nxt

            (_, cache), out = jax.lax.scan(step, (ids, cache), jnp.arange(CHUNK))
            return out.T, cache

        self.first = jax.jit(first, donate_argnums=3, static_argnums=6)
        self.chunk = jax.jit(chunk, donate_argnums=2, static_argnums=7)
        self.compiled: dict = {}
        self.zeros: dict = {}

    def programs(self, tokens: tuple[int, int], slots: int, sampling: Sampling):
        """(prefill, decode loop) compiled for prompts of `tokens` = (rows, P) ids in a
        cache of `slots`, and for `sampling`'s cut (not its seed: the key is an
        argument): compiled on first use, kept for the next call (a rollout's each)."""
        cut = dataclasses.replace(sampling, seed=0)
        at = (tokens, slots, cut)
        if at not in self.compiled:
            m, (rows, p_slots) = self.m, tokens
            ids = jax.ShapeDtypeStruct(tokens, jnp.int32, sharding=self.rows)
            per_row = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=self.rows)
            cache = self.cache_shapes(rows, slots)
            key = jax.ShapeDtypeStruct((rows,), jax.random.key(0).dtype, sharding=self.rows)
            options = CPU_DECODE_OPTIONS if m.mesh.devices.flat[0].platform == "cpu" else {}
            self.compiled[at] = (
                self.first.lower(m.params, ids, ids, cache, per_row, key, cut).compile(options),
                self.chunk.lower(m.params, per_row, cache, p_slots, per_row, key, 0, cut).compile(
                    options
                ),
            )
        return self.compiled[at]

    def cache_shapes(self, rows: int, slots: int) -> list:
        """The cache: (k, v) of each layer, laid out as jaxpar.nn.attention.CACHE_NAMES
        and placed by the rules as the model's own key/value heads are; a windowed
        layer's, a ring of min(window, slots) slots."""
        c = self.m.cache_dims

        def one(names, dim, slots):
            sizes = {BATCH: rows, KV_HEADS: c.kv_heads, SEQ: slots, HEAD_DIM: dim}
            shape = tuple(sizes[n] for n in names)
            spec = NamedSharding(
                self.m.mesh, compute_spec(names, shape, RULES, dict(self.m.mesh.shape))
            )
            return jax.ShapeDtypeStruct(shape, self.dtype, sharding=spec)

        (k_names, v_names), n = CACHE_NAMES, c.slots
        return [
            (one(k_names, c.key_dim, n(i, slots)), one(v_names, c.value_dim, n(i, slots)))
            for i in range(c.layers)
        ]

    def empty(self, rows: int, slots: int) -> list:
        """cache_shapes' arrays, zeros (the program that makes them kept, as the others)."""
        if (rows, slots) not in self.zeros:
            shapes = self.cache_shapes(rows, slots)
            zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
            placed = jax.tree.map(lambda s: s.sharding, shapes)
            self.zeros[(rows, slots)] = jax.jit(zeros, out_shardings=placed)
        return self.zeros[(rows, slots)]()


def check_lengths(m: Loaded, prompts: list[list[int]], max_new: int) -> None:
    longest = max(len(p) for p in prompts)
    if not all(prompts):
        raise ConfigError("generate: an empty prompt; give each prompt some text")
    if longest + max_new > m.positions:
        raise ConfigError(
            f"generate: a prompt of {longest} tokens + --max-new-tokens {max_new} = "
            f"{longest + max_new} positions, but {m.source}'s model takes {m.positions}; "
            "shorten the prompt or ask for fewer new tokens"
        )


def left_padded(prompts: list[list[int]], rows: int):
    """(the prompts' ids left-padded to a bucket of P slots [rows, P], each row's padding
    [rows], each id's position from its row's first real one [rows, P]); the rows past
    the prompts hold one id, never read."""
    p_slots = bucket(max(len(p) for p in prompts))
    tokens = np.zeros((rows, p_slots), np.int32)
    pad = np.full(rows, p_slots - 1, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, p_slots - len(p) :], pad[i] = p, p_slots - len(p)
    positions = np.maximum(np.arange(p_slots)[None] - pad[:, None], 0).astype(np.int32)
    return tokens, pad, positions


class Completions:
    """Each prompt's new ids, kept as they come until its stop id, --max-new-tokens, or
    `finished(row, its ids)`; `on_token(row, id)` called for each id kept."""

    def __init__(self, prompts: int, max_new: int, stop: set[int], on_token=None, finished=None):
        self.ids: list[list[int]] = [[] for _ in range(prompts)]
        self.done = np.zeros(prompts, bool)
        self.max_new, self.stop, self.on_token, self.finished = max_new, stop, on_token, finished

    def take(self, ids: np.ndarray) -> bool:
        """Each row's ids [rows, T] in order, up to its end; whether every row has ended."""
        for step in range(ids.shape[1]):
            for i in np.flatnonzero(~self.done):
                self.ids[i].append(int(ids[i, step]))
                if self.on_token:
                    self.on_token(int(i), int(ids[i, step]))
                end = ids[i, step] in self.stop or len(self.ids[i]) == self.max_new
                end |= self.finished is not None and self.finished(int(i), self.ids[i])
                self.done[i] = end
        return bool(self.done.all())


def generate(
    decoder: Decoder,
    prompts: list[list[int]],
    max_new: int,
    sampling: Sampling,
    stop: set[int],
    on_token: Callable[[int, int], None] | None = None,
    keys: jax.Array | None = None,
    rows: int = 0,
    finished: Callable[[int, list[int]], bool] | None = None,
) -> Generated:
    """The continuations of `prompts` (ids), decoded together; `on_token(row, id)` is
    called for each new id kept, as it is generated. Prompt i is sampled with keys[i]
    (default: row_keys(sampling.seed, ...), a key per row from the seed). The batch is
    padded to `rows` (default: the prompts, to a multiple of the data degree), so that
    batches of fewer prompts share its programs; a row also ends where
    `finished(row, its new ids)` says so (a stop string in them)."""
    m = decoder.m
    check_lengths(m, prompts, max_new)
    data = m.mesh.shape[DATA]
    rows = math.ceil(max(len(prompts), rows) / data) * data
    tokens, pad, positions = left_padded(prompts, rows)
    p_slots = tokens.shape[1]
    m_slots = p_slots + math.ceil(max_new / NEW_BUCKET) * NEW_BUCKET
    put = lambda x: jax.device_put(x, decoder.rows)  # noqa: E731
    every = row_keys(sampling.seed, rows)
    if keys is not None:  # the padding rows keep their own
        every = jnp.concatenate([keys, every[len(prompts) :]])
    key = put(every)
    pad_d = put(pad)
    start = time.perf_counter()
    cache = decoder.empty(rows, m_slots)
    prefill, loop = decoder.programs(tokens.shape, m_slots, sampling)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    nxt, cache = prefill(m.params, put(tokens), put(positions), cache, pad_d, key)
    ids = np.asarray(nxt)[:, None]
    prefill_s = time.perf_counter() - start
    kept = Completions(len(prompts), max_new, stop, on_token, finished)
    start, t = time.perf_counter(), 0
    while not kept.take(ids):
        out, cache = loop(m.params, nxt, cache, p_slots + t, pad_d, key, t)
        nxt, ids = out[:, -1], np.asarray(out)
        t += CHUNK
    decode_s = time.perf_counter() - start
    return Generated(
        completions=kept.ids,
        prefill_tokens=sum(len(p) for p in prompts),
        prefill_s=prefill_s,
        decode_tokens=sum(max(len(c) - 1, 0) for c in kept.ids),
        decode_s=decode_s,
        decode_steps=t,
        compile_s=compile_s,
        rows=rows,
        prompt_slots=p_slots,
        cache_slots=m_slots,
    )


def cache_bytes_per_token(m: Loaded, slots: int = 0) -> int:
    """One token's cache: layers x key/value heads x (key + value dims) x bytes; at
    `slots` positions, the cache's bytes over them (windowed layers hold the window)."""
    return round(m.cache_dims.bytes_per_token(jnp.dtype(jnp.float32).itemsize, slots))
