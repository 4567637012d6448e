"""Expert parallelism as a mixture's code sees it (nothing without expert parallelism;
the routing itself is the model's, jaxpar.models.moe):

- by capacity: its dispatched tokens to the devices of their experts, and the experts'
  outputs back, an all-to-all over `expert` each way;
- dropless: every expert device's tokens gathered over `expert`, each device running
  its own experts' share, the outputs summed back to the tokens' devices by a
  reduce-scatter (Megatron's all-gather dispatcher: no capacity, so no drops, and no
  token counts to exchange first)."""

from __future__ import annotations

import jax

from jaxpar.nn import scope
from jaxpar.parallel.axes import EXPERT


def to_experts(x: jax.Array) -> jax.Array:
    """A mixture's dispatched tokens, [rows, experts, ...], to where their experts are:
    under expert parallelism each device holds experts / X of them, and gets their slots
    of every expert device's rows, [X x rows, experts / X, ...] (an all-to-all over
    `expert`); else unchanged."""
    ctx = scope.current()
    if ctx is None or ctx.mesh_shape.get(EXPERT, 1) == 1:
        return x
    return jax.lax.all_to_all(x, EXPERT, split_axis=1, concat_axis=0, tiled=True)


def from_experts(y: jax.Array) -> jax.Array:
    """The experts' outputs back to their tokens' devices: `to_experts` undone."""
    ctx = scope.current()
    if ctx is None or ctx.mesh_shape.get(EXPERT, 1) == 1:
        return y
    return jax.lax.all_to_all(y, EXPERT, split_axis=0, concat_axis=1, tiled=True)


def _degree() -> int:
    ctx = scope.current()
    return 1 if ctx is None else ctx.mesh_shape.get(EXPERT, 1)


def gather_tokens(x: jax.Array) -> jax.Array:
    """[rows, ...] this device's -> [X x rows, ...] every expert device's (dropless)."""
    if _degree() == 1:
        return x
    return jax.lax.all_gather(x, EXPERT, axis=0, tiled=True)


def scatter_outputs(y: jax.Array) -> jax.Array:
    """[X x rows, ...] this device's experts' outputs for every expert device's tokens
    -> [rows, ...] every device's, summed, for this device's tokens: gather_tokens undone."""
    if _degree() == 1:
        return y
    return jax.lax.psum_scatter(y, EXPERT, scatter_dimension=0, tiled=True)


def all_experts(w: jax.Array) -> jax.Array:
    """[L, ...] this device's experts' -> [experts, ...] every expert's (an all-gather
    over `expert`, whose gradient is the reduce-scatter back); else unchanged."""
    if _degree() == 1:
        return w
    return jax.lax.all_gather(w, EXPERT, axis=0, tiled=True)


def first_expert(local: int) -> jax.Array | int:
    """The index of this device's first expert, of `local` experts a device."""
    if _degree() == 1:
        return 0
    return jax.lax.axis_index(EXPERT) * local
