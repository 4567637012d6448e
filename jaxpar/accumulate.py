"""Gradient accumulation over micro-batches, for any value_and_grad-like function."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def accumulate(value_and_grad: Callable, zeros, each: Callable = lambda grads: grads) -> Callable:
    """(params, micro_batches) -> (summed loss, summed gradients).

    `value_and_grad(params, micro_batch) -> (loss, grads)` runs once per micro-batch (the
    leading dim of `micro_batches`) in a scan; `each` transforms every micro-batch's
    gradients before they are added into `zeros` (ZeRO-2 reduce-scatters them there, so
    the accumulator holds only this device's slice).
    """

    def run(params, micro_batches):
        def body(carry, micro_batch):
            loss, acc = carry
            mb_loss, grads = value_and_grad(params, micro_batch)
            return (loss + mb_loss, jax.tree.map(jnp.add, acc, each(grads))), None

        (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), micro_batches)
        return loss, grads

    return run
