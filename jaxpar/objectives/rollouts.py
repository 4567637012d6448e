"""GRPO's rollouts: each grpo.iterations-th step, the policy's completions to a batch of
prompts, sampled on the same devices in a generation layout, scored, and made into the
rows the next steps train on (jaxpar.objectives.grpo).

A rollout at step s:

1. reshards the trained weights from the training layout to the generation layout
   (`grpo.generate_layout`: by default tensor as `jaxpar generate` chooses it, the prompts
   over the rest) in one compiled program, whose collectives the ledger counts against
   their minimum: what each device lacks of its generation-layout shard. With adapters
   only the adapters move: the base is placed there once and each rollout adds the
   adapters to it on the devices. A pipeline or offloaded layout passes through the host;
2. samples grpo.group completions to each of train.batch_size / group prompts (the
   prompts of rollout s / iterations, an epoch's permutation drawn from the seed), with
   the KV-cache decoder; each completion's key is (train.seed, s, prompt, sample), so a
   resumed run samples the same completions;
3. scores them with the reward functions (jaxpar.objectives.rewards) and makes each
   completion's advantage; with grpo.iterations > 1 the sampler's log-probabilities, and
   with grpo.beta > 0 the reference's, are computed there too, in the generation layout;
4. appends them to the run directory's rollouts.jsonl (text and ids, rewards, advantage).

With grpo.rollout_devices=N the rollouts run on the first N devices and the trainer's mesh
on the rest: the trained leaves are sent there after each update (what lands on each is
counted against what it lacks). With grpo.staleness=k the rollout step t trains on is the
policy's after step t - k, made on a thread of its own beside the steps (with a split) or
ahead (without one), its sampler's log-probabilities stored for the ratio.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.adapters import lora
from jaxpar.config import registry
from jaxpar.config.sections import AdapterKind, Config, Offload, computed_model
from jaxpar.cost import ledger
from jaxpar.cost.report import human_bytes
from jaxpar.data import chat, pairs, prompts
from jaxpar.data import tokens as data
from jaxpar.errors import ConfigError
from jaxpar.generation import decoding
from jaxpar.names import LAYERS
from jaxpar.nn.problem import Problem, registered
from jaxpar.objectives import episodes, reference, reward_model, rewards
from jaxpar.objectives.reference import COPY
from jaxpar.parallel.axes import DATA
from jaxpar.parallel.sharding import check_tensor_split, tensor_dims
from jaxpar.training.hooks import Hook

FILE = "rollouts.jsonl"
# a rollout row's columns beside its ids (read by the loss, jaxpar.objectives.grpo)
ADVANTAGES, OLD, REF = "advantages", "old_logps", "ref_logps"
PAD_ID = episodes.PAD_ID
STD_EPSILON = 1e-4  # added to a group's std before dividing by it (TRL's)


@dataclass(frozen=True)
class Sampled:
    """A rollout's completions: what the rewards get, the rows, what rollouts.jsonl keeps."""

    prompts: list  # as the rewards get them, a prompt repeated for each of its group's
    completions: list
    fields: dict
    rows: dict  # tokens and loss_mask
    ids: list[list[int]]  # each completion's ids after its prompt
    lengths: list[int]  # the policy's ids in each
    episodes: list | None = None  # grpo.env's (jaxpar.objectives.episodes)
    texts: list[str] | None = None  # one turn's decoded text


