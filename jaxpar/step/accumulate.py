"""Gradient accumulation over micro-batches, for any value_and_grad-like function."""

from __future__ import annotations

import functools
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
        def body(acc, micro_batch):
            value, grads = value_and_grad(params, micro_batch)
            return jax.tree.map(jnp.add, acc, each(grads)), value

        # the values come out of the scan a micro-batch each (scalars), so the model is
        # traced once, not a second time to learn their shapes for a carry
        grads, values = jax.lax.scan(body, zeros, micro_batches)
        # added in micro-batch order, as a carry from zero adds them
        value = jax.tree.map(lambda v: functools.reduce(jnp.add, list(v)), values)
        return value, grads

    return run
