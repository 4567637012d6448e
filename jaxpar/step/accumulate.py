"""Gradient accumulation over micro-batches, for any value_and_grad-like function."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.nn import scope


def accumulate(value_and_grad: Callable, zeros, each: Callable = lambda grads: grads) -> Callable:
    """(params, micro_batches) -> (summed value, summed gradients).

    `value_and_grad(params, micro_batch) -> (value, grads)` runs once per micro-batch (the
    leading dim of `micro_batches`) in a scan; the value is a loss, or any pytree of them
    (a loss and the model's reports, each combined as jaxpar.nn.scope.combined says);
    `each` transforms every micro-batch's gradients before they are added into `zeros`
    (ZeRO-2 reduce-scatters them there, so the accumulator holds only this device's
    slice).
    """

    def run(params, micro_batches):
        def body(acc, micro_batch):
            value, grads = value_and_grad(params, micro_batch)
            return jax.tree.map(jnp.add, acc, each(grads)), value

        # the values come out of the scan a micro-batch each (scalars), so the model is
        # traced once, not a second time to learn their shapes for a carry
        grads, values = jax.lax.scan(body, zeros, micro_batches)
        # added in micro-batch order, as a carry from zero adds them
        return jax.tree_util.tree_map_with_path(_combined, values), grads

    return run


def _combined(path, v):
    """A value's micro-batches as one: a report by its name (scope.combined), else summed."""
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return scope.combined(names[-1] if names else "", list(v))
