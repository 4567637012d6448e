"""LoRA on a registered model: which projections carry an adapter, and the Problem that
trains the adapters alone on a frozen base.

Each target weight W, in our layout [*stacked, *in, *out] (the layer computes x W),
carries A [*stacked, *in, r] and B [*stacked, r, *out] (PEFT's lora_A and lora_B,
transposed): the layer computes with W + (alpha / r) A B, assembled as jaxpar.scan_layers
makes the layer ready, after each part's ZeRO-3 gather or offload fetch. So every layout
that runs the model runs its adapters, each part placed by the rules of the dims it
shares with W (A by W's input dims, B by its output dims). A starts as PEFT's (uniform
in ±1/sqrt(fan-in)), B at zero: step 0 is the base model exactly. The base is frozen
(Problem.frozen) and stored as adapter.base says (jaxpar.adapters.quant)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxpar import hf
from jaxpar.adapters import quant
from jaxpar.config import registry
from jaxpar.config.sections import Adapter, BaseStorage, Train
from jaxpar.errors import ConfigError
from jaxpar.hf import Tensor
from jaxpar.names import LAYERS, LORA_A, LORA_B, LORA_RANK, SCALE_ONE
from jaxpar.nn.layers import Assembled
from jaxpar.nn.problem import Parts, Problem, registered

DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for every family jaxpar ships


@dataclass(frozen=True)
class Linear:
    """A projection of the layer stack: one of our leaves, an nn.Linear's weight in the
    Hugging Face files (one per layer, and per expert)."""

    tensor: Tensor
    stacked: int  # leading dims stacking it (layers; a mixture's experts)
    inputs: int  # the input dims after them (what x contracts)

    @property
    def key(self) -> str:
        return self.tensor.key

    @property
    def module(self) -> str:
        """PEFT's name of it: the module holding the weight, e.g. q_proj."""
        return self.tensor.name.split(".")[-2]

    @property
    def a(self) -> str:
        return f"{self.key}/{LORA_A}"

    @property
    def b(self) -> str:
        return f"{self.key}/{LORA_B}"

    @property
    def codes(self) -> str:
        return f"{self.key}/codes"

    @property
    def scale(self) -> str:
        return f"{self.key}/scale"

    def input_dims(self) -> tuple[int, ...]:
        return tuple(range(self.stacked, self.stacked + self.inputs))


def linears(tensors: list[Tensor]) -> list[Linear]:
    """The layer stack's nn.Linear weights among a model's tensors: [out, in] in the file,
    [in..., out...] in ours."""
    found = []
    for t in tensors:
        groups = hf.dims_of(t.file_dims)
        if "{layer}" not in t.name or not t.name.endswith(".weight") or len(groups) != 2:
            continue
        out, inp = groups
        if t.our_dims.split() == inp + out:
            found.append(Linear(t, len(t.stacked), len(inp)))
    return found


def model_linears(model) -> list[Linear]:
    """The projections of `model.*`'s model; refused if it has none PEFT can name."""
    fmt = registry.get(model.name).hf
    found = linears(fmt.tensors(model)) if fmt else []
    if not found:
        raise ConfigError(
            f"adapter.kind=lora: model.name={model.name} has no projections in Hugging Face's "
            "names to adapt; use a model with a Hugging Face format (llama, mistral, qwen2, "
            "qwen3, mixtral, qwen3-moe), or adapter.kind=none"
        )
    return found


def wanted(adapter: Adapter) -> list[str]:
    """adapter.targets, or PEFT's default for the family (q_proj, v_proj)."""
    return [t.strip() for t in adapter.targets.split(",") if t.strip()] or list(DEFAULT_TARGETS)


def targets_of(adapter: Adapter, model) -> list[Linear]:
    """The projections adapter.targets names, as PEFT's target_modules does: by module
    name (q_proj: every layer's), or by the end of its dotted path
    (shared_experts.gate_proj: the shared expert's alone, not the dense MLP's)."""
    found = model_linears(model)
    has = sorted({p.module for p in found})
    names = wanted(adapter)
    paths = {p.key: p.tensor.name.removesuffix(".weight") for p in found}
    hit = lambda p, t: p.module == t or paths[p.key].endswith("." + t)  # noqa: E731
    unknown = [t for t in names if not any(hit(p, t) for p in found)]
    if unknown and not adapter.targets.strip():
        raise ConfigError(
            f"adapter.targets: PEFT's default ({','.join(DEFAULT_TARGETS)}) is not among "
            f"model.name={model.name}'s projections; name them (PEFT has no default for it "
            f"either): its projections are {','.join(has)}"
        )
    if unknown:
        raise ConfigError(
            f"adapter.targets={','.join(names)}: model.name={model.name} has no "
            f"{', '.join(unknown)}; its projections are {','.join(has)} (or a dotted end "
            "of one's path, e.g. shared_experts.gate_proj)"
        )
    return [p for p in found if any(hit(p, t) for t in names)]


