"""Collectives over a manual axis (`data`, `pipeline`) on leaves that other axes split.

The step runs forward/backward inside a shard_map that is manual over `data` and
`pipeline`, so gradients are local and their reductions are ours to place. A
collective there must see each device's block of the remaining (compiler-managed)
axes too: XLA otherwise gathers the `tensor` split first and moves T times the bytes.
So every collective runs in a nested shard_map, manual over the remaining axes as well.
"""

from __future__ import annotations

from functools import partial

import jax
from jax.sharding import AxisType, PartitionSpec

DATA = "data"


def _blockwise(fn, x, spec: PartitionSpec):
    mesh = jax.sharding.get_abstract_mesh()
    auto = tuple(
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t != AxisType.Manual
    )
    if not auto:
        return fn(x)
    local = PartitionSpec(*(a if a in auto else None for a in spec))
    return jax.shard_map(
        fn, in_specs=local, out_specs=local, axis_names=set(auto), check_vma=False
    )(x)


def gather(x, dim: int, spec: PartitionSpec, axis: str = DATA):
    """All-gather a ZeRO-split leaf over `axis` along `dim` (spec: its compute spec)."""
    return _blockwise(partial(jax.lax.all_gather, axis_name=axis, axis=dim, tiled=True), x, spec)


def reduce(x, spec: PartitionSpec, axis: str = DATA):
    """Sum local gradients over `axis` (all-reduce)."""
    return _blockwise(partial(jax.lax.psum, axis_name=axis), x, spec)


def reduce_scatter(x, dim: int, spec: PartitionSpec, axis: str = DATA):
    """Sum local gradients over `axis`, each device keeping its slice along `dim`."""
    fn = partial(jax.lax.psum_scatter, axis_name=axis, scatter_dimension=dim, tiled=True)
    return _blockwise(fn, x, spec)
