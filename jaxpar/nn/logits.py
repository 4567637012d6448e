"""Each attention head's largest logit, out of the forward pass that computes it, for
QK-clip (muon.qk_clip; jaxpar.step.qk_clip).

While a training step asks for them (`watching`), a model's attention computes its
scores' maximum per head as it computes them (jaxpar.causal_attention's `logit_max`)
and hands it here with the weights that scale that head's logits (`seen`). Inside a
layer stack, jaxpar.scan_layers collects each layer's and hands them on stacked
([layers, heads]); the step takes the batch's maximum over its devices and
micro-batches. Outside such a step nothing is asked and nothing is kept.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import jax

from jaxpar.nn.scope import KEY


@dataclass(frozen=True)
class Scaled:
    """A weight (its key in the parameters) whose scaling by factor**power scales its
    head's logits by factor**power: one side of q . k. `part`: the index on the leaf's
    `qkv` dim (a fused q/k/v projection), None for a leaf of one side alone. `span`:
    (start, stop) on the leaf's `head_dim` dim, the head's dims scaled (latent
    attention's parts: its rotated dims, its others, or its keys beside its values);
    None: all of them."""

    key: str
    power: float
    part: int | None = None
    span: tuple[int, int] | None = None


@dataclass(frozen=True)
class Seen:
    """One attention's largest logit per head ([stack dims..., heads]) and its weights."""

    max_H: jax.Array
    scaled: tuple[Scaled, ...]


_SEEN: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxpar_logits", default=None)


def wanted() -> bool:
    """Whether the running step asks the attention for its largest logits."""
    return _SEEN.get() is not None


@contextlib.contextmanager
def watching():
    """Collect what attention hands on (`seen`) while a loss or a layer computes: the
    list yielded fills as it does."""
    seen: list[Seen] = []
    token = _SEEN.set(seen)
    try:
        yield seen
    finally:
        _SEEN.reset(token)


def seen(max_H: jax.Array, *scaled: tuple) -> None:
    """Hand on one attention's largest logit per head, with the weights that scale them:
    each (an nnx Variable of the model, its power[, its qkv part[, its head_dim span]]),
    as Scaled reads them."""
    by_key = tuple(Scaled(var.get_metadata()[KEY], *rest) for var, *rest in scaled)
    _SEEN.get().append(Seen(jax.lax.stop_gradient(max_H), by_key))


def stacked(per_layer: list[Seen], values: list[jax.Array]) -> None:
    """Hand on a layer stack's attention (`values`: each one's maxima, stacked over the
    layers as the scan returns them), in the order its layer handed them on."""
    for one, max_LxH in zip(per_layer, values, strict=True):
        _SEEN.get().append(Seen(max_LxH, one.scaled))