def quantized_of(adapter: Adapter, model, shapes: dict) -> list[Linear]:
    """The projections stored in fewer bits (adapter.base int8 or nf4): all of the layer
    stack's but a mixture's router, whose logits pick the experts."""
    if adapter.base not in (BaseStorage.INT8, BaseStorage.NF4):
        return []
    chosen = [p for p in model_linears(model) if not p.key.endswith("/router")]
    if adapter.base is BaseStorage.NF4:
        for p in chosen:
            last = shapes[p.key].shape[-1]
            if last % quant.NF4_BLOCK:
                raise ConfigError(
                    f"adapter.base=nf4: {p.key} {list(shapes[p.key].shape)} is quantized in "
                    f"blocks of {quant.NF4_BLOCK} along its last dim, and {last} is not a "
                    f"multiple of {quant.NF4_BLOCK}; choose dims that are (head_dim, embed and "
                    "mlp), or adapter.base=bf16"
                )
    return chosen


@struct.dataclass
class Quantized(Assembled):
    codes: jax.Array
    scale: jax.Array
    linear: Linear = struct.field(pytree_node=False)
    kind: str = struct.field(pytree_node=False)

    def ready(self, fetch):
        p = self.linear
        return quant.dequantize(self.kind, fetch(p.codes, self.codes), fetch(p.scale, self.scale))


@struct.dataclass
class LowRank(Assembled):
    base: Any  # the frozen weight as stored (an array, or Quantized)
    a: jax.Array
    b: jax.Array
    linear: Linear = struct.field(pytree_node=False)
    scale: float = struct.field(pytree_node=False)

    def ready(self, fetch):
        p = self.linear
        w = self.base.ready(fetch) if isinstance(self.base, Assembled) else fetch(p.key, self.base)
        a, b = fetch(p.a, self.a), fetch(p.b, self.b)
        return w + (self.scale * delta(p, a, b)).astype(w.dtype)


def delta(p: Linear, a, b) -> jax.Array:
    """A B over the rank, in W's layout (any leading dims alike on both)."""
    letters = "ijklmnopqstuvw"
    outputs = b.ndim - (a.ndim - p.inputs)  # b: [..., r, *out]; a: [..., *in, r]
    i, o = letters[: p.inputs], letters[p.inputs : p.inputs + outputs]
    return jnp.einsum(f"...{i}z,...z{o}->...{i}{o}", a, b)


def scale_of(adapter: Adapter) -> float:
    return adapter.alpha / adapter.rank


def _stored(problem: Problem, adapter: Adapter, targets, quantized) -> tuple[dict, dict]:
    """(logical names, ShapeDtypeStructs) of every stored leaf: the base's as
    adapter.base keeps them (a quantized weight as its codes and scales), then each
    target's A and B in fp32."""
    kind, r = str(adapter.base), adapter.rank
    names, shapes = {}, {}
    low = adapter.base is not BaseStorage.SAME  # bf16, or what is not quantized
    for k, n in problem.names.items():
        s = problem.shapes[k]
        if any(p.key == k for p in quantized):
            continue
        dtype = jnp.bfloat16 if low and jnp.issubdtype(s.dtype, jnp.floating) else s.dtype
        names[k], shapes[k] = n, jax.ShapeDtypeStruct(s.shape, dtype)
    for p in quantized:
        shape, n = problem.shapes[p.key].shape, problem.names[p.key]
        (codes, dtype), scales = quant.storage(kind, shape, p.input_dims())
        names[p.codes], shapes[p.codes] = n, jax.ShapeDtypeStruct(codes, dtype)
        scale_names = (
            n
            if kind == "nf4"
            else tuple(SCALE_ONE if i in p.input_dims() else d for i, d in enumerate(n))
        )
        names[p.scale], shapes[p.scale] = scale_names, jax.ShapeDtypeStruct(scales, jnp.float32)
    for p in targets:
        shape, n = problem.shapes[p.key].shape, problem.names[p.key]
        lead, cut = shape[: p.stacked], p.stacked + p.inputs
        names[p.a] = (*n[:cut], LORA_RANK)
        names[p.b] = (*n[: p.stacked], LORA_RANK, *n[cut:])
        shapes[p.a] = jax.ShapeDtypeStruct((*shape[:cut], r), jnp.float32)
        shapes[p.b] = jax.ShapeDtypeStruct((*lead, r, *shape[cut:]), jnp.float32)
    return names, shapes


