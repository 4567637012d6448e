"""The train state: what a step reads and writes, what checkpoints save."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.config.sections import OnNonfinite
from jaxpar.parallel.sharding import named, pick
from jaxpar.step import spikes


@struct.dataclass
class TrainState:
    step: jax.Array  # batches consumed (int32 scalar): the data position
    params: Any  # fp32 master parameters (offload: in host memory, split as `opt`)
    opt: Any  # optax state of `params`
    # steps whose loss or gradients were not finite and were not applied (int32 scalar)
    skipped: jax.Array
    compute: Any = None  # offload only: the compute-dtype parameters the device runs with
    # parallel.dp_sync=params only: each data-parallel device's own copy of the
    # parameters and its optimizer state (jaxpar.step.local_sgd.Local); `params` are then the
    # global parameters and `opt` the outer optimizer's state
    local: Any = None
    # train.on_spike only: the applied steps' losses a spike is judged by (jaxpar.step.spikes)
    window: Any = None

    @property
    def compute_params(self):
        """The parameters forward/backward read."""
        return self.params if self.compute is None else self.compute

    def advanced(self, applied, finite, on_nonfinite: str, loss=None, spike=False) -> TrainState:
        """The counters after a step (and the spike window after `loss`). `skip` consumes
        the batch either way, and so does a step held as a `spike`; `stop` halts at the
        first step it could not apply, so the state stays the last good one."""
        taken = 1 if on_nonfinite is OnNonfinite.SKIP else (applied | spike).astype(jnp.int32)
        window = self.window
        if window is not None:
            window = spikes.after(window, loss, applied, spike)
        return self.replace(
            step=self.step + taken,
            skipped=self.skipped + (~finite).astype(jnp.int32),
            window=window,
        )


def _masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def map_params(tx: optax.GradientTransformation, f, state, *rest, is_leaf=None, **kwargs):
    """optax.tree_map_params, leaving the leaves a partitioned optimizer masks out of a
    group (optax.partition's MaskedNode: Muon's AdamW leaves in its Muon state) as they
    are."""
    return optax.tree_map_params(
        tx,
        lambda x, *r: x if _masked(x) else f(x, *r),
        state,
        *rest,
        is_leaf=lambda x: _masked(x) or (is_leaf is not None and is_leaf(x)),
        **kwargs,
    )


def shardings(
    mesh: Mesh,
    specs,
    tx: optax.GradientTransformation,
    shapes,
    trainable=lambda tree: tree,
    window: bool = False,
) -> TrainState:
    """The state's shardings on the device, from the plan (`specs`) of params `shapes`:
    parameters as stored, the optimizer state as the optimizer's split of the
    `trainable` ones (and a spike `window`'s, replicated, where the run has one)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return TrainState(
        step=replicated,
        params=named(mesh, pick(specs, "storage")),
        opt=map_params(
            tx,
            lambda _, sh: sh,
            jax.eval_shape(tx.init, trainable(shapes)),
            named(mesh, pick(trainable(specs), "opt")),
            transform_non_params=lambda _: replicated,
        ),
        skipped=replicated,
        window=spikes.Window(replicated, replicated, replicated) if window else None,
    )
