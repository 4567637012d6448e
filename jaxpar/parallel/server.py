"""The gradient server (`parallel.dp_collective=server`): an all-reduce through one
device of the axis, a parameter server's traffic pattern (N-1 buffers into the server
and N-1 out), written from ppermute; equal to psum exactly on integer inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def server_all_reduce(x, axis: str, server: int = 0):
    """psum(x, axis) through one device: every other device sends its x to `server`, which
    sums and sends the total back (a gradient server's traffic pattern)."""
    n = jax.lax.axis_size(axis)
    if n == 1:
        return x
    total = x
    for worker in range(n):
        if worker != server:
            total = total + jax.lax.ppermute(x, axis, [(worker, server)])
    # One send per worker (a permute's sources must differ); each worker gets one.
    received = sum(
        jax.lax.ppermute(total, axis, [(server, worker)]) for worker in range(n) if worker != server
    )
    return jnp.where(jax.lax.axis_index(axis) == server, total, received)