def adapted(problem: Problem, adapter: Adapter, model) -> Problem:
    """`problem` (a registered model) with adapters on adapter.targets, trained alone;
    its base frozen, stored as adapter.base."""
    targets = targets_of(adapter, model)
    quantized = quantized_of(adapter, model, problem.shapes)
    kind, scale = str(adapter.base), scale_of(adapter)
    names, shapes = _stored(problem, adapter, targets, quantized)
    trained = {k for p in targets for k in (p.a, p.b)}

    def store(base: dict) -> dict:
        """The base's parameters as adapter.base stores them."""
        out = {}
        for k, v in base.items():
            if k in shapes:
                out[k] = v.astype(shapes[k].dtype)
        for p in quantized:
            out[p.codes], out[p.scale] = quant.quantize(kind, base[p.key], p.input_dims())
        return out

    def fresh(key):
        """The adapters at the start: A as PEFT draws it, B zero."""
        params = {}
        for i, p in enumerate(targets):
            fan_in = math.prod(shapes[p.a].shape[p.stacked : p.stacked + p.inputs])
            bound = 1 / math.sqrt(fan_in)
            sub = jax.random.fold_in(jax.random.fold_in(key, 0x10AA), i)
            params[p.a] = jax.random.uniform(sub, shapes[p.a].shape, jnp.float32, -bound, bound)
            params[p.b] = jnp.zeros(shapes[p.b].shape, jnp.float32)
        return params

    def init(key):  # the base as the model's own run from this seed starts
        return {**store(problem.init(key)), **fresh(key)}

    init.store, init.fresh = store, fresh  # for a base read from files (initial)

    def view(params: dict) -> dict:
        """Stored leaves (any sub-dict of them) -> the model's own leaves, a quantized or
        adapted weight as an Assembled one."""
        out = {k: v for k, v in params.items() if k in problem.names}
        for p in quantized:
            if p.codes in params:
                out[p.key] = Quantized(params[p.codes], params[p.scale], p, kind)
        for p in targets:
            if p.a in params:
                out[p.key] = LowRank(out[p.key], params[p.a], params[p.b], p, scale)
        return out

    own, parts = problem.parts, None
    if own is not None:
        parts = Parts(
            stack_keys=tuple(k for k, n in names.items() if n[:1] == (LAYERS,)),
            pre=lambda params, batch: own.pre(view(params), batch),
            chunk=lambda params, h, active, batch: own.chunk(view(params), h, active, batch),
            post=lambda params, h, batch: own.post(view(params), h, batch),
            costs=own.costs,
            layer=own.layer and (lambda params, h, batch: own.layer(view(params), h, batch)),
        )
    return dataclasses.replace(
        problem,
        init=init,
        shapes=shapes,
        names=names,
        loss=lambda params, batch: problem.loss(view(params), batch),
        parts=parts,
        module=None,
        frozen=frozenset(k for k in names if k not in trained),
    )


def initial(problem: Problem, adapted_problem: Problem, base_fill, seed: int, read=None):
    """(targets -> params) of an adapter run whose base is read from files: base_fill
    (jaxpar.hf.initial_params of the model's own `problem`) reads each base leaf, stored
    then as adapter.base says, beside the adapters `read` gives (jaxpar.adapters.peft.
    initial), or fresh ones from `seed`."""

    def build(targets: dict) -> dict:
        at = {k: targets.get(k) or targets[f"{k}/codes"] for k in problem.shapes}
        base = base_fill(
            {
                k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=at[k].sharding)
                for k, s in problem.shapes.items()
            }
        )
        init, frozen = adapted_problem.init, adapted_problem.frozen
        shardings = {k: t.sharding for k, t in targets.items()}
        stored = jax.jit(init.store, out_shardings={k: shardings[k] for k in frozen})(base)
        trained = {k: t for k, t in targets.items() if k not in frozen}
        if read is not None:
            return {**stored, **read(trained)}
        fresh = jax.jit(init.fresh, out_shardings={k: shardings[k] for k in trained})
        return {**stored, **fresh(jax.random.key(seed))}

    return build


def from_files(model, train: Train, problem: Problem, directory, read=None):
    """(targets -> params) of an adapter run (`problem`) on the base in model.init's
    Hugging Face `directory`, with the adapters `read` gives or fresh ones."""
    plain = registered(model, train.seq_len)
    fmt = registry.hf_format(model.name, "model.init")
    fill = hf.initial_params(fmt, model, directory, plain.shapes)
    return initial(plain, problem, fill, train.seed, read)


def merged(problem: Problem, adapter: Adapter, model, params: dict) -> dict:
    """An adapter run's parameters (host arrays) -> the model's own, fp32: the base
    dequantized and each adapter there added in (W + (alpha / r) A B)."""
    scale = scale_of(adapter)
    targets = [p for p in targets_of(adapter, model) if p.a in params]
    out = {k: jnp.asarray(v, jnp.float32) for k, v in params.items() if k in problem.names}
    for p in quantized_of(adapter, model, problem.shapes):
        codes, scales = jnp.asarray(params[p.codes]), jnp.asarray(params[p.scale], jnp.float32)
        out[p.key] = quant.dequantize(str(adapter.base), codes, scales)
    for p in targets:
        a, b = (jnp.asarray(params[k], jnp.float32) for k in (p.a, p.b))
        out[p.key] = out[p.key] + scale * delta(p, a, b)
    return out
