"""Collectives over the `data` axis on leaves that other axes also split.

The step runs forward/backward inside a shard_map that is manual over `data` only, so
that gradients are local and their reduction is ours to place. A collective over
`data` there must see each device's block of the other axes too: XLA otherwise
gathers the `tensor` split first and moves N times the bytes. So every collective
runs in a nested shard_map that is manual over the remaining axes as well.
"""

from __future__ import annotations

from functools import partial

import jax
from jax.sharding import PartitionSpec

DATA = "data"


def _blockwise(fn, x, spec: PartitionSpec):
    mesh = jax.sharding.get_abstract_mesh()
    others = tuple(a for a in mesh.axis_names if a != DATA)
    local = PartitionSpec(*(a if a in others else None for a in spec))
    return jax.shard_map(
        fn, in_specs=local, out_specs=local, axis_names=set(others), check_vma=False
    )(x)


def gather(x, dim: int, spec: PartitionSpec):
    """All-gather a ZeRO-split leaf over `data` along `dim` (spec: its compute spec)."""
    return _blockwise(partial(jax.lax.all_gather, axis_name=DATA, axis=dim, tiled=True), x, spec)


def reduce(x, spec: PartitionSpec):
    """Sum local gradients over `data` (all-reduce)."""
    return _blockwise(partial(jax.lax.psum, axis_name=DATA), x, spec)


def reduce_scatter(x, dim: int, spec: PartitionSpec):
    """Sum local gradients over `data`, each device keeping its slice along `dim`."""
    fn = partial(jax.lax.psum_scatter, axis_name=DATA, scatter_dimension=dim, tiled=True)
    return _blockwise(fn, x, spec)
