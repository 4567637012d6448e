"""Gradient accumulation over micro-batches, for any value_and_grad-like function."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def accumulate(value_and_grad: Callable, zeros, each: Callable = lambda grads: grads) -> Callable:
    """(params, micro_batches) -> (summed value, summed gradients).

    `value_and_grad(params, micro_batch) -> (value, grads)` runs once per micro-batch (the
    leading dim of `micro_batches`) in a scan; the value is a loss, or any pytree of them
    (a loss and the model's reports); `each` transforms every micro-batch's gradients
    before they are added into `zeros` (ZeRO-2 reduce-scatters them there, so the
    accumulator holds only this device's slice).
    """

    def run(params, micro_batches):
        def body(carry, micro_batch):
            value, acc = carry
            mb_value, grads = value_and_grad(params, micro_batch)
            value = jax.tree.map(jnp.add, value, mb_value)
            return (value, jax.tree.map(jnp.add, acc, each(grads))), None

        first = jax.tree.map(lambda x: x[0], micro_batches)
        shapes = jax.eval_shape(lambda: value_and_grad(params, first)[0])
        start = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        (value, grads), _ = jax.lax.scan(body, (start, zeros), micro_batches)
        return value, grads

    return run
