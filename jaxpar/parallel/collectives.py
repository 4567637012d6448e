"""Collectives over a manual axis (`data`, `pipeline`) on leaves that other axes split.

The step runs forward/backward inside a shard_map that is manual over `data`,
`pipeline` and `context`, so gradients are local and their reductions are ours to place. A
collective there must see each device's block of the remaining (compiler-managed)
axes too: XLA otherwise gathers the `tensor` split first and moves T times the bytes.
So every collective runs in a nested shard_map, manual over the remaining axes as well.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

from jaxpar.parallel.axes import DATA
from jaxpar.parallel.ring import ring_all_gather, ring_reduce_scatter


def compiler_axes() -> tuple[str, ...]:
    """The axes the compiler still manages where this is traced (the others manual)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t != AxisType.Manual
    )


def blockwise(fn, xs, specs):
    """fn(blocks) on each device's block of `xs` (a pytree; `specs` its compute specs),
    manual over every axis the compiler still manages."""
    auto = compiler_axes()
    if not auto:
        return fn(xs)
    local = jax.tree.map(
        lambda spec: PartitionSpec(*(a if a in auto else None for a in spec)),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    return jax.shard_map(
        fn, in_specs=(local,), out_specs=local, axis_names=set(auto), check_vma=False
    )(xs)


def gather(
    x,
    dim: int,
    spec: PartitionSpec,
    axis: str = DATA,
    ring: bool = False,
    dtype=None,
    reduce_dtype=None,
):
    """All-gather a ZeRO-split leaf over `axis` along `dim` (spec: its compute spec), cast
    to `dtype` (default: its own) first. The values move as raw bits (an unsigned integer
    of their width), so no backend widens a bf16 gather to f32: what moves is exactly
    the compute-dtype values. The gradient is reduce-scattered in `reduce_dtype`
    (default: `dtype`) and arrives in x's dtype. With `ring`, both go round a ring of
    ppermutes instead of XLA's collectives."""
    dtype = jnp.dtype(dtype or x.dtype)
    reduce_dtype = jnp.dtype(reduce_dtype or dtype)
    bits, in_dtype = jnp.dtype(f"uint{8 * dtype.itemsize}"), x.dtype
    if ring:
        move = partial(ring_all_gather, axis=axis, dim=dim)
        scatter = partial(ring_reduce_scatter, axis=axis, dim=dim)
    else:
        move = partial(jax.lax.all_gather, axis_name=axis, axis=dim, tiled=True)
        scatter = partial(jax.lax.psum_scatter, axis_name=axis, scatter_dimension=dim, tiled=True)

    @jax.custom_vjp
    def gathered(x):
        raw = jax.lax.bitcast_convert_type(x.astype(dtype), bits)
        return jax.lax.bitcast_convert_type(blockwise(move, raw, spec), dtype)

    def backward(_, g):
        return (blockwise(scatter, g.astype(reduce_dtype), spec).astype(in_dtype),)

    gathered.defvjp(lambda x: (gathered(x), None), backward)
    return gathered(x)


def reduce(x, spec: PartitionSpec, axis: str = DATA):
    """Sum local gradients over `axis` (all-reduce)."""
    return blockwise(partial(jax.lax.psum, axis_name=axis), x, spec)


def reduce_scatter(x, dim: int, spec: PartitionSpec, axis: str = DATA):
    """Sum local gradients over `axis`, each device keeping its slice along `dim`."""
    fn = partial(jax.lax.psum_scatter, axis_name=axis, scatter_dimension=dim, tiled=True)
    return blockwise(fn, x, spec)
