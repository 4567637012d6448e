"""The train state: what a step reads and writes, what checkpoints save."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct


@struct.dataclass
class TrainState:
    step: jax.Array  # optimizer steps taken (int32 scalar)
    params: Any  # fp32 master parameters (offload: in host memory, split as `opt`)
    opt: Any  # optax state of `params`
    compute: Any = None  # offload only: the compute-dtype parameters the device runs with

    @property
    def compute_params(self):
        """The parameters forward/backward read."""
        return self.params if self.compute is None else self.compute
