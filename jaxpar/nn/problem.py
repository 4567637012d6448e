"""What is trained: parameters with logical names, and a loss.

Two ways in: a Flax NNX module whose parameters carry logical names
(`from_nnx`), or a plain parameter pytree whose leaf paths are matched by
regular expressions to logical names (`from_pytree`). Either way the engine
sees pure parameter pytrees, a matching pytree of names, and
`loss(params, batch) -> per-example losses` (leading dim = batch), where `params` is
the step's compute view (jaxpar.parallel.zero.ZeroPolicy.compute_view).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from inspect import Parameter
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import registry
from jaxpar.config.registry import ModelDims
from jaxpar.errors import ConfigError
from jaxpar.nn import documents, scope
from jaxpar.nn.layers import KEY, apply_layer, scan_layers
from jaxpar.parallel.sharding import leaf_key


@dataclass(frozen=True)
class Stages:
    """How to cut an NNX model into pipeline stages: pre -> layers of `stack` -> post."""

    pre: Callable[[nnx.Module, Any], jax.Array]  # (model, batch) -> activation
    stack: str  # attribute holding the nnx.vmap-stacked layers
    # (one layer, activation, batch) -> activation: the micro-batch the activation is of,
    # for what every layer reads of it (jaxpar.nn.documents: segment ids, positions); a
    # layer that reads nothing of it may take (one layer, activation) alone
    layer: Callable[[nnx.Module, jax.Array, Any], jax.Array]
    post: Callable[[nnx.Module, jax.Array, Any], jax.Array]  # (model, act., batch) -> losses
    costs: tuple[float, float, float] = (0.0, 1.0, 0.0)  # relative cost: pre, a layer, post


@dataclass(frozen=True)
class Parts:
    """A problem's pipeline pieces as functions of parameter dicts (built by from_nnx)."""

    stack_keys: tuple[str, ...]  # parameters of the layer stack, [layers, ...] each
    pre: Callable[..., jax.Array]  # (params, batch) -> activation
    # (stack params [n, ...], activation, active [n], micro-batch) -> activation
    chunk: Callable[..., jax.Array]
    post: Callable[..., jax.Array]  # (params, activation, batch) -> per-example losses
    costs: tuple[float, float, float]
    # (one layer's params {key: leaf without its layers dim}, activation, micro-batch) ->
    # activation: a layer at a time, for the zero-bubble schedules' split backward; None:
    # not given (a Parts built by hand before zb-h1), and zb-h1 is refused
    layer: Callable[..., jax.Array] | None = None


@dataclass(frozen=True)
class Problem:
    init: Callable[[jax.Array], Any]  # key -> params pytree (fp32)
    shapes: Any  # params pytree of jax.ShapeDtypeStruct
    names: Any  # params pytree of logical-name tuples
    loss: Callable[..., jax.Array]  # (params, batch) -> per-example losses
    parts: Parts | None = None  # what pipeline parallelism needs; None: no stages
    # (rows of one micro-batch, tensor degree) -> activation elements the model
    # all-reduces over `tensor` per micro-batch (Megatron's count, for the ledger's
    # minimum); None: derived from `dims` (jaxpar.cost.blocks), or not known
    tensor_elements: Callable[[int, int], float] | None = None
    # what a registered model declares of its blocks' dims (ModelSpec.dims), from which
    # the cost model counts; None: not declared
    dims: ModelDims | None = None
    # whether a layer stack's leaves are read a layer at a time (scan_layers: from_nnx)
    # or whole (from_pytree): what ZeRO-3 gathers, and how often
    scans_layers: bool = True
    # model FLOPs per loss element, forward and backward (jaxpar.cost.throughput); None:
    # not known, counted as 6 x parameters
    flops_per_token: float | None = None
    # batch -> the number of its loss elements that are trained (float32): what the
    # step divides the global batch's summed loss by, where `loss` zeroes some
    # elements (a loss mask); None: all of them (loss_elements)
    count: Callable[[Any], jax.Array] | None = None
    # params -> the NNX module holding them (from_nnx; traceable: for decoding)
    module: Callable[[Any], nnx.Module] | None = None
    # keys of the leaves that are not trained (an adapter run's base, jaxpar.adapters):
    # no gradient, no optimizer state, no gradient reduction; a dict of params only
    frozen: frozenset[str] = frozenset()
    # of `frozen`, the keys of a reference model's copy of trained leaves (DPO's,
    # jaxpar.objectives.dpo): memory reports count them apart from an adapter run's base
    reference: frozenset[str] = frozenset()
    # whether each step runs the model forward a second time, without gradient (DPO's
    # reference model, copied or the base with adapters off): what the cost model counts
    reference_forward: bool = False

    def trainable(self, tree):
        """The trained leaves of a params-shaped tree (all of them but `frozen`)."""
        return {k: v for k, v in tree.items() if k not in self.frozen} if self.frozen else tree

    def joined(self, tree, trained):
        """`tree` with its trained leaves taken from `trained`."""
        return {**tree, **trained} if self.frozen else trained


