"""ZeRO-Offload: optimizer state and fp32 master weights in host memory, the update
computed on the host, the device keeping only compute-dtype parameters; and the layer
inputs kept for the backward pass (`parallel.remat=offload`) sent to host memory.

Offload is a state layout (`layout`) and an update (`host_update`); the step is the
same with or without it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding

from jaxpar.config.sections import Offload
from jaxpar.nn.scope import HOST, LAYER_INPUT
from jaxpar.step.optimizer import keep_if
from jaxpar.step.state import TrainState


def on_host(shardings):
    """The same shardings in host memory."""
    return jax.tree.map(
        lambda s: s.with_memory_kind(HOST),
        shardings,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def layout(mode: str, device: TrainState, opt_params: object) -> TrainState:
    """The state's shardings with offload `mode` (optimizer | optimizer+params), from
    those without it (`device`) and the optimizer-state split of the parameters: master
    weights and optimizer state on the host, split as ZeRO splits the optimizer state;
    the compute copy on the device (optimizer) or, as stored shards, on the host too."""
    return device.replace(
        params=on_host(opt_params),
        opt=on_host(device.opt),
        compute=device.params if mode is Offload.OPTIMIZER else on_host(device.params),
    )


def compute_copy(params, dtype):
    """The device's compute copy of the parameters: floating leaves in `dtype` (a
    quantized base's codes as they are)."""
    return jax.tree.map(
        lambda p: p.astype(dtype) if jax.numpy.issubdtype(p.dtype, jax.numpy.floating) else p,
        params,
    )


def host_update(
    tx: optax.GradientTransformation,
    dtype,
    clip: Callable,
    verdict: Callable,
    shardings: TrainState,
    opt_params,
    problem,
) -> Callable:
    """(state, grads, loss, spike) -> (state with the update applied if `verdict` allows,
    gradient norm, applied, finite), clipping and updating on the host: the gradients go there
    (split as `opt_params`), the compute copy comes back. Only `problem`'s trained leaves
    move (Problem.trainable)."""
    trained = problem.trainable

    @compute_on("device_host")
    @jax.jit
    def on_the_host(grads, opt_state, master, loss, skipped, spike):
        grads, grad_norm = clip(grads)
        applied, finite = verdict(loss, grad_norm, skipped, spike)
        updates, new_opt = tx.update(grads, opt_state, master)
        master = keep_if(applied, optax.apply_updates(master, updates), master)
        opt_state = keep_if(applied, new_opt, opt_state)
        compute = compute_copy(master, dtype)
        return master, opt_state, compute, grad_norm, applied, finite

    def update(state: TrainState, grads, loss, spike):
        host = on_host(shardings.step)
        master, opt, compute, *scalars = on_the_host(
            jax.device_put(grads, on_host(trained(opt_params))),
            state.opt,
            trained(state.params),
            jax.device_put(loss, host),
            jax.device_put(state.skipped, host),
            jax.device_put(spike, host),
        )
        new = state.replace(
            params=problem.joined(state.params, master),
            opt=opt,
            compute=problem.joined(
                state.compute, jax.device_put(compute, trained(shardings.compute))
            ),
        )
        return new, *jax.device_put(scalars, shardings.step)

    return update


def host_scaled(shardings: TrainState, dtype, names: dict) -> Callable:
    """(state, factors) -> the state with QK-clip's heads (jaxpar.step.qk_clip.Factors)
    scaled in its master weights on the host, and their compute copy made again there
    from them: the device's copy is the scaled master's, as after an update."""

    def scaled(state: TrainState, factors) -> TrainState:
        keys = sorted(factors.keys)
        each = factors.each(state.compute, names)  # made on the device, small
        moved = jax.device_put([f for _, f in each], on_host(shardings.step))

        @compute_on("device_host")
        @jax.jit
        def on_the_host(master, moved):
            keyed = [(k, f) for (k, _), f in zip(each, moved, strict=True)]
            master = factors.applied(master, names, keyed)
            return master, compute_copy(master, dtype)

        master, compute = on_the_host({k: state.params[k] for k in keys}, moved)
        placed = {k: jax.device_put(compute[k], shardings.compute[k]) for k in keys}
        return state.replace(params={**state.params, **master}, compute={**state.compute, **placed})

    return scaled


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
