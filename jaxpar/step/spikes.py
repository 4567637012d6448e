"""Loss spikes (train.on_spike): a step spikes when its loss is over the mean of the
last train.spike_window applied steps' losses by more than train.spike_sigmas of their
standard deviations, the rule Levanter's and OLMo's skip-step optimizers use. The
window is part of the train state (saved with it, so a resume judges as the run would
have), and the check waits until it holds half its steps. A spiking step is never
applied and never enters the window; the loop rolls back on it with `rollback`."""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Window:
    losses: jnp.ndarray  # [train.spike_window] the applied steps' losses, newest at `seen % n`
    seen: jnp.ndarray  # int32: applied steps so far
    spikes: jnp.ndarray  # int32: steps held as spikes so far


def empty(window: int) -> Window:
    zero = jnp.zeros((), jnp.int32)
    return Window(jnp.zeros((window,), jnp.float32), zero, zero)


def limit(window: Window, sigmas: float) -> jnp.ndarray:
    """The loss over which a step spikes: the window's mean + `sigmas` standard
    deviations, or +inf while the window holds fewer than half its steps."""
    n = window.losses.shape[0]
    held = jnp.minimum(window.seen, n)
    filled = jnp.arange(n) < held
    count = jnp.maximum(held, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(filled, window.losses, 0.0)) / count
    var = jnp.sum(jnp.where(filled, jnp.square(window.losses - mean), 0.0)) / count
    ready = held >= (n + 1) // 2
    return jnp.where(ready, mean + sigmas * jnp.sqrt(var), jnp.inf)


def judged(loss, window: Window | None, sigmas: float) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(does `loss` spike over `window`?, the limit it was judged by): never where the
    run keeps no window, nor a loss that is not finite (train.on_nonfinite's)."""
    if window is None:
        return jnp.zeros((), bool), jnp.full((), jnp.inf, jnp.float32)
    over = limit(window, sigmas)
    return jnp.isfinite(loss) & (loss > over), over


def after(window: Window, loss, applied, spike) -> Window:
    """The window after a step: its loss in, if the step was applied."""
    n = window.losses.shape[0]
    put = window.losses.at[window.seen % n].set(loss.astype(jnp.float32))
    return Window(
        losses=jnp.where(applied, put, window.losses),
        seen=window.seen + applied.astype(jnp.int32),
        spikes=window.spikes + spike.astype(jnp.int32),
    )