def loss_elements(problem: Problem, batch) -> int:
    """Elements of the loss over one batch: tokens for a language model, examples for a
    classifier (what the step averages over, and the unit of tokens_per_s)."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    return math.prod(jax.eval_shape(problem.loss, problem.shapes, shapes).shape)


def trained_count(problem: Problem, batch) -> jax.Array:
    """The trained loss elements of `batch` (float32): in a step, the global batch's."""
    count = problem.count(batch) if problem.count else loss_elements(problem, batch)
    return jnp.asarray(count, jnp.float32)


def from_nnx(
    make: Callable[[nnx.Rngs], nnx.Module],
    loss: Callable[[nnx.Module, Any], jax.Array],
    stages: Stages | None = None,
) -> Problem:
    """make(rngs) builds the module; loss(module, batch) returns per-example losses.
    `stages` (optional) says how to cut it for pipeline parallelism; its pre, stack and
    post must compose to `loss`."""
    abstract_model = nnx.eval_shape(lambda: make(nnx.Rngs(0)))
    graphdef, abstract = nnx.split(abstract_model)
    flat = list(nnx.to_flat_state(abstract))
    keys = ["/".join(map(str, path)) for path, _ in flat]
    names = {}
    for key, (_, var) in zip(keys, flat, strict=True):
        spec = var.get_metadata().get("out_sharding")
        if spec is None:
            raise ConfigError(
                f"parameter {key} {var.shape} has no logical names; create it "
                "with nnx.Param(value, out_sharding=(names...), eager_sharding="
                "False) using jaxpar.parallel.sharding's names"
            )
        if len(spec) != len(var.shape):
            stacked = len(spec) < len(var.shape)
            raise ConfigError(
                f"parameter {key} {var.shape}: {len(spec)} logical names {tuple(spec)} for "
                f"{len(var.shape)} dims"
                + (
                    "; a layer stack needs `layers` on its leading dim: build it with "
                    "jaxpar.stack(make_layer, n, rngs), or give nnx.vmap "
                    "transform_metadata={nnx.PARTITION_NAME: jaxpar.LAYERS}"
                    if stacked
                    else "; give one name per dim"
                )
            )
        names[key] = tuple(spec)

    def init(key):
        state = nnx.state(make(nnx.Rngs(key)))
        return {k: v.get_value() for k, (_, v) in zip(keys, nnx.to_flat_state(state), strict=True)}

    def variables(params, entries):
        # each Variable knows its key, for the step's per-layer gather (scan_layers)
        return nnx.from_flat_state(
            [(path, var.replace(params[k], **{KEY: k})) for k, path, var in entries]
        )

    everything = [(k, path, var) for k, (path, var) in zip(keys, flat, strict=True)]

    def model(params):
        return nnx.merge(graphdef, variables(params, everything))

    shapes = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, (_, v) in zip(keys, flat, strict=True)
    }
    return Problem(
        init=init,
        shapes=shapes,
        names=names,
        loss=lambda params, batch: loss(model(params), batch),
        module=model,
        parts=None
        if stages is None
        else _parts(stages, getattr(abstract_model, stages.stack), everything, model, variables),
    )


