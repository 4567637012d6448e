"""Models by name: what jaxpar needs to know of each (a ModelSpec), registered once.

The shipped models (`jaxpar.models`) register themselves by module, so that naming one
imports no jax until it is built; a model of yours registers its spec directly
(`jaxpar.register_model`). Nothing else in jaxpar names a model.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from jaxpar.errors import ConfigError
from jaxpar.hf import HFFormat


def _no_check(model, mesh_shape: dict) -> None:
    del model, mesh_shape


def _no_notes(model, seq_len: int) -> list[str]:
    del model, seq_len
    return []


@dataclass(frozen=True)
class AttentionDims:
    """What context parallelism moves per layer: a model's attention layers and heads
    (ModelSpec.attention_dims)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    # latent attention: the values a token's keys and values come from (its latent and
    # rotated key), which context's all_gather moves instead of them; 0: none
    latent: int = 0
    # each layer's sliding window (0 or none: all before it): a local layer needs the
    # window's keys alone
    windows: tuple[int, ...] = ()


@dataclass(frozen=True)
class CacheDims:
    """One token's KV cache (ModelSpec.cache_dims): per layer and key/value head, the
    keys' dims and the values' (latent attention: one head, the rotated key and the
    latent); and each layer's sliding window (0 or none: it attends to all), a windowed
    layer's cache holding min(window, slots) slots (a ring: jaxpar.nn.attention)."""

    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    windows: tuple[int, ...] = ()

    def slots(self, layer: int, slots: int) -> int:
        """The cache slots of `layer` for sequences of `slots` positions."""
        window = self.windows[layer] if self.windows else 0
        return min(window, slots) if window else slots

    def bytes_per_token(self, itemsize: int = 4, slots: int = 0) -> float:
        """Bytes a token: at `slots` positions, the cache's bytes over them; 0: of a
        token beyond every window (the global layers')."""
        per_layer = self.kv_heads * (self.key_dim + self.value_dim) * itemsize
        if slots:
            return per_layer * sum(self.slots(i, slots) for i in range(self.layers)) / slots
        return per_layer * (self.layers - sum(1 for w in self.windows if w))

    def formula(self) -> str:
        """bytes_per_token as its factors, for a summary line."""
        windowed = [w for w in self.windows if w]
        layers = self.layers - len(windowed)
        if self.key_dim == self.value_dim:
            text = f"2 x {layers} layers x {self.kv_heads} kv heads x {self.key_dim} dims"
        else:
            text = (
                f"{layers} layers x {self.kv_heads} kv heads x ({self.key_dim} key + "
                f"{self.value_dim} value dims)"
            )
        if windowed:
            text += f"; {len(windowed)} windowed layers hold {max(windowed)} tokens at most"
        return text


