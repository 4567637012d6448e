"""The zero-bubble schedules' backward in three parts on one pipeline device (the tick
executor is jaxpar.step.pipelined): R, B and W, a layer at a time, from one split of the
layer's backward (jaxpar.step.split_backward).

R recomputes the chunk's forward from its stage input, as 1F1B's backward does, and
keeps each layer's residuals in a slot until the B tick (the schedule runs B a tick or
two later, so one slot is enough: the recompute costs the memory of one micro-batch's
saved activations, where keeping them from the forward would cost p of them; and of
those, not what B makes again by elementwise steps from the rest). B runs
the layers' B halves top down and hands the input's gradient back. What each layer's W
half reads (the inputs of its weight products and their output gradients) is kept in a
slot until the W tick, which makes the weights' gradients from it: W recomputes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpar.step.split_backward import Split, split


@dataclass(frozen=True)
class Halves:
    """A stage's chunk as layers, each differentiated on its own."""

    split: Split
    args: Callable  # (layer index, micro-batch) -> (trained leaves, (micro-batch, frozen))
    active: jax.Array | None  # [the device's layer slots] bool: its real layers (the rest
    # pad); None: every slot is a layer, and none is branched on (XLA makes a branch per
    # layer a select, computing both sides and keeping each side's buffers)
    layers: int  # layer slots a chunk (a device holds one chunk, or two in a V)

    def kept_shapes(self, lead: tuple[int, ...]):
        """Zeros for `lead` slots of what B keeps for W."""
        return self._zeros(self.split.kept, lead + (self.layers,))

    def residual_shapes(self):
        """Zeros for the one slot of what R keeps for B."""
        return self._zeros(self.split.residuals, (self.layers,))

    def _zeros(self, which, lead: tuple[int, ...]):
        return [jnp.zeros(lead + s.shape, s.dtype) for s in self.split.shapes(which)]

    def _if_layer(self, n, run, pad):
        """run() where slot n holds a layer, pad() where it pads the stack."""
        return run() if self.active is None else jax.lax.cond(self.active[n], run, pad)

    def recompute(self, x, mb, first, into: list) -> list:
        """The R of the chunk from layer slot `first`: `into` ([layers, ...] each, the
        device's one residual slot) filled by each layer's residuals as the layer makes
        them (in place: no chunk's worth of them stacked first)."""
        sp, no_res = self.split, self._zeros(self.split.residuals, ())

        def forward(carry, n_j):
            (h, buffers), (n, j) = carry, n_j
            w, aux = self.args(n, mb)
            y, res = self._if_layer(n, lambda: sp.forward(w, h, aux), lambda: (h, no_res))
            return (y, _written(buffers, res, (j,))), None

        return jax.lax.scan(forward, (x, into), self._numbered(first))[0][1]

    def input_grad(self, residuals: list, dy, mb, first, into: list, slot):
        """(dx, `into` with slot `slot` filled by what W reads): the chunk's B, top down,
        from R's `residuals`, each layer's read and written in place."""
        sp, no_kept = self.split, self._zeros(self.split.kept, ())

        def backward(carry, n_j):
            (d, buffers), (n, j) = carry, n_j
            w, aux = self.args(n, mb)
            res = _read(residuals, (j,))
            d, kept = self._if_layer(n, lambda: sp.input_grad(res, w, aux, d), lambda: (d, no_kept))
            return (d, _written(buffers, kept, (slot, j))), None

        (dx, held), _ = jax.lax.scan(backward, (dy, into), self._numbered(first), reverse=True)
        return dx, held

    def weight_grad(self, held: list, slot, mb, first):
        """The chunk's W from slot `slot` of what B kept: its trained leaves' gradients,
        [layers, ...] each."""
        sp = self.split

        def one(_, n_j):
            n, j = n_j
            w, aux = self.args(n, mb)
            zeros = jax.tree.map(jnp.zeros_like, w)
            kept = _read(held, (slot, j))
            return None, self._if_layer(n, lambda: sp.weight_grad(kept, w, aux), lambda: zeros)

        return jax.lax.scan(one, None, self._numbered(first))[1]

    def _numbered(self, first):
        """(the device's layer slot, its place in the chunk) of each of the chunk's."""
        return first + jnp.arange(self.layers), jnp.arange(self.layers)


def _read(buffers: list, at: tuple) -> list:
    """Each buffer's [*at] (leading indices)."""
    return [b[at] for b in buffers]


def _written(buffers: list, values: list, at: tuple) -> list:
    """Each buffer with [*at] = its value, in place."""
    return [
        jax.lax.dynamic_update_slice(
            b, v.reshape((1,) * len(at) + v.shape).astype(b.dtype), at + (0,) * v.ndim
        )
        for b, v in zip(buffers, values, strict=True)
    ]


def halves(layer, prepare, stack: dict, frozen: dict, active, h_shape, mb, layers: int) -> Halves:
    """`layer(params, h, micro-batch)` over this device's `stack` ([1, slots, ...] each;
    `frozen`: the stack's leaves not trained) as R, B and W of chunks of `layers` slots,
    split at the shapes of one layer, activation `h_shape` and micro-batch `mb`."""

    def args(n, mb):
        def pick(tree):
            return {
                k: jax.lax.dynamic_index_in_dim(v[0], n, keepdims=False) for k, v in tree.items()
            }

        return pick(stack), (mb, pick(frozen))

    def fn(w, h, aux):
        mb, frozen_n = aux
        return layer(prepare({**frozen_n, **w}), h, mb)

    shape = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    w, aux = args(0, mb)
    made = split(fn, shape(w), h_shape, shape(aux))
    return Halves(split=made, args=args, active=active, layers=layers)
