"""The host's side of loss spikes (train.on_spike; the rule is jaxpar.step.spikes): a
spike as the loop keeps it, says it and writes it."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Spike:
    """A step whose loss spiked (train.on_spike): held, and with `back_to` rolled back."""

    step: int  # 1-based
    loss: float
    limit: float  # the loss over which a step spiked then
    back_to: int | None = None  # the checkpoint rolled back to (None: skipped)

    def said(self, sigmas: float, window: int) -> str:
        head = (
            f"step {self.step}: the loss {self.loss:.4g} spiked over {self.limit:.4g} (the "
            f"mean of the last {window} applied steps' losses + {sigmas:g} standard deviations)"
        )
        if self.back_to is None:
            return f"{head}: not applied, its batch skipped"
        first = self.back_to + 1
        skipped = f"{first}-{self.step}" if self.step > first else self.step
        return (
            f"{head}: rolled back to step {self.back_to}'s checkpoint, skipping batches {skipped}"
        )

    def to_json(self) -> dict:
        return {"step": self.step, "loss": self.loss, "limit": self.limit, "back_to": self.back_to}


def columns(host) -> dict:
    """A metrics row's columns of a watched step: spiked (0/1), spike_limit (None
    while the window is less than half full)."""
    limit = float(host.spike_limit)
    return {"spiked": int(host.spike), "spike_limit": limit if math.isfinite(limit) else None}