@dataclass(frozen=True)
class ExpertDims:
    """What expert parallelism moves per layer: a mixture's sparse layers, experts, the
    slots of each for a sequence (its capacity) and the token width
    (ModelSpec.expert_dims); the experts a token is sent to, whose ids context
    parallelism gathers; the forward FLOPs of one slot through its expert."""

    layers: int
    experts: int
    slots: int
    embed: int
    per_token: int
    slot_flops: float
    # no capacity (model.capacity_factor=0): each token to its experts by grouped
    # products, the tokens all-gathered over `expert` (not sent by all-to-all), and each
    # device's own tokens routed whole under context (nothing gathered over it)
    dropless: bool = False
    # model.router_bias_update: the step of the routers' balancing biases (0: fixed)
    bias_step: float = 0.0

    def held(self, context: int) -> int:
        """Each expert's slots of a sequence a device runs: split over `context`, each
        device its ceil(1/C) of them."""
        return -(-self.slots // context)

    def idle_flops(self, seq_len: int, context: int) -> float:
        """Forward and backward FLOPs per sequence of the slots beyond its tokens' k
        choices (which the model's FLOPs count): the capacity's spare slots, run on
        zeros (none dropless)."""
        if self.dropless:
            return 0.0
        spare = context * self.experts * self.held(context) - self.per_token * seq_len
        return 3 * self.layers * self.slot_flops * max(spare, 0)


class BlockKind(enum.StrEnum):
    """The kind of a model's blocks: which of jaxpar.cost.blocks' formulas counts what one
    keeps for its backward pass and what Megatron all-reduces in it."""

    GPT = "gpt"  # LayerNorm, multi-head attention, a GeLU MLP (Korthikanti et al.'s block)
    LLAMA = "llama"  # RMSNorm, grouped-query attention with rotary, SwiGLU (or a mixture)
    MLP = "mlp"  # LayerNorm and a GeLU MLP, no attention


@dataclass(frozen=True)
class ModelDims:
    """What a model is, to the cost model (ModelSpec.dims): its block and dims at one
    sequence length. The shipped models declare these, and jaxpar.cost derives the bytes
    and the elements from them: a model knows no parallelism."""

    block: BlockKind
    seq_len: int  # the sequence length these dims are declared at
    layers: int
    embed: int
    mlp: int  # hidden dims of a (dense or expert) MLP
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    # a mixture in every (layers / experts.layers)-th block; None: dense
    experts: ExpertDims | None = None


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model as jaxpar sees it. The parameter count is not declared: it is read from
    the abstract shapes of `build`, so it cannot disagree with the model."""

    name: str  # model.name
    # (model config, seq_len, nnx.Rngs) -> the module; its parameters carry logical names
    build: Callable
    loss: Callable  # (module, batch) -> per-element losses (their mean is minimised)
    stages: Callable  # (model config, seq_len) -> jaxpar.Stages, for pipelines
    # (model config, seq_len) -> FLOPs of forward and backward per token (planner, MFU)
    flops_per_token: Callable[..., float]
    # (model config, seq_len) -> its ModelDims: the cost model (jaxpar.cost.blocks) derives
    # what a layer keeps for its backward pass and Megatron's all-reduces from them. A
    # model that declares none gives the two below itself
    dims: Callable[..., ModelDims] | None = None
    # (model config, seq_len, tensor degree, scores, context degree) -> bytes one layer
    # keeps for its backward pass per sequence on a device holding 1/context of its
    # tokens, in a 16-bit compute dtype (planner); `scores`: whether the attention keeps
    # its [S, S] scores (jaxpar.nn.attention.stores_scores)
    activation_bytes: Callable[..., float] | None = None
    # (model config, rows, seq_len, tensor degree) -> elements Megatron all-reduces over
    # `tensor` per micro-batch of `rows` sequences, forward and backward (the minimum)
    tensor_elements: Callable[..., float] | None = None
    # (model config, mesh shape) -> None, or ConfigError naming the keys and the fix
    check: Callable[..., None] = _no_check
    # (model config, seq_len) -> what the start-up summary notes of this run's model (a
    # key that does nothing at this length, ...)
    notes: Callable[..., list[str]] = _no_notes
    # its config class: a subclass of jaxpar.Model with its own keys (None: jaxpar.Model)
    config: type | None = None
    tiny: str | None = None  # its smallest preset: `jaxpar bench`, `jaxpar plan --validate`
    hf: HFFormat | None = None  # its Hugging Face checkpoint format, if it has one
    # (model config) -> CacheDims of its KV cache, for a model
    # whose module decodes through one: module.decode(tokens, positions, cache, slot,
    # pad) -> (logits, cache) (jaxpar.generation.decoding); None: it does not generate
    cache_dims: Callable | None = None
    # (model config) -> AttentionDims: its attention layers and heads, what
    # context parallelism's textbook bytes count; None: no attention (or not declared)
    attention_dims: Callable | None = None
    # (model config, seq_len) -> ExpertDims of its mixture of experts, what
    # expert parallelism's textbook bytes count; None (or returning None): no experts
    expert_dims: Callable | None = None


_SPECS: dict[str, ModelSpec] = {}
# name -> (module with SPEC, config class, tiny preset), for models imported when needed
_MODULES: dict[str, tuple[str, type | None, str | None]] = {}
_DEFAULT: list[str] = []  # model.name when none is given


def register(spec: ModelSpec) -> ModelSpec:
    """Make `spec` buildable as model.name=spec.name (a later one of the same name wins)."""
    if not isinstance(spec, ModelSpec):
        raise ConfigError(f"register_model: expected a jaxpar.ModelSpec, got {type(spec).__name__}")
    _SPECS[spec.name] = spec
    _MODULES.pop(spec.name, None)
    return spec


def register_module(
    name: str,
    module: str,
    config: type | None = None,
    tiny: str | None = None,
    default: bool = False,
) -> None:
    """A model whose spec is `module.SPECS[name]` where the module holds several (a
    family of them), else `module.SPEC` (or `module:NAME`'s NAME), imported when it is
    first needed; `default`: the model of a config that names none."""
    _MODULES[name] = (module, config, tiny)
    if default:
        _DEFAULT[:] = [name]


def default_name() -> str:
    _load_shipped()
    return _DEFAULT[0]


def tiny_preset(name: str) -> str | None:
    _load_shipped()
    return _MODULES[name][2] if name in _MODULES else get(name).tiny


def _load_shipped() -> None:
    importlib.import_module("jaxpar.models")  # registers them; imports no jax


def names() -> list[str]:
    _load_shipped()
    return sorted({*_SPECS, *_MODULES})


def get(name: str) -> ModelSpec:
    _load_shipped()
    if name in _MODULES:
        module, _, attribute = _MODULES[name][0].partition(":")  # "module" or "module:NAME"
        found = importlib.import_module(module)
        specs = getattr(found, "SPECS", {})
        register(specs[name] if name in specs else getattr(found, attribute or "SPEC"))
    if name not in _SPECS:
        raise ConfigError(f"model.name={name!r}: no such model; choose one of {names()}")
    return _SPECS[name]


def config_class(name: str) -> type | None:
    """The config class model `name` declares (None: the base jaxpar.Model's keys)."""
    _load_shipped()
    return _MODULES[name][1] if name in _MODULES else _SPECS[name].config


def config_classes() -> list[type]:
    """Each config class a model declares, once."""
    out = []
    for name in names():
        cls = config_class(name)
        if cls is not None and cls not in out:
            out.append(cls)
    return out


def hf_format(name: str, key: str) -> HFFormat:
    """Model `name`'s Hugging Face format, or ConfigError naming `key` and the models
    that have one."""
    fmt = get(name).hf
    if fmt is None:
        have = [n for n in names() if get(n).hf is not None]
        raise ConfigError(
            f"{key}: model.name={name} has no Hugging Face format; the models that have one: {have}"
        )
    return fmt


def check_model(model, mesh_shape: dict) -> None:
    """The model's own checks of its config against the mesh (before any leaf; the tensor
    split its dims need is the rules', jaxpar.parallel.sharding.check_tensor_split)."""
    get(model.name).check(model, mesh_shape)
