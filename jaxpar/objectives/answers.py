"""The log-probabilities of each preference pair's answers under a model, from its
per-token losses: what DPO's loss compares, and what a precomputed reference holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.data.pairs import CHOSEN, REJECTED
from jaxpar.data.tokens import SEGMENT_IDS
from jaxpar.nn import sequence
from jaxpar.parallel.axes import CONTEXT


def answer_sums(per_token: jax.Array, batch: dict) -> jax.Array:
    """[rows, 2] each row's per-token values summed over its chosen and its rejected
    answer's trained targets (whole rows: summed over `context` where it splits them)."""
    segment = sequence.local(batch[SEGMENT_IDS][:, 1:])
    sums = jnp.stack(
        [jnp.sum(jnp.where(segment == s, per_token, 0.0), -1) for s in (CHOSEN, REJECTED)], -1
    )
    return jax.lax.psum(sums, CONTEXT) if sequence.active() is not None else sums


def logps(losses: jax.Array, batch: dict) -> jax.Array:
    """[rows, 2] log pi of each row's chosen and rejected answer, from the model's
    per-token losses (zero where a target is not trained)."""
    return -answer_sums(losses.astype(jnp.float32), batch)
