"""The ring (`parallel.dp_collective=ring`): reduce-scatter, all-gather and all-reduce
written from ppermute, each device sending to its right neighbour (Patarasuk & Yuan's
bandwidth-optimal all-reduce: 2(N-1)/N of the buffer on the wire). Each equals its
jax.lax twin exactly on integer inputs (tests/test_collectives.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _ring(axis: str) -> list[tuple[int, int]]:
    n = jax.lax.axis_size(axis)
    return [(j, (j + 1) % n) for j in range(n)]


def ring_reduce_scatter(x, axis: str, dim: int = 0):
    """psum_scatter(x, axis, scatter_dimension=dim, tiled=True) as a ring: N-1 steps, each
    device sending one 1/N chunk to its right neighbour and adding its own to what arrives."""
    n = jax.lax.axis_size(axis)
    if n == 1:
        return x
    me = jax.lax.axis_index(axis)
    chunks = jnp.stack(jnp.split(x, n, axis=dim))  # [n, ...chunk]
    buf = chunks[(me - 1) % n]
    for step in range(n - 1):
        buf = jax.lax.ppermute(buf, axis, _ring(axis)) + chunks[(me - 2 - step) % n]
    return buf


def ring_all_gather(x, axis: str, dim: int = 0):
    """all_gather(x, axis, axis=dim, tiled=True) as a ring: N-1 steps, each device
    passing on to its right neighbour the chunk it received last."""
    n = jax.lax.axis_size(axis)
    if n == 1:
        return x
    me = jax.lax.axis_index(axis)
    out = jnp.zeros((n, *x.shape), x.dtype).at[me].set(x)
    buf = x
    for step in range(n - 1):
        buf = jax.lax.ppermute(buf, axis, _ring(axis))
        out = out.at[(me - 1 - step) % n].set(buf)
    return jnp.concatenate(list(out), axis=dim)


def ring_all_reduce(x, axis: str):
    """psum(x, axis) as ring reduce-scatter then ring all-gather (any shape: flattened and
    padded to a multiple of N)."""
    n = jax.lax.axis_size(axis)
    if n == 1:
        return x
    flat = x.reshape(-1)
    pad = -flat.shape[0] % n
    flat = jnp.pad(flat, (0, pad))
    out = ring_all_gather(ring_reduce_scatter(flat, axis), axis)
    return out[: x.size].reshape(x.shape)
