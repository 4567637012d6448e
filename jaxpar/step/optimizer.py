"""AdamW, plain SGD or Muon (jaxpar.step.muon) with warm-up and cosine decay, and
global-norm clipping."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpar.config.sections import Muon, OnNonfinite, Optimizer, Train
from jaxpar.names import BALANCE, LAYERS, STAGE
from jaxpar.step import muon


def schedule_of(train: Train, peak: float):
    """Warm-up (train.warmup steps from 0) to `peak`, then cosine decay to a tenth of it."""
    return optax.warmup_cosine_decay_schedule(
        0.0,
        peak,
        warmup_steps=train.warmup,
        decay_steps=max(train.steps, train.warmup + 1),
        end_value=peak * 0.1,
    )


def optimizer(
    train: Train, names, balance_step: float = 0.0, muon_keys: Muon | None = None, placed=None
) -> tuple[optax.GradientTransformation, Any]:
    """(AdamW, SGD or Muon (train.optimizer; Muon's keys `muon_keys`, its matrices
    orthogonalized where `placed` says: jaxpar.step.muon.owners), its learning-rate
    schedule); weight decay on matrices only. A router's balancing biases (named BALANCE)
    are moved by `balance_step` against the sign of their gradient (models/moe.py's
    `balanced`: DeepSeek's auxiliary-loss-free rule), outside the schedule, the decay and
    the clip."""
    schedule = schedule_of(train, train.lr)
    is_matrix = decayed(names)
    if train.optimizer is Optimizer.SGD:
        decay = optax.add_decayed_weights(train.weight_decay, mask=is_matrix)
        tx = optax.chain(decay, optax.sgd(schedule))
    elif train.optimizer is Optimizer.MUON:
        keys = muon_keys or Muon()
        rest = schedule_of(train, keys.adam_lr or train.lr)
        tx = muon.muon(keys, names, schedule, adamw(rest, train.weight_decay, is_matrix), placed)
    else:
        tx = adamw(schedule, train.weight_decay, is_matrix)
    balance = balancing(names)
    if not any(jax.tree.leaves(balance)):
        return tx, schedule
    return balanced(tx, balance, balance_step), schedule


def decayed(names):
    """The leaves weight decay applies to: matrices (the stacking dims, layers and stage,
    do not make one)."""
    return jax.tree.map(
        lambda n: sum(d not in (LAYERS, STAGE) for d in n) >= 2,
        names,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def adamw(schedule, weight_decay: float, is_matrix) -> optax.GradientTransformation:
    """AdamW (b1 0.9, b2 0.95) at `schedule`, decaying the leaves `is_matrix` marks."""
    return optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=is_matrix)


def balanced(tx: optax.GradientTransformation, balance, step: float):
    """`tx`, but the leaves `balance` marks move by -step x sign(their gradient). (Their
    moments in tx's state are kept and never read: a few numbers a layer, and one state
    layout for every leaf, which the state's sharding maps over.)"""

    def update(grads, state, params=None):
        updates, state = tx.update(grads, state, params)
        moved = lambda u, g, b: (-step * jnp.sign(g)).astype(u.dtype) if b else u  # noqa: E731
        return jax.tree.map(moved, updates, grads, balance), state

    return optax.GradientTransformation(tx.init, update)


def balance_step(problem) -> float:
    """The step of a model's balancing biases (ExpertDims.bias_step; 0: none move)."""
    experts = problem.dims.experts if problem.dims is not None else None
    return experts.bias_step if experts is not None else 0.0


def balancing(names):
    """Which leaves are a router's balancing bias (named BALANCE), leaf by leaf."""
    return jax.tree.map(lambda n: BALANCE in n, names, is_leaf=lambda x: isinstance(x, tuple))


def clip(grads, clip_norm: float, balance=None):
    """(grads scaled to global norm <= clip_norm (0: unclipped), their global norm).
    On sharded gradients the norm sums over all shards. The leaves `balance` marks
    (balancing) are counts, not gradients: outside the norm (a scale keeps their sign)."""
    # (not optax.tree.norm: its sum starts from a device constant, which the host
    # update of an offloaded optimizer cannot add to)
    leaves = jax.tree.leaves(grads)
    marks = jax.tree.leaves(balance) if balance is not None else [False] * len(leaves)
    squares = [jnp.sum(jnp.square(g)) for g, b in zip(leaves, marks, strict=True) if not b]
    grad_norm = jnp.sqrt(sum(squares))
    if clip_norm > 0:
        scale = jnp.minimum(1.0, clip_norm / (grad_norm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
    return grads, grad_norm


def verdict(loss, grad_norm, skipped, spike, on_nonfinite: OnNonfinite):
    """(apply the update?, is the step finite?): a step whose loss or gradient norm is
    not finite is never applied, nor is one held as a `spike` (jaxpar.step.spikes); with
    `stop`, neither is any after a step not finite (the loop saves the last good state
    and exits)."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    applied = finite if on_nonfinite is OnNonfinite.SKIP else finite & (skipped == 0)
    return applied & ~spike, finite


def keep_if(apply, new, old):
    """`new` where `apply`, else `old`, leaf by leaf."""
    return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)
