"""How gradients are reduced over `data` (and then `replica`): the compiler's collectives
(`xla`), a ring of ppermutes (`ring`: reduce-scatter + all-gather), or a gradient server
(`server`).

`ring` and `server` fuse leaves into flat buckets of about `parallel.bucket_mb`
before communicating, as PyTorch DDP does, so a step launches about total/bucket
reductions instead of one per leaf. All of it runs inside the step's shard_map
(manual over `data`), in one nested shard_map manual over the remaining axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.config.sections import DpCollective
from jaxpar.parallel import collectives, ring, server
from jaxpar.parallel.axes import DATA

SUM, SCATTER = "sum", "scatter"  # what a leaf needs: all-reduce, or reduce-scatter


def reduce(grads, specs, todo, mode: str, bucket_bytes: float, dtype=None, axis: str = DATA):
    """Reduce each gradient leaf over `axis` as `todo` says (SUM, SCATTER along its ZeRO
    dim, or None: leave it), summed in `dtype` (default: its own) and
    returned in its own; `specs` are the leaves' LeafSpecs."""
    original, treedef = jax.tree.flatten(grads)
    todo_list = treedef.flatten_up_to(todo)
    reduced = _reduce(
        [
            g if t is None or dtype is None else g.astype(dtype)
            for g, t in zip(original, todo_list, strict=True)
        ],
        treedef.flatten_up_to(specs),
        todo_list,
        mode,
        bucket_bytes,
        axis,
    )
    return treedef.unflatten([r.astype(g.dtype) for r, g in zip(reduced, original, strict=True)])


def _reduce(leaves, leaf_specs, todo_list, mode: str, bucket_bytes: float, axis: str) -> list:
    spec_list = [s.compute for s in leaf_specs]
    dim_list = [s.dim for s in leaf_specs]
    if mode is DpCollective.XLA:
        out = [
            g
            if t is None
            else collectives.reduce(g, s, axis)
            if t == SUM
            else collectives.reduce_scatter(g, d, s, axis)
            for g, s, t, d in zip(leaves, spec_list, todo_list, dim_list, strict=True)
        ]
        return out
    chosen = [i for i, t in enumerate(todo_list) if t is not None]

    def run(blocks):
        out = list(blocks)
        for kind in (SUM, SCATTER):
            members = [i for i in chosen if todo_list[i] == kind]
            sizes = [blocks[i].size * blocks[i].dtype.itemsize for i in members]
            for positions in buckets(sizes, bucket_bytes):
                bucket = [members[k] for k in positions]
                parts = [blocks[i] for i in bucket]
                if kind == SUM:
                    reduced = _sum_bucket(parts, mode, axis)
                else:
                    reduced = _scatter_bucket(parts, [dim_list[i] for i in bucket], axis)
                for i, r in zip(bucket, reduced, strict=True):
                    out[i] = r
        return out

    return collectives.blockwise(run, leaves, spec_list)


def buckets(sizes_bytes: list[int], bucket_bytes: float) -> list[list[int]]:
    """Greedy, in order: a bucket takes leaves while it stays within bucket_bytes (a leaf
    larger than that gets a bucket of its own). Returns positions."""
    out, current, size = [], [], 0
    for k, nbytes in enumerate(sizes_bytes):
        if current and size + nbytes > bucket_bytes:
            out.append(current)
            current, size = [], 0
        current.append(k)
        size += nbytes
    return out + ([current] if current else [])


def _sum_bucket(parts, mode: str, axis: str):
    flat = jnp.concatenate([p.reshape(-1) for p in parts])
    fn = ring.ring_all_reduce if mode is DpCollective.RING else server.server_all_reduce
    total = fn(flat, axis)
    ends = [sum(p.size for p in parts[: k + 1]) for k in range(len(parts) - 1)]
    pieces = jnp.split(total, ends)
    return [piece.reshape(p.shape) for piece, p in zip(pieces, parts, strict=True)]


def _scatter_bucket(parts, dims, axis: str):
    """Each leaf as [N, rest] (its ZeRO dim first, cut into the N slices), side by side:
    one ring reduce-scatter along that leading dim serves them all."""
    n = jax.lax.axis_size(axis)
    rows = [jnp.moveaxis(p, d, 0).reshape(n, -1) for p, d in zip(parts, dims, strict=True)]
    mine = ring.ring_reduce_scatter(jnp.concatenate(rows, axis=1), axis, dim=0)
    widths = [r.shape[1] for r in rows]
    pieces = jnp.split(mine, [sum(widths[:k]) for k in range(1, len(widths))], axis=1)
    out = []
    for piece, p, d in zip(pieces, parts, dims, strict=True):
        moved = jnp.moveaxis(p, d, 0).shape
        out.append(jnp.moveaxis(piece.reshape((moved[0] // n,) + moved[1:]), 0, d))
    return out