def _with_batch(layer: Callable) -> Callable:
    """Stages.layer as (layer, activation, batch) -> activation. A layer that takes no
    batch, (layer, activation) -> activation (the form before micro-batches carried
    their documents), is called without it."""
    try:
        params = inspect.signature(layer).parameters.values()
    except (TypeError, ValueError):  # a callable Python cannot inspect: as documented
        return layer
    kinds = [p.kind for p in params]
    positional = sum(
        k in (Parameter.POSITIONAL_ONLY, Parameter.POSITIONAL_OR_KEYWORD) for k in kinds
    )
    if Parameter.VAR_POSITIONAL in kinds or positional >= 3:
        return layer
    return lambda one, x, batch: layer(one, x)


def _parts(stages: Stages, abstract_stack, everything, model, variables) -> Parts:
    stack_graphdef, _ = nnx.split(abstract_stack)
    prefix = (stages.stack,)
    stack_entries = [(k, path[1:], var) for k, path, var in everything if path[:1] == prefix]
    if not stack_entries:
        raise ConfigError(f"Stages.stack={stages.stack!r}: the model has no parameters there")

    run_layer = _with_batch(stages.layer)

    def chunk(params, h, active, batch):
        stack = nnx.merge(stack_graphdef, variables(params, stack_entries))
        return scan_layers(stack, h, lambda layer, x: run_layer(layer, x, batch), active)

    def layer(params, h, batch):
        one = nnx.merge(stack_graphdef, variables(params, stack_entries))
        return apply_layer(one, h, lambda module, x: run_layer(module, x, batch))

    return Parts(
        stack_keys=tuple(k for k, _, _ in stack_entries),
        pre=lambda params, batch: stages.pre(model(params), batch),
        chunk=chunk,
        layer=layer,
        post=lambda params, h, batch: stages.post(model(params), h, batch),
        costs=stages.costs,
    )


def from_pytree(
    init: Callable[[jax.Array], Any],
    loss: Callable[[Any, Any], jax.Array],
    rules: Sequence[tuple[str, tuple[str, ...]]],
) -> Problem:
    """A plain pytree: `rules` maps regexes (searched in each leaf's path, first match
    wins) to logical names. Every leaf must match one rule."""
    shapes = jax.eval_shape(init, jax.random.key(0))
    compiled = [(re.compile(pattern), tuple(names)) for pattern, names in rules]

    def name_of(path, leaf):
        text = jax.tree_util.keystr(path)
        for pattern, names in compiled:
            if pattern.search(text):
                return names
        raise ConfigError(
            f"parameter {text} {leaf.shape}: no rule matches its path; add a "
            f"(regex, names) pair, e.g. ({text.strip('[]')!r}, (...))"
        )

    names = jax.tree_util.tree_map_with_path(name_of, shapes)

    def whole(params):
        """Inside a step, stacked leaves arrive as stored (made ready a layer at a time
        by scan_layers, which a pytree model does not use): make them ready whole."""
        ctx = scope.current()
        if ctx is None:
            return params
        return jax.tree_util.tree_map_with_path(lambda p, x: ctx.whole(leaf_key(p), x), params)

    return Problem(
        init=init,
        shapes=shapes,
        names=names,
        loss=lambda params, batch: loss(whole(params), batch),
        scans_layers=False,
    )


def registered(model, seq_len: int) -> Problem:
    """A registered model (its `model.*` section) as a Problem, shapes only until its init
        runs (nothing is allocated), with its pipeline stages, Megatron's count of tensor
        all-reduces and its FLOPs per token, from its registry entry. Its loss is over the
    batch's trained next-token targets (jaxpar.nn.documents)."""
    spec = registry.get(model.name)
    problem = from_nnx(
        lambda rngs: spec.build(model, seq_len, rngs), spec.loss, spec.stages(model, seq_len)
    )
    own = spec.tensor_elements
    return dataclasses.replace(
        problem,
        tensor_elements=None if own is None else lambda rows, t: own(model, rows, seq_len, t),
        dims=spec.dims(model, seq_len) if spec.dims else None,
        flops_per_token=spec.flops_per_token(model, seq_len),
        count=documents.trained_targets,
    )
