"""ZeRO-Offload: optimizer state and fp32 master weights in host memory, the update
computed on the host, the device keeping only compute-dtype parameters; and the layer
inputs kept for the backward pass (`parallel.remat=offload`) sent to host memory."""

from __future__ import annotations

import jax
import optax
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding

HOST = "pinned_host"
LAYER_INPUT = "jaxpar_layer_input"  # checkpoint name of a layer's input (remat=offload)


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


def offloaded_activation_bytes(closed_jaxpr) -> int:
    """Per-device bytes of layer inputs the traced step sends to host memory to keep for
    its backward pass, at their peak: a stack of residuals built by a loop is counted
    where it is consumed, once, not once per iteration of loops that consume it whole.

    Read from the program as JAX traced it (a device_put to the host of each value named
    LAYER_INPUT, stacked by the scans around it). Inside the step's shard_map shapes are
    per device over the manual axes; a residual split over `tensor` would be counted
    whole (the shipped models keep the residual stream whole on every tensor rank).
    """
    return _offloaded(closed_jaxpr.jaxpr)[0]


def _offloaded(jaxpr) -> tuple[int, set[int]]:
    """(bytes consumed inside `jaxpr`, indices of its outputs that are offloaded stacks)."""
    named, residual, total = set(), set(), 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name" and eqn.params["name"] == LAYER_INPUT:
            named.add(eqn.outvars[0])
        elif eqn.primitive.name == "device_put":
            for out, src, dst in zip(eqn.outvars, eqn.invars, eqn.params["devices"], strict=True):
                if dst == jax.memory.Space.Host and _is_var(src) and src in named:
                    residual.add(out)
        inner = [0]  # one branch of a cond runs: its largest
        for sub in _subjaxprs(eqn.params):
            consumed, outs = _offloaded(sub)
            inner.append(consumed)
            if len(sub.outvars) == len(eqn.outvars):
                residual.update(eqn.outvars[i] for i in outs)
        total += max(inner) if eqn.primitive.name == "cond" else sum(inner)
    returned = {v for v in jaxpr.outvars if _is_var(v)}
    total += sum(v.aval.size * v.aval.dtype.itemsize for v in residual - returned)
    return total, {i for i, v in enumerate(jaxpr.outvars) if _is_var(v) and v in residual}


def _is_var(v) -> bool:
    return isinstance(v, jax.extend.core.Var)


def _subjaxprs(params):
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item
