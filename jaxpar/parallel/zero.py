"""The ZeRO policy: what every parameter leaf needs over its ZeRO axes (`data`, and
`expert` for all but the experts' own weights: sharding.zero_axes) at each point of a
step.

Built from the plan (each leaf's LeafSpecs, with the dim ZeRO splits) and the stage:
- for compute: stage 3 all-gathers a split leaf just before use, in the compute dtype
  (a layer stack one layer at a time, inside jaxpar.scan_layers, and again in the
  backward pass; any other leaf once per micro-batch, kept whole until its backward);
  with parameter offload every stored shard is first fetched from host memory;
- per micro-batch: stage 2 reduce-scatters the gradients into a sliced accumulator;
- per step: stage 0 (and any leaf ZeRO cannot split) all-reduces, stage 1
  reduce-scatters; stage 3 gradients arrive reduce-scattered, as the gather's transpose.
Over two axes, each collective runs over one of them in turn (a reduce-scatter over
`data`, then over `expert` on the 1/data slice; gathers the other way round): together
they move what one collective over both would. Gradients are summed in `reduce_dtype`
(train.grad_reduce_dtype). All of it runs inside the step's shard_map, manual over
`replica`, `data` and `expert`; with replicas, the per-step gradients are then summed
over `replica` (hybrid sharding).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.config.sections import DpCollective, Remat
from jaxpar.parallel import collectives
from jaxpar.parallel import data_parallel as dp
from jaxpar.parallel.axes import DATA, EXPERT, REPLICA
from jaxpar.parallel.sharding import NOT_ZERO, LeafSpecs, leaf_key


class Keep(enum.Enum):
    """What scan_layers keeps of each layer for the backward pass (from parallel.remat
    and the ZeRO stage)."""

    EVERYTHING = "everything"  # remat=none
    INPUT = "input"  # remat=full: recompute the rest
    INPUT_ON_HOST = "input on host"  # remat=offload
    MATMULS = "matmuls"  # ZeRO-3 without remat: the matmul outputs, not gathered weights


def _leaves_map(fn, *trees):
    return jax.tree.map(fn, *trees, is_leaf=lambda x: isinstance(x, LeafSpecs))


def stack_dims(names: tuple[str, ...]) -> int:
    """How many leading dims stack a leaf's layers (`stage`, `layers`): 0 if none."""
    n = 0
    while n < len(names) and names[n] in NOT_ZERO:
        n += 1
    return n


