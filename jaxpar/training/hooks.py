"""What a run does around its steps besides stepping, plugged into `jaxpar.train` by an
objective or a feature without the trainer naming it: an RL objective's rollouts
before their steps (jaxpar.objectives.rollouts), train.eval_tasks' scores after theirs
(jaxpar.evaluation.during_training).

A hook subclasses Hook and overrides what it needs; every method has a default that
does nothing. The trainer calls, in order: `start` once the step is compiled and the
first state made; before each step `boundary` (may a stop end the run here?) and
`before_due`, and where due `before` (the step in flight settled first, so that its
time is its own); after each step `due`, and where due `after`, whose figures join the
held-out loss in that step's metrics row; `summary` at the end, into summary.json.
A hook that cannot go on raises jaxpar.errors.Stopped (e.g. a reward function's
failure): the run ends there, its state saved, and the error names the step."""

from __future__ import annotations

from pathlib import Path


class Hook:
    def start(self, run, state, files: Path | None, step: int) -> str:
        """Once, before the first step of this call (`step` steps done): set up on `run`'s
        devices (`files`: the run directory, where this process writes one). Returns
        lines for the start-up summary ("" for none)."""
        return ""

    def boundary(self, step: int) -> bool:
        """Whether the run may stop before step `step` (0-based): a resume starts there."""
        return True

    def before_due(self, step: int) -> bool:
        """Whether `before` runs before step `step` (0-based)."""
        return False

    def before(self, state, step: int) -> dict | None:
        """Work before step `step` (0-based): the columns its metrics row gains, or None."""
        return None

    def due(self, steps: int) -> bool:
        """Whether `after` runs on the state after `steps` steps."""
        return False

    def after(self, state) -> dict:
        """Figures of the state after a due step, logged beside the held-out loss."""
        return {}

    def summary(self) -> dict:
        """What this hook adds to summary.json."""
        return {}