class Rollouts(Hook):
    """batches(step) for a GRPO run: the rows of the latest rollout (the module's
    docstring); `bind` places it on a run's devices, `before(state, step)` rolls out."""

    def __init__(self, cfg: Config, own: Problem, devices: int, generators: list | None = None):
        cfg = dataclasses.replace(
            cfg, model=computed_model(cfg.model, cfg.train.objective)
        )  # scored as trained
        g, t = cfg.grpo, cfg.train
        if jax.process_count() > 1:
            raise ConfigError(
                "train.objective=grpo: rollouts decode in one process for now; run it on one "
                "host (jaxpar train without launch)"
            )
        self.overrides = _layout_overrides(g.generate_layout)
        data_, tensor = decoding.degrees(cfg.model, devices, self.overrides)
        if data_ * tensor != devices:
            raise ConfigError(
                f"grpo.generate_layout={g.generate_layout}: data={data_} x tensor={tensor} = "
                f"{data_ * tensor} devices, but the run has {devices}, and the rollouts use them "
                f"all; give degrees whose product is {devices}"
            )
        shipped = registered(cfg.model, t.seq_len)
        check_tensor_split(tensor_dims(shipped.names, shipped.shapes), tensor)
        self.cfg, self.own, self.generators = cfg, own, generators
        self.held = prompts.load(cfg.data, cfg.model.vocab)
        self.rewards = rewards.load(g, cfg.data, cfg.model.vocab)
        tokenizer = data.tokenizer_of(cfg.data)
        self.tok = chat.tokenizer(Path(tokenizer)) if tokenizer else None
        self.env = episodes.load(g.env) if g.env else None
        if self.env is not None and self.tok is None:
            raise ConfigError(
                f"grpo.env={g.env}: data.path={cfg.data.path} records no tokenizer, which the "
                "turns are decoded and the observations encoded with; prepare the prompts "
                "with --tokenizer"
            )
        if self.env is not None:
            self.told = episodes.told(self.tok, chat.Template(Path(tokenizer)), self.held.stop)
        if t.batch_size % g.group:
            raise ConfigError(
                f"train.batch_size={t.batch_size} counts completions, grpo.group={g.group} to "
                f"a prompt; give a multiple of {g.group}"
            )
        longest = max(len(p) for p in self.held.ids)
        positions = decoding.positions_of(cfg.model, cfg.train.seq_len)
        if longest + g.max_new_tokens > positions:
            raise ConfigError(
                f"grpo.max_new_tokens={g.max_new_tokens}: the longest prompt of data.path "
                f"({longest} ids) and its completion need {longest + g.max_new_tokens} "
                f"positions, but the model takes {positions}; give grpo.max_new_tokens <= "
                f"{max(positions - longest, 0)}"
            )
        if longest + g.max_new_tokens > t.seq_len + 1:
            raise ConfigError(
                f"train.seq_len={t.seq_len}: a row holds a prompt and its completion, up to "
                f"{longest} + grpo.max_new_tokens={g.max_new_tokens} = "
                f"{longest + g.max_new_tokens} ids (train.seq_len + 1); set train.seq_len="
                f"{longest + g.max_new_tokens - 1} or more, or lower grpo.max_new_tokens"
            )
        self.count = t.batch_size // g.group  # prompts a rollout
        rows, width = t.batch_size, t.seq_len
        self.current = {
            "tokens": np.zeros((rows, width + 1), np.int32),
            "loss_mask": np.zeros((rows, width + 1), np.int32),
            ADVANTAGES: np.zeros(rows, np.float32),
            **({OLD: np.zeros((rows, width), np.float32)} if self._behaviour else {}),
            **({REF: np.zeros((rows, width), np.float32)} if g.beta else {}),
        }
        self.file: Path | None = None
        self.pending: dict[int, Future] = {}  # rollouts in flight (staleness, a split)
        self.worker = None  # with grpo.rollout_devices: the thread they are made on

    @property
    def _behaviour(self) -> bool:
        """Whether a rollout stores its sampler's log-probabilities (the ratio's old)."""
        return self.cfg.grpo.iterations > 1 or self.cfg.grpo.staleness > 0

    def __call__(self, step: int, rows: slice = slice(None)) -> dict:
        return {k: v[rows] for k, v in self.current.items()}

    # -- placement ---------------------------------------------------------------------

    def start(self, run, state, files: Path | None, start: int) -> str:
        """Place the generation layout on `run`'s devices (the base and the reference
        there once, from `state`), compile the reshard and count its bytes; returns the
        start-up summary's lines."""
        cfg, g = self.cfg, self.cfg.grpo
        self._engine, self._train_mesh = run.engine, run.mesh
        devices = self.generators or list(run.mesh.devices.flat)
        gen_cfg, mesh, plain, shardings = decoding.layout(cfg, self.overrides, devices)
        _, _, _, own_shardings = decoding.layout(cfg, self.overrides, devices, self.own)
        self.mesh = mesh
        self.rows = NamedSharding(mesh, PartitionSpec(DATA))
        self.trained = [k for k in self.own.names if k not in self.own.frozen]
        self.adapters = cfg.adapter.kind is AdapterKind.LORA
        self.direct = run.engine.layout is None and cfg.parallel.offload is Offload.NONE
        layered = {k for k in plain.names if plain.names[k][:1] == (LAYERS,)}
        out = {  # decoding.by_layer's: a layer stack as a tuple of its layers
            k: (decoding.layer_sharding(s),) * plain.shapes[k].shape[0] if k in layered else s
            for k, s in shardings.items()
        }

        def publish(trained, base):
            """The model's parameters, by layer (decoding.by_layer), from the trained
            leaves and (adapters) the frozen base. The trained leaves are moved first
            (XLA would rather gather the adapters' product, a weight's size)."""
            moved = {k: jax.lax.with_sharding_constraint(v, self.gen_shardings[k])
                     for k, v in trained.items()}  # fmt: skip
            params = {**base, **moved}
            if self.adapters:
                params = lora.merged(plain, cfg.adapter, cfg.model, params)
            # copies: an output the input forwarded would be the state's buffer, which
            # the next step donates
            return {
                k: tuple(params[k]) if k in layered else jnp.copy(params[k]) for k in plain.names
            }

        self.publish = jax.jit(publish, out_shardings=out)
        self.gen_shardings = {k: own_shardings[k] for k in self.own.names}
        params = self._model_layout(state)
        frozen = [k for k in self.own.frozen if k in self.own.names]
        self.base = self._placed({k: params[k] for k in frozen})
        self.reference = None
        if g.beta:  # a copy of the trained leaves (their start), or none: the base alone
            copy = reference.read(params, self.trained)
            self.reference = self._placed(copy)
        positions = decoding.positions_of(cfg.model, cfg.train.seq_len)
        dims = registry.get(cfg.model.name).cache_dims(cfg.model)
        # its parameters are published for each rollout and let go after it: between
        # rollouts the devices hold the training state (and a reference's copy) alone
        self.loaded = decoding.Loaded(gen_cfg, plain, None, mesh, positions, dims, "the policy")
        self.decoder = decoding.Decoder(self.loaded)
        self.score = jax.jit(
            lambda p, batch: -plain.loss(decoding.restacked(p), batch),
            out_shardings=NamedSharding(mesh, PartitionSpec()),
        )
        self.bytes = self._reshard_bytes(state)
        self.placed = [r.function.place(devices, cfg.train.seq_len + 1) for r in self._models()]
        self.pending = {}  # a resumed run's first rollouts: from its resumed policy
        if self.generators and g.staleness:  # made beside the steps
            self.worker = ThreadPoolExecutor(1, thread_name_prefix="rollouts")
        self.file = files / FILE if files else None
        if self.file and self.file.exists():  # a resumed run: the rollouts of its steps done
            kept = [
                line
                for line in self.file.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= start
            ]
            self.file.write_text("".join(f"{line}\n" for line in kept))
        return self.describe()

    def _sent(self, trained: dict) -> dict:
        """The trained leaves on the generators' devices (grpo.rollout_devices), in their
        layout there; `trained` itself where the two share the devices."""
        if not self.generators:
            return trained
        return {k: jax.device_put(v, self.gen_shardings[k]) for k, v in trained.items()}

    def _published(self, state) -> dict:
        """The policy of `state`, by layer, in the generation layout: copies of its
        leaves, there once this returns (the next step donates the state's)."""
        return jax.block_until_ready(self.publish(self._sent(self._trained(state)), self.base))

    def _model_layout(self, state) -> dict:
        """The state's parameters in the model's own layout (on the host where the
        training layout is staged or offloaded)."""
        return state.params if self.direct else self._engine.export(state.params)

    def _trained(self, state) -> dict:
        params = self._model_layout(state)
        return {k: params[k] for k in self.trained}

    def _placed(self, leaves: dict) -> dict:
        """`leaves` in the generation layout (their keys' shardings there), copies of the
        state's (which the next step donates)."""
        return {k: jax.device_put(v, self.gen_shardings[k.removeprefix(COPY)], may_alias=False)
                for k, v in leaves.items()}  # fmt: skip

    def _reshard_bytes(self, state) -> dict:
        """Bytes per device the reshard moves, against its minimum: what each device
        lacks of its generation-layout shard of each trained leaf."""
        trained = self._trained(state)
        lacks: dict = {}
        for k, x in trained.items():
            shape, size = x.shape, x.dtype.itemsize
            have = x.sharding.devices_indices_map(shape) if self.direct else {}
            for d, want in self.gen_shardings[k].devices_indices_map(shape).items():
                volume = _volume(want, shape)
                held = _overlap(want, have[d], shape) if d in have else 0
                lacks[d] = lacks.get(d, 0) + (volume - held) * size
        minimum = max(lacks.values(), default=0)
        if self.generators:  # sent to devices of their own: what lands on each
            landed: dict = {}
            for x in self._sent(trained).values():
                for shard in x.addressable_shards:
                    landed[shard.device] = landed.get(shard.device, 0) + shard.data.nbytes
            return {"wire": max(landed.values()), "minimum": minimum, "through_host": False}
        if not self.direct:  # through the host: every byte of each device's shard
            return {"wire": minimum, "minimum": minimum, "through_host": True}
        hlo = self.publish.lower(trained, self.base).compile().as_text()
        wire = ledger.read(hlo, dict(self._train_mesh.shape)).wire_bytes()
        return {"wire": wire, "minimum": minimum, "through_host": False}

    def _models(self) -> list:
        """The reward models among grpo.reward's (jaxpar.objectives.reward_model)."""
        return [r for r in self.rewards if isinstance(r.function, reward_model.RewardModel)]

    def describe(self) -> str:
        b = self.bytes
        ratio = f"{b['wire'] / b['minimum']:.3f} x" if b["minimum"] else "-"
        how = "through the host" if b["through_host"] else "on the devices"
        if self.generators:
            how = f"to the {len(self.generators)} rollout devices"
        moved = "the adapters" if self.adapters else "the weights"
        layout = " x ".join(f"{a}={n}" for a, n in self.mesh.shape.items() if n > 1) or "1 device"
        return (
            f"  rollouts  {self.count} prompts x grpo.group={self.cfg.grpo.group}, up to "
            f"{self.cfg.grpo.max_new_tokens} new ids, in {layout}{self._apart()}\n"
            f"  reshard   {moved} {how}: {human_bytes(b['wire'])} per device a rollout; "
            f"minimum {human_bytes(b['minimum'])} ({ratio})"
        ) + "".join(f"\n{line}" for line in [*self.placed, *self._episodes_line()])

    def _apart(self) -> str:
        """How the rollouts stand to the steps (grpo.rollout_devices, grpo.staleness)."""
        k, ids = self.cfg.grpo.staleness, [d.id for d in self.generators or ()]
        where = f" on devices {ids[0]}-{ids[-1]}, the trainer on the rest" if ids else ""
        if not k:
            return where
        when = "made beside the steps" if ids else "made ahead"
        return f"{where}; {when}, by the policy up to grpo.staleness={k} steps back"

    def _episodes_line(self) -> list[str]:
        g = self.cfg.grpo
        if self.env is None:
            return []
        return [
            f"  episodes  grpo.env={g.env}, up to grpo.max_turns={g.max_turns} turns; its "
            "observations are tool turns, never trained on"
        ]

    def summary(self) -> dict:
        """summary.json's `grpo`: the generation layout and the reshard's bytes (at the
        run's end: the rollouts still in flight are let go)."""
        if self.worker is not None:
            self.worker.shutdown(cancel_futures=True)
            self.worker, self.pending = None, {}
        b, models = self.bytes, [r.function.summary() for r in self._models()]
        return {
            "grpo": {
                "generate_layout": dict(self.mesh.shape),
                "rollout_devices": [d.id for d in self.generators or ()],
                "staleness": self.cfg.grpo.staleness,
                "reshard": {
                    "wire_bytes_per_device": b["wire"],
                    "minimum_bytes_per_device": b["minimum"],
                    "ratio": b["wire"] / b["minimum"] if b["minimum"] else None,
                    "through_host": b["through_host"],
                },
                **({"reward_models": models} if models else {}),
            }
        }

    # -- a rollout ---------------------------------------------------------------------

    def boundary(self, step: int) -> bool:
        """A run stops between rollouts only (where its resume rolls out)."""
        return step % self.cfg.grpo.iterations == 0

    def before_due(self, step: int) -> bool:
        return step % self.cfg.grpo.iterations == 0

    def before(self, state, step: int) -> dict:
        """Roll out for step `step` (0-based) from `state`, or (grpo.staleness, a split)
        take the rollout made for it from an earlier policy: this step's rows, and the
        metrics of the rollout (its row's columns)."""
        waited = None
        if self.cfg.grpo.staleness or self.generators:
            made, reshard_s, waited = self._ahead(state, step)
        else:
            start = time.perf_counter()
            params = self._published(state)
            reshard_s = time.perf_counter() - start
            made = self._made(step, step, params)
        self.current = made.batch
        self._write(made)
        return self._metrics(made, reshard_s, waited)

    def _ahead(self, state, step: int) -> tuple[_Made, float, float]:
        """(rollout `step` from those in flight, the reshard's seconds, the wait for it):
        this step's policy is sent for the rollout grpo.staleness steps on (at a run's
        first step, for those up to it too), made on the rollout devices' thread while
        the steps between run, or here at once without a split."""
        k, steps = self.cfg.grpo.staleness, self.cfg.train.steps
        wanted = range(step if not self.pending else step + k, min(step + k + 1, steps))
        start = time.perf_counter()
        params = self._published(state) if wanted else None
        reshard_s = time.perf_counter() - start
        for s in wanted:
            if self.worker is None:
                self.pending[s] = Future()
                self.pending[s].set_result(self._made(s, step, params))
            else:
                self.pending[s] = self.worker.submit(self._made, s, step, params)
        start = time.perf_counter()
        made = self.pending.pop(step).result()
        return made, reshard_s, time.perf_counter() - start

    def _made(self, step: int, version: int, params: dict) -> _Made:
        """The rollout for step `step` by `params`, the policy after `version` steps:
        sampled, scored, its rows with their advantages and (where the loss reads them)
        the sampler's and the reference's log-probabilities."""
        g = self.cfg.grpo
        self.loaded.params = params
        index = pairs.indices(len(self.held), seed=self.cfg.train.seed,
                              step=step // g.iterations, batch_size=self.count)  # fmt: skip
        start = time.perf_counter()
        out = self._sampled(step, index)
        generate_s = time.perf_counter() - start
        start = time.perf_counter()
        total, each = rewards.score(self.rewards, out.prompts, out.completions, out.fields)
        if out.episodes is not None:  # the environment's, beside the functions'
            each["env"] = np.array([e.reward for e in out.episodes], np.float64)
            total = total + each["env"]
        advantages = group_advantages(total.reshape(self.count, g.group), g.scaled)
        batch = {**out.rows, ADVANTAGES: advantages}
        if self._behaviour:
            batch[OLD] = self._logps(params, batch)
        if g.beta:
            reference = self.publish(self.reference, self.base)
            batch[REF] = self._logps(reference, batch)
        self.loaded.params = None
        times = {"generate_s": generate_s, "score_s": time.perf_counter() - start}
        return _Made(step, version, index, out, total, each, batch, times)

    def _metrics(self, made: _Made, reshard_s: float, waited: float | None) -> dict:
        """A rollout's columns in its step's metrics row."""
        g, total, out = self.cfg.grpo, made.total, made.out
        lengths = np.asarray(out.lengths)
        groups = total.reshape(self.count, g.group)
        lag = {}
        if waited is not None:  # which policy sampled it, and how long the step waited
            lag = {"policy_version": made.version, "staleness": made.step - made.version,
                   "rollout_wait_s": waited}  # fmt: skip
        return {
            "reward": float(total.mean()),
            "reward_std": float(total.std(ddof=1)) if total.size > 1 else 0.0,
            **{f"rewards/{n}/mean": float(v.mean()) for n, v in made.each.items()},
            "frac_reward_zero_std": float(np.mean(groups.std(axis=1) == 0)),
            "completions/mean_length": float(lengths.mean()),
            "completions/max_length": int(lengths.max()),
            **(
                {"turns/mean": float(np.mean([len(e.turns) for e in out.episodes]))}
                if out.episodes is not None
                else {}
            ),  # fmt: skip
            "generate_s": made.times["generate_s"],
            "generate_tokens_per_s": float(lengths.sum() / made.times["generate_s"]),
            "reshard_s": reshard_s,
            "score_s": made.times["score_s"],
            **lag,
        }

    def _sampled(self, step: int, index: np.ndarray) -> Sampled:
        """The rollout's completions to the prompts `index` (grpo.group each): one turn
        each, or with grpo.env an episode each (jaxpar.objectives.episodes)."""
        cfg, g = self.cfg, self.cfg.grpo
        asked = [self.held.ids[i] for i in index for _ in range(g.group)]
        prompts_ = [self.held.asked[i] for i in index for _ in range(g.group)]
        fields = [self.held.fields[i] for i in index for _ in range(g.group)]
        keys = sample_keys(cfg.train.seed, step, index, g.group)
        sampling = decoding.Sampling(g.temperature, 0, g.top_p, cfg.train.seed)
        if self.env is not None:
            played = self._episodes(asked, prompts_, fields, keys, sampling)
            return Sampled(prompts_, [e.completion() for e in played], _fields(fields),
                           episodes.rows(played, cfg.train.seq_len), [e.ids for e in played],
                           [sum(e.mask) for e in played], played)  # fmt: skip
        done = decoding.generate(self.decoder, asked, g.max_new_tokens, sampling,
                                 self.held.stop, keys=keys)  # fmt: skip
        texts = [self._text(c) for c in done.completions]
        completions = [
            t if isinstance(p, str) else [{"role": "assistant", "content": t}]
            for p, t in zip(prompts_, texts, strict=True)
        ]
        return Sampled(prompts_, completions, _fields(fields),
                       rows_of(asked, done.completions, cfg.train.seq_len), done.completions,
                       [len(c) for c in done.completions], None, texts)  # fmt: skip

    def _episodes(self, asked, prompts_, fields, keys, sampling) -> list:
        """An episode for each prompt: turns sampled together, each episode's turn t
        with its key folded with t, until each is done (jaxpar.objectives.episodes)."""
        g = self.cfg.grpo
        room = min(self.cfg.train.seq_len + 1, self.loaded.positions)  # a row, the model
        played = [episodes.Episode(ids, p, episodes.started(self.env, p, f, g.env))
                  for ids, p, f in zip(asked, prompts_, fields, strict=True)]  # fmt: skip
        for turn in range(g.max_turns):
            live = [i for i, e in enumerate(played) if not e.done]
            if not live:
                break
            new = min(g.max_new_tokens, min(room - len(played[i].context) for i in live))
            turned = jax.vmap(jax.random.fold_in, (0, None))(keys, turn) if turn else keys
            out = decoding.generate(self.decoder, [played[i].context for i in live], new,
                                    sampling, self.held.stop,
                                    keys=turned[np.array(live)], rows=len(played))  # fmt: skip
            for i, ids in zip(live, out.completions, strict=True):
                text = self._text(ids)
                answer = episodes.answered(played[i].env, text, g.env)
                played[i].took(ids, text, answer, self.told, room, turn == g.max_turns - 1)
        return played

    def _text(self, ids: list[int]) -> str:
        if self.tok is None:
            return " ".join(map(str, ids))
        return self.tok.decode([i for i in ids if i not in self.held.stop])

    def _logps(self, params, batch) -> np.ndarray:
        """[rows, seq_len] each trained target's log-probability under `params` (in the
        generation layout; the rows padded to a multiple of its data degree)."""
        rows = len(batch["tokens"])
        data_ = self.mesh.shape[DATA]
        pad = math.ceil(rows / data_) * data_ - rows
        keys = ("tokens", "loss_mask")
        padded = {k: np.concatenate([batch[k], np.repeat(batch[k][:1], pad, 0)]) for k in keys}
        placed = jax.device_put(padded, self.rows)
        return np.asarray(self.score(params, placed))[:rows].astype(np.float32)

    def _write(self, made: _Made) -> None:
        if self.file is None:
            return
        g, step, index, out = self.cfg.grpo, made.step, made.index, made.out
        total, each, advantages = made.total, made.each, made.batch[ADVANTAGES]
        with self.file.open("a") as f:
            for row, ids in enumerate(out.ids):
                prompt = index[row // g.group]
                line = {
                    "step": step + 1,
                    "prompt_index": int(prompt),
                    "sample": row % g.group,
                    "prompt": self.held.asked[prompt],
                    "completion": out.texts[row] if out.texts else out.completions[row],
                    "prompt_ids": self.held.ids[prompt],
                    "completion_ids": ids,
                    "reward": float(total[row]),
                    "rewards": {n: float(v[row]) for n, v in each.items()},
                    "advantage": float(advantages[row]),
                }
                if out.episodes is not None:  # which ids are the policy's (1), told (0)
                    line |= {"loss_mask": out.episodes[row].mask, "turns": out.episodes[row].turns}
                if g.staleness or self.generators:  # the sampler: its version, its logps
                    line["policy_version"] = made.version
                if g.staleness:  # of the row's trained targets, in order
                    trained = made.batch["loss_mask"][row, 1:] != 0
                    line["behaviour_logps"] = made.batch[OLD][row][trained].tolist()
                f.write(json.dumps(line) + "\n")


@dataclass(frozen=True)
class _Made:
    """A rollout made for its step, maybe on the rollout devices' thread."""

    step: int
    version: int  # the steps the policy that sampled it had taken
    index: np.ndarray  # its prompts
    out: Sampled
    total: np.ndarray  # each completion's reward
    each: dict  # each reward's
    batch: dict  # the step's rows
    times: dict  # generate_s, score_s


def sample_keys(seed: int, step: int, prompts_: np.ndarray, group: int) -> jax.Array:
    """[len(prompts) x group] each completion's key: (seed, step, prompt, sample)."""
    base = jax.random.fold_in(jax.random.key(seed), step)
    p = jnp.repeat(jnp.asarray(prompts_, jnp.uint32), group)
    s = jnp.tile(jnp.arange(group, dtype=jnp.uint32), len(prompts_))
    fold = jax.random.fold_in
    return jax.vmap(lambda i, j: fold(fold(base, i), j))(p, s)


def _fields(rows: list[dict]) -> dict:
    """The prompts' other fields, each a list parallel to the completions (None where a
    line lacks it)."""
    names = sorted({k for r in rows for k in r})
    return {k: [r.get(k) for r in rows] for k in names}


def _layout_overrides(text: str) -> list[str]:
    """grpo.generate_layout as generate's parallel.* overrides."""
    if text.strip() in ("", "auto"):
        return []
    out = []
    for part in text.split(","):
        axis, sep, value = part.strip().partition("=")
        if not sep or axis not in ("data", "tensor") or not value.strip().lstrip("-").isdigit():
            raise ConfigError(
                f"grpo.generate_layout={text}: write auto, tensor=T or data=D,tensor=T "
                "(the rollouts' degrees on the run's devices)"
            )
        out.append(f"parallel.{axis}={int(value)}")
    return out


def _volume(index: tuple, shape: tuple) -> int:
    return math.prod(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))


def _overlap(a: tuple, b: tuple, shape: tuple) -> int:
    out = 1
    for x, y, n in zip(a, b, shape, strict=True):
        x0, x1, _ = x.indices(n)
        y0, y1, _ = y.indices(n)
        out *= max(0, min(x1, y1) - max(x0, y0))
    return out


def group_advantages(rewards_PxG: np.ndarray, scaled: bool) -> np.ndarray:
    """[P x G] each completion's reward less its group's mean, over the group's std
    (TRL's: Bessel-corrected, + 1e-4) where `scaled`; flattened prompt-major."""
    r = np.asarray(rewards_PxG, np.float64)
    out = r - r.mean(axis=1, keepdims=True)
    if scaled:
        out = out / (r.std(axis=1, ddof=1, keepdims=True) + STD_EPSILON)
    return out.reshape(-1).astype(np.float32)


def rows_of(prompts: list[list[int]], completions: list[list[int]], seq_len: int) -> dict:
    """`tokens` [rows, seq_len + 1] (each prompt, its completion, padding) and `loss_mask`
    (1 at each completion id), one row per (prompt, completion)."""
    n = len(prompts)
    tokens = np.full((n, seq_len + 1), PAD_ID, np.int32)
    mask = np.zeros((n, seq_len + 1), np.int32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        tokens[i, : len(p) + len(c)] = p + c
        mask[i, len(p) : len(p) + len(c)] = 1
    return {"tokens": tokens, "loss_mask": mask}
