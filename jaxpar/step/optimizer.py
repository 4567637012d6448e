"""AdamW (or plain SGD) with warm-up and cosine decay, and global-norm clipping."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpar.config.sections import OnNonfinite, Optimizer, Train
from jaxpar.names import LAYERS, STAGE


def optimizer(train: Train, names) -> tuple[optax.GradientTransformation, Any]:
    """(AdamW or SGD (train.optimizer), its learning-rate schedule); weight decay on
    matrices only."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        train.lr,
        warmup_steps=train.warmup,
        decay_steps=max(train.steps, train.warmup + 1),
        end_value=train.lr * 0.1,
    )
    # Decay matrices only; the stacking dims (layers, stage) do not make a matrix.
    is_matrix = jax.tree.map(
        lambda n: sum(d not in (LAYERS, STAGE) for d in n) >= 2,
        names,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    if train.optimizer is Optimizer.SGD:
        decay = optax.add_decayed_weights(train.weight_decay, mask=is_matrix)
        return optax.chain(decay, optax.sgd(schedule)), schedule
    tx = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=train.weight_decay, mask=is_matrix)
    return tx, schedule


def clip(grads, clip_norm: float):
    """(grads scaled to global norm <= clip_norm (0: unclipped), their global norm).
    On sharded gradients the norm sums over all shards."""
    # (not optax.tree.norm: its sum starts from a device constant, which the host
    # update of an offloaded optimizer cannot add to)
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    if clip_norm > 0:
        scale = jnp.minimum(1.0, clip_norm / (grad_norm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
    return grads, grad_norm


def verdict(loss, grad_norm, skipped, on_nonfinite: OnNonfinite):
    """(apply the update?, is the step finite?): a step whose loss or gradient norm is
    not finite is never applied; with `stop`, neither is any after it (the loop saves
    the last good state and exits)."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    return (finite if on_nonfinite is OnNonfinite.SKIP else finite & (skipped == 0)), finite


def keep_if(apply, new, old):
    """`new` where `apply`, else `old`, leaf by leaf."""
    return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)
