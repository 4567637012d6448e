"""A batch's documents and its trained targets, read from the batch's own keys.

A batch is `tokens` [rows, seq_len + 1], and where the data has them (jaxpar.data.tokens):
- `segment_ids` [rows, seq_len + 1]: which document of the row each token is in; tokens
  attend only within their own segment, causally;
- `positions` [rows, seq_len + 1]: each token's position within its segment, from 0;
- `loss_mask` [rows, seq_len + 1]: 1 where a token is trained on as a target.

The target of input j is token j + 1. It is trained on where `loss_mask` marks it (all
targets without a mask), and never where it starts a new segment: the first token of a
document is not predicted from the one before it. `trained_targets` counts the trained
targets of a batch: the step divides the summed loss of the global batch by that count,
whatever the layout (never a mean of per-device or per-micro-batch means).

In a step that splits sequences over `context`, the inputs, targets and everything per
token are this device's tokens, in the step's token order (jaxpar.parallel.context: causal
balance reorders them), and the inputs always have positions.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpar.data.tokens import LOSS_MASK, POSITIONS, SEGMENT_IDS
from jaxpar.nn import sequence


class Documents(NamedTuple):
    """The inputs' documents: what attention and position embeddings read."""

    segment_ids: jax.Array | None  # [B, S] (None: one document a row)
    positions: jax.Array  # [B, S]


def inputs(batch: dict) -> jax.Array:
    """[B, S] the input tokens, tokens[:, :-1]."""
    return sequence.local(batch["tokens"][:, :-1])


def targets(batch: dict) -> jax.Array:
    """[B, S] the targets, tokens[:, 1:]."""
    return sequence.local(batch["tokens"][:, 1:])


def of_inputs(batch: dict) -> Documents | None:
    """The documents of the inputs (None: one document a row, in order)."""
    if SEGMENT_IDS not in batch:
        if sequence.active() is None:
            return None
        return Documents(None, sequence.positions(*batch["tokens"][:, :-1].shape))
    return Documents(
        sequence.local(batch[SEGMENT_IDS][:, :-1]),
        sequence.local(batch[POSITIONS][:, :-1]),
    )


def target_weights(batch: dict) -> jax.Array | None:
    """[B, S] bool: which targets tokens[:, 1:] are trained (None: all of them), in the
    step's token order."""
    weights = None
    if LOSS_MASK in batch:
        weights = batch[LOSS_MASK][:, 1:] != 0
    if SEGMENT_IDS in batch:
        segments = batch[SEGMENT_IDS]
        same = segments[:, 1:] == segments[:, :-1]
        weights = same if weights is None else weights & same
    return None if weights is None else sequence.local(weights)


def ahead(x_BxN: jax.Array, k: int, fill) -> jax.Array:
    """[B, N - 1]: x[:, i + k] at each i, `fill` past the row's end (whole rows)."""
    width = x_BxN.shape[1] - 1
    part = x_BxN[:, k : k + width]
    return jnp.pad(part, ((0, 0), (0, width - part.shape[1])), constant_values=fill)


def trained_ahead(batch: dict, k: int) -> jax.Array:
    """[B, S] whether input i's target k further on (token i + 1 + k) is trained: in the
    row, marked by the loss mask, in input i's document (multi-token prediction's
    targets; k = 0 is target_weights'), in the step's token order."""
    tokens = batch["tokens"]
    trained = ahead(jnp.ones(tokens.shape, bool), 1 + k, False)
    if LOSS_MASK in batch:
        trained = trained & (ahead(batch[LOSS_MASK], 1 + k, 0) != 0)
    if SEGMENT_IDS in batch:
        segments = batch[SEGMENT_IDS]
        trained = trained & (segments[:, :-1] == ahead(segments, 1 + k, -1))
    return sequence.local(trained)


def trained_targets(batch: dict) -> jax.Array:
    """The number of trained targets in `batch` (float32; in a step, the global batch's)."""
    weights = target_weights(batch)
    if weights is None:
        rows, width = batch["tokens"].shape
        return jnp.float32(rows * (width - 1))
    return jnp.sum(weights, dtype=jnp.float32)


def masked(losses: jax.Array, batch: dict) -> jax.Array:
    """Per-target losses with the untrained ones zero (a select: never NaN times 0)."""
    weights = target_weights(batch)
    return losses if weights is None else jnp.where(weights, losses, 0.0)
