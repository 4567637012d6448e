"""What is trained: parameters with logical names, and a loss.

Two ways in: a Flax NNX module whose parameters carry logical names
(`from_nnx`), or a plain parameter pytree whose leaf paths are matched by
regular expressions to logical names (`from_pytree`). Either way the engine
sees pure parameter pytrees, a matching pytree of names, and
`loss(params, batch) -> per-example losses` (leading dim = batch).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx

from jaxpar.config import ConfigError
from jaxpar.layers import SPECS_KEY, scan_layers


@dataclass(frozen=True)
class Stages:
    """How to cut an NNX model into pipeline stages: pre -> layers of `stack` -> post."""

    pre: Callable[[nnx.Module, Any], jax.Array]  # (model, batch) -> activation
    stack: str  # attribute holding the nnx.vmap-stacked layers
    layer: Callable[[nnx.Module, jax.Array], jax.Array]  # (one layer, activation) -> activation
    post: Callable[[nnx.Module, jax.Array, Any], jax.Array]  # (model, act., batch) -> losses
    costs: tuple[float, float, float] = (0.0, 1.0, 0.0)  # relative cost: pre, a layer, post


@dataclass(frozen=True)
class Parts:
    """A problem's pipeline pieces as functions of parameter dicts (built by from_nnx)."""

    stack_keys: tuple[str, ...]  # parameters of the layer stack, [layers, ...] each
    pre: Callable[..., jax.Array]  # (params, batch, specs) -> activation
    chunk: Callable[..., jax.Array]  # (stack params [n, ...], act., active [n], specs) -> act.
    post: Callable[..., jax.Array]  # (params, activation, batch, specs) -> per-example losses
    costs: tuple[float, float, float]


@dataclass(frozen=True)
class Problem:
    init: Callable[[jax.Array], Any]  # key -> params pytree (fp32)
    shapes: Any  # params pytree of jax.ShapeDtypeStruct
    names: Any  # params pytree of logical-name tuples
    # (params, batch, specs) -> per-example losses; specs: pytree of LeafSpecs or None
    loss: Callable[..., jax.Array]
    # True when leaves named `layers` are gathered layer by layer inside
    # jaxpar.layers.scan_layers (ZeRO-3); otherwise the step gathers every leaf up front.
    per_layer_gather: bool = False
    parts: Parts | None = None  # what pipeline parallelism needs; None: no stages


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
                "False) using jaxpar.sharding's names"
            )
        names[key] = tuple(spec)

    def init(key):
        state = nnx.state(make(nnx.Rngs(key)))
        return {k: v.get_value() for k, (_, v) in zip(keys, nnx.to_flat_state(state), strict=True)}

    def variables(params, specs, entries):
        return nnx.from_flat_state(
            [
                (path, var.replace(params[k], **{SPECS_KEY: specs[k] if specs else None}))
                for k, path, var in entries
            ]
        )

    everything = [(k, path, var) for k, (path, var) in zip(keys, flat, strict=True)]

    def model(params, specs):
        return nnx.merge(graphdef, variables(params, specs, everything))

    shapes = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, (_, v) in zip(keys, flat, strict=True)
    }
    return Problem(
        init=init,
        shapes=shapes,
        names=names,
        loss=lambda params, batch, specs=None: loss(model(params, specs), batch),
        per_layer_gather=True,
        parts=None
        if stages is None
        else _parts(stages, getattr(abstract_model, stages.stack), everything, model, variables),
    )


def _parts(stages: Stages, abstract_stack, everything, model, variables) -> Parts:
    stack_graphdef, _ = nnx.split(abstract_stack)
    prefix = (stages.stack,)
    stack_entries = [(k, path[1:], var) for k, path, var in everything if path[:1] == prefix]
    if not stack_entries:
        raise ConfigError(f"Stages.stack={stages.stack!r}: the model has no parameters there")

    def chunk(params, h, active, specs):
        stack = nnx.merge(stack_graphdef, variables(params, specs, stack_entries))
        return scan_layers(stack, h, stages.layer, active)

    return Parts(
        stack_keys=tuple(k for k, _, _ in stack_entries),
        pre=lambda params, batch, specs: stages.pre(model(params, specs), batch),
        chunk=chunk,
        post=lambda params, h, batch, specs: stages.post(model(params, specs), h, batch),
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
    return Problem(
        init=init,
        shapes=shapes,
        names=names,
        loss=lambda params, batch, specs=None: loss(params, batch),
    )
