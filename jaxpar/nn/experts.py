"""Expert parallelism as a mixture's code sees it: its dispatched tokens to the devices
of their experts, and the experts' outputs back (an all-to-all over `expert` each way;
nothing without expert parallelism). The routing itself is the model's
(jaxpar.models.moe)."""

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
