"""Megatron tensor parallelism for a whole block: `tensor_parallel(fn, x, whole, weights,
names)` runs fn(x, whole, *weights) on each tensor device's slices of the weights, and
sums its output's partial sums over `tensor` once (Megatron's f and g). Single products
are placed by the rules alone (jaxpar.nn.layers.dense)."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec

from jaxpar.nn import scope
from jaxpar.parallel.axes import EXPERT, MANUAL_AXES, TENSOR
from jaxpar.parallel.sharding import compute_spec


def tensor_parallel(fn: Callable, x: jax.Array, whole, weights: tuple, names: tuple):
    """fn(x, whole, *weights) for a block whose every path from x to its output
    contracts a dim of its weights that the rules split over `tensor` (Megatron's f and
    g around an MLP): each tensor device runs fn on its slices of the weights, with x
    whole (under sequence parallelism gathered first) and `whole` (a pytree) as it is on
    every device; the output's partial sums are summed over `tensor` once, after fn
    (reduce-scattered over the sequence under sequence parallelism), however fn moves
    its partial results around, and x's gradient likewise. Plainly fn(x, whole,
    *weights) where `tensor` is 1, or outside a step."""
    ctx = scope.current()
    if ctx is None or ctx.mesh_shape.get(TENSOR, 1) == 1:
        return fn(x, whole, *weights)
    specs = tuple(
        compute_spec(n, w.shape, ctx.rules, ctx.mesh_shape, skip_axes=MANUAL_AXES)
        for w, n in zip(weights, names, strict=True)
    )
    sp = ctx.sequence_parallel

    def local(x, whole, *weights):
        if sp:
            x = jax.lax.all_gather(x, TENSOR, axis=1, tiled=True)
        elif checked:  # x's gradient: one sum of its parts, here (not at fn's first use)
            x = jax.lax.pcast(x, TENSOR, to="varying")
        y = fn(x, whole, *weights)
        if sp:
            return jax.lax.psum_scatter(y, TENSOR, scatter_dimension=1, tiled=True)
        return jax.lax.psum(y, TENSOR)

    x_spec = PartitionSpec(None, TENSOR) if sp else PartitionSpec()
    # Under expert parallelism fn's all-to-alls over `expert` (manual outside, unchecked)
    # meet the varying-axis types of a checked map and fail its transpose ("Expected
    # cotangent type f32[..]{V:expert} but got f32[..]"): unchecked there, where x's
    # gradient is summed where it enters, and one more [rows, seq, embed] all-reduce a
    # layer goes with it (tensor: 1.23 x its minimum for mixtral-tiny, expert=2 tensor=2).
    checked = ctx.mesh_shape.get(EXPERT, 1) == 1
    return jax.shard_map(
        local,
        in_specs=(x_spec, PartitionSpec(), *specs),
        out_specs=x_spec,
        axis_names={TENSOR},
        check_vma=checked,
    )(x, whole, *weights)
