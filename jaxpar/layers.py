"""What a model calls to be parallel without naming a mesh axis.

- `constrain(x, names)`: pin an activation's dims to the rules (no-op outside a step).
- `scan_layers(stack, carry, fn)`: run a stacked NNX module layer by layer. Inside a
  jaxpar step it gathers each layer's ZeRO-3 shards just before use (and again in the
  backward pass instead of keeping them), and applies `parallel.remat`: `full` keeps
  each layer's input and recomputes the rest; `offload` keeps that input in host memory.

The running step publishes how it places things through `placing(...)`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar import collectives
from jaxpar.offload import HOST, LAYER_INPUT
from jaxpar.sharding import LAYERS, LeafSpecs, compute_spec, zero_dim

SPECS_KEY = "jaxpar_specs"  # Variable metadata: the LeafSpecs of a stacked leaf


@dataclass(frozen=True)
class Placement:
    rules: tuple
    mesh_shape: dict
    zero: int
    remat: str  # none | full | offload
    ring: bool = False  # ZeRO-3 gathers by ring_all_gather (parallel.dp_collective=ring)
    fetch: bool = False  # parameter shards live on the host: bring each layer's to the device


_PLACEMENT: contextvars.ContextVar[Placement | None] = contextvars.ContextVar(
    "jaxpar_placement", default=None
)


@contextlib.contextmanager
def placing(placement: Placement):
    token = _PLACEMENT.set(placement)
    try:
        yield
    finally:
        _PLACEMENT.reset(token)


def param(rngs: nnx.Rngs, init, shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
    """An fp32 parameter with one logical name per dim; jaxpar decides where it lives."""
    return nnx.Param(
        init(rngs.params(), shape, jnp.float32), out_sharding=tuple(names), eager_sharding=False
    )


def constrain(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """Constrain an activation to the rules for its logical dim names."""
    p = _PLACEMENT.get()
    if p is None:
        return x
    # `data` is manual inside the step: each device already holds its own batch rows.
    spec = compute_spec(names, x.shape, p.rules, p.mesh_shape, skip_axes=("data",))
    return jax.lax.with_sharding_constraint(x, spec)


def _layer_value(var: nnx.Variable, zero: int, ring: bool, fetch: bool):
    value = var.get_value()
    if fetch:
        value = jax.device_put(value, jax.memory.Space.Device)
    specs: LeafSpecs | None = var.get_metadata().get(SPECS_KEY)
    if zero < 3 or specs is None:
        return value
    dim = zero_dim(specs)
    if dim is None:
        return value
    spec = jax.sharding.PartitionSpec(*specs.compute[1:])
    return collectives.gather(value, dim - 1, spec, ring=ring)


def scan_layers(stack: nnx.Module, carry, fn: Callable, active: jax.Array | None = None):
    """carry = fn(layer, carry) for each layer of `stack` (an nnx.vmap-stacked module).

    Every parameter of `stack` must have `layers` as its first logical name. `active`
    ([layers] bool) skips the layers it marks False (a pipeline stage's padding).
    """
    graphdef, state = nnx.split(stack)
    for path, var in nnx.to_flat_state(state):
        names = var.get_metadata().get("out_sharding") or ()
        if not names or names[0] != LAYERS:
            raise ValueError(
                f"scan_layers: {'/'.join(map(str, path))} has logical names "
                f"{names}; a stacked layer's first name must be {LAYERS!r}"
            )
    p = _PLACEMENT.get()
    zero = p.zero if p else 0

    def body(carry, layer_state):
        if p and p.remat == "offload":
            # the only value kept for the backward pass, sent to host memory there
            carry = checkpoint_name(carry, LAYER_INPUT)
        layer_state = jax.tree.map(
            lambda v: v.replace(
                _layer_value(v, zero, p is not None and p.ring, p is not None and p.fetch)
            ),
            layer_state,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )
        return fn(nnx.merge(graphdef, layer_state), carry)

    if p and p.remat == "full":
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    elif p and p.remat == "offload":
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[LAYER_INPUT],
            offload_src="device",
            offload_dst=HOST,
        )
        body = jax.checkpoint(body, policy=policy)
    elif zero >= 3:
        # Keep the big matmul outputs, recompute the rest: above all the gathered weights,
        # which are gathered again for the backward pass instead of being stored whole.
        # (A policy refusing to save only the all-gathers still left the whole gathered
        # weights stored for backward: no all-gather in the backward loop of the HLO.)
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    if active is None:
        carry, _ = jax.lax.scan(lambda c, s: (body(c, s), None), carry, state)
    else:
        skip = lambda c, s: c  # noqa: E731
        carry, _ = jax.lax.scan(
            lambda c, xs: (jax.lax.cond(xs[0], body, skip, c, xs[1]), None),
            carry,
            (active, state),
        )
    return carry
