"""A sequence as model code sees it where the step may split it over `context`
(jaxpar.parallel.context says how): this device's tokens of a whole per-token array
(`local`), the whole rows again (`whole`), a sum scattered back (`scatter_sum`), a
device's share of n items (`share`), and the original positions of its tokens. Each reads
the running step's split from the scope, and is the identity where none is split.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config.sections import ContextStrategy
from jaxpar.errors import ConfigError
from jaxpar.nn import scope
from jaxpar.parallel.axes import CONTEXT
from jaxpar.parallel.context import Split, order


def active() -> Split | None:
    """The running step's split, if it splits sequences."""
    ctx = scope.current()
    return None if ctx is None else ctx.sequence


def local(x_BxS: jax.Array) -> jax.Array:
    """This device's tokens of a whole per-token array of the batch (tokens, targets,
    positions, ...), in the step's token order: its S / C slots."""
    split = active()
    if split is None:
        return x_BxS
    seq = x_BxS.shape[1]
    part = seq // split.degree
    first = jax.lax.axis_index(CONTEXT) * part
    ordered = x_BxS[:, order(seq, split)] if split.balance else x_BxS
    return jax.lax.dynamic_slice_in_dim(ordered, first, part, axis=1)


def whole(x_BxS: jax.Array) -> jax.Array:
    """`local` undone: the whole rows, in their original order, of a per-token array of
    which each context device holds its S / C slots (an all_gather over `context`, then
    the reorder undone); unchanged where the step splits no sequence."""
    split = active()
    if split is None:
        return x_BxS
    gathered = jax.lax.all_gather(x_BxS, CONTEXT, axis=1, tiled=True)
    if not split.balance:
        return gathered
    return gathered[:, np.argsort(order(gathered.shape[1], split))]


def gathered(x_BxS: jax.Array) -> jax.Array | None:
    """Under `context`'s all_gather strategy, the whole rows of a per-token array in the
    step's token order (as attention gathers keys: causal_attention(..., gathered=True)
    takes them); None where the step splits no sequence or splits by Ulysses."""
    split = active()
    if split is None or split.strategy is not ContextStrategy.ALL_GATHER:
        return None
    return jax.lax.all_gather(x_BxS, CONTEXT, axis=1, tiled=True)


def scatter_sum(x_BxS: jax.Array) -> jax.Array:
    """Whole rows in original order, each context device's part of a sum, -> the sum at
    this device's S / C slots (`local` of it): a reduce-scatter over `context`;
    unchanged where the step splits no sequence."""
    split = active()
    if split is None:
        return x_BxS
    ordered = x_BxS[:, order(x_BxS.shape[1], split)] if split.balance else x_BxS
    return jax.lax.psum_scatter(ordered, CONTEXT, scatter_dimension=1, tiled=True)


def share(n: int) -> tuple[jax.Array | int, int]:
    """(first, count): this context device's ceil(n / C) of n items (the last device's
    may run past n); (0, n) where the step splits no sequence."""
    split = active()
    if split is None:
        return 0, n
    count = -(-n // split.degree)
    return jax.lax.axis_index(CONTEXT) * count, count


def positions(rows: int, seq: int) -> jax.Array:
    """[rows, S / C] the original positions of this device's tokens (one document a row;
    `seq`: the whole row's length)."""
    return local(jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq)))


def per_token(losses: jax.Array) -> jax.Array:
    """A model's losses, checked (while tracing) to be one per target of this device's
    S / C tokens where the step splits sequences: a model that read its batch's tokens
    itself, not through jaxpar.nn.documents, would compute every token on every context
    device (and attend to the wrong keys)."""
    split = active()
    if split is None or not split.seq_len:
        return losses
    if losses.ndim < 2 or losses.shape[1] * split.degree != split.seq_len:
        raise ConfigError(
            f"parallel.context={split.degree}: the model's loss has shape {losses.shape}, not "
            f"one per target of this device's {split.seq_len // split.degree} tokens "
            f"([rows, {split.seq_len // split.degree}]); a model split over context reads "
            "its batch through jaxpar.nn.documents (inputs, targets, of_inputs) and attends "
            "through jaxpar.causal_attention, as the shipped ones do; or use "
            "parallel.context=1"
        )
    return losses