@dataclass(frozen=True)
class ZeroPolicy:
    stage: int  # parallel.zero
    specs: Any  # params pytree of LeafSpecs
    names: Any  # params pytree of logical-name tuples
    dtype: Any  # compute dtype
    reduce_dtype: Any = jnp.float32  # what gradients are summed over `data` in
    dp_mode: str = "xla"  # parallel.dp_collective: how the reductions (and gathers) run
    bucket_bytes: float = 25 * 2**20  # ring/server bucket size
    fetch: bool = False  # stored parameter shards live in host memory
    # leaves not trained (Problem.frozen): made ready for compute, never reduced
    frozen: frozenset = frozenset()
    _by_key: dict = field(init=False, repr=False, compare=False)

    @property
    def grad_specs(self):
        """The specs of the trained leaves: what gradients are reduced by."""
        if not self.frozen:
            return self.specs
        return {k: s for k, s in self.specs.items() if k not in self.frozen}

    def __post_init__(self):
        table = {}
        jax.tree_util.tree_map_with_path(
            lambda path, s, names: table.__setitem__(leaf_key(path), (s, stack_dims(names))),
            self.specs,
            self.names,
            is_leaf=lambda x: isinstance(x, LeafSpecs),
        )
        object.__setattr__(self, "_by_key", table)

    # --- forward: stored leaf -> what the model computes with ---------------------------

    def _gathered(self, s: LeafSpecs) -> bool:
        return self.stage >= 3 and s.dim is not None

    def _materialize(self, s: LeafSpecs, lead: int, x):
        """Fetch a stored shard and gather it (cast to the compute dtype as it goes),
        `lead` stacking dims already sliced off: over its innermost ZeRO axis first."""
        if self.fetch:
            x = jax.device_put(x, jax.memory.Space.Device)
        if not self._gathered(s):
            return x
        spec = PartitionSpec(*s.compute[lead:])
        ring = self.dp_mode is DpCollective.RING
        floating = jnp.issubdtype(x.dtype, jnp.floating)  # a quantized base's codes: as they are
        for axis in reversed(s.over):
            x = collectives.gather(
                x,
                s.dim - lead,
                spec,
                axis,
                ring=ring,
                dtype=self.dtype if floating else x.dtype,
                reduce_dtype=self.reduce_dtype,
            )
        return x

    def compute_view(self, params):
        """Stored parameters (any sub-dict of them) -> what the forward pass reads: the
        compute dtype, ZeRO-3 leaves gathered. Layer stacks are not gathered here: `layer`
        gathers them a layer at a time (or `whole`, for a model that does not scan). A
        leaf to gather stays fp32 until its gather casts it, so that its gradient comes
        back summed in `reduce_dtype`, not rounded to the compute dtype before (with
        parameter offload it is cast before the fetch: half the host-device bytes)."""

        def one(path, x):
            s, lead = self._by_key[leaf_key(path)]
            cast_now = not self._gathered(s) or self.fetch
            if cast_now and jnp.issubdtype(x.dtype, jnp.floating):
                x = x.astype(self.dtype)
            return x if lead else self._materialize(s, 0, x)

        return jax.tree_util.tree_map_with_path(one, params)

    def keep(self, remat: Remat) -> Keep:
        """What scan_layers keeps for the backward pass (jaxpar.nn.scope.Context.keep):
        with no remat asked for, ZeRO-3 still re-gathers each layer's weights there
        instead of keeping them whole."""
        if remat is Remat.NONE:
            return Keep.MATMULS if self.stage >= 3 else Keep.EVERYTHING
        return {Remat.FULL: Keep.INPUT, Remat.OFFLOAD: Keep.INPUT_ON_HOST}[remat]

    def layer(self, key: str, x):
        """One layer's slice of a stacked leaf (cast by compute_view) -> ready to use."""
        s, lead = self._by_key[key]
        return self._materialize(s, lead, x)

    def whole(self, key: str, x):
        """A stacked leaf read whole (no scan_layers) -> ready to use; others unchanged."""
        s, lead = self._by_key[key]
        return self._materialize(s, 0, x) if lead else x

    # --- backward: local gradients -> reduced over the data-parallel axes ---------------

    def accumulator(self, params):
        """Zeros for the local gradient sum: ZeRO-2 keeps only this device's slice of each
        split leaf (ZeRO-3 parameters, and so their gradients, are slices already)."""

        def zeros(p, s: LeafSpecs):
            shape = p.shape
            if self.stage == 2 and s.dim is not None:
                n = math.prod(jax.lax.axis_size(a) for a in s.over)
                shape = tuple(d // n if i == s.dim else d for i, d in enumerate(shape))
            return jnp.zeros(shape, jnp.float32)

        return jax.tree.map(
            zeros, params, self.grad_specs, is_leaf=lambda x: isinstance(x, LeafSpecs)
        )

    def each_micro_batch(self, grads):
        """A micro-batch's gradients, as they are added to the accumulator."""
        if self.fetch:  # gradients of host-resident shards arrive on the host
            grads = jax.device_put(grads, jax.memory.Space.Device)
        if self.stage == 2:
            grads = self._scatter(grads)
        return grads

    def finish(self, grads):
        """The step's one reduction of the accumulated gradients: sum what ZeRO leaves
        whole; ZeRO-1 reduce-scatters now; ZeRO-2/3 slices arrive reduced already. Over
        `data` first, then over `expert` the leaves that are not the experts' own (split
        over it: each device's experts got every device's tokens by all-to-all), a
        split leaf's 1/data slice cut again 1/expert. Then, with replicas, each device's
        part (its slice where ZeRO splits) is summed over `replica`: the slow links
        carry 1/(data x expert) of the gradient."""
        if self.stage == 1:
            grads = self._scatter(grads)
        whole = _leaves_map(lambda s: dp.SUM if s.dim is None else None, self.grad_specs)
        grads = self._reduce(grads, whole)
        if jax.lax.axis_size(EXPERT) > 1:  # the copies over it (ZeRO<1 or unsplit leaves)
            copies = _leaves_map(
                lambda s: None if EXPERT in s.compute or s.dim is not None else dp.SUM,
                self.grad_specs,
            )
            grads = self._reduce(grads, copies, EXPERT)
        if jax.lax.axis_size(REPLICA) > 1:
            grads = self._reduce(grads, _leaves_map(lambda s: dp.SUM, self.grad_specs), REPLICA)
        return grads

    def _scatter(self, grads):
        """Reduce-scatter every split leaf over its ZeRO axes, outermost first: each
        axis cuts the slice the one before left."""
        for axis in (DATA, EXPERT):
            todo = _leaves_map(
                lambda s, a=axis: dp.SCATTER if a in s.over else None, self.grad_specs
            )
            grads = self._reduce(grads, todo, axis)
        return grads

    def _reduce(self, grads, todo, axis: str = DATA):
        return dp.reduce(
            grads, self.grad_specs, todo, self.dp_mode, self.bucket_bytes, self.reduce_dtype, axis
        )
