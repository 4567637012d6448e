"""ZeRO-Offload: optimizer state and fp32 master weights in host memory, the update
computed on the host, the device keeping only compute-dtype parameters."""

from __future__ import annotations

import jax
import optax
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding

HOST = "pinned_host"


def on_host(shardings):
    """The same shardings in host memory."""
    return jax.tree.map(
        lambda s: s.with_memory_kind(HOST),
        shardings,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def host_update(tx: optax.GradientTransformation, dtype, clipped):
    """(grads, opt_state, master) on the host -> (new master, new opt_state, compute copy,
    gradient norm); `clipped` clips the gradients there."""

    @compute_on("device_host")
    @jax.jit
    def update(grads, opt_state, master):
        grads, grad_norm = clipped(grads)
        updates, opt_state = tx.update(grads, opt_state, master)
        master = optax.apply_updates(master, updates)
        return master, opt_state, jax.tree.map(lambda p: p.astype(dtype), master), grad_norm

    return update
