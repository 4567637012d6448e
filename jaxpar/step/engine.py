"""What every step builder shares (jaxpar.step.gradient_sync for gradient sync,
jaxpar.step.local_sgd for parameter averaging): the Engine they return, the metrics a
step reports, the ZeRO policy, the forward/backward on this device's rows, the held-out
loss, and jitting.

Forward/backward runs inside a shard_map that is manual over `replica`, `data`,
`pipeline` and `context` (`tensor` stays with the compiler, which splits the model per
the rules), so each device holds its local gradients and the reductions are placed by
hand.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.config.sections import DpSync, Offload, Parallel, Schedule, Train
from jaxpar.cost import formulas as cost
from jaxpar.nn import scope, sequence, staging
from jaxpar.nn.problem import Problem, trained_count
from jaxpar.parallel import context, pipeline
from jaxpar.parallel.axes import BATCH_AXES, CONTEXT, DATA, EXPERT, MANUAL_AXES, PIPE
from jaxpar.parallel.batches import batch_split
from jaxpar.parallel.leaf_layout import leaf_layout
from jaxpar.parallel.mesh import by_hand
from jaxpar.parallel.schedules import V_SHAPED
from jaxpar.parallel.sharding import LeafSpecs, only_axes, rules_for
from jaxpar.parallel.zero import ZeroPolicy
from jaxpar.step import initial, pipelined, qk_clip, xla_flags
from jaxpar.step.accumulate import accumulate


class StepMetrics(NamedTuple):
    """What one step reports, on the device (read on the host a step later)."""

    loss: jax.Array
    lr: jax.Array
    grad_norm: jax.Array
    skipped: jax.Array  # steps skipped as not finite so far
    targets: jax.Array  # the global batch's trained loss elements (the loss's divisor)
    # what the model reported (jaxpar.report), the mean over micro-batches and devices
    reports: dict = {}  # noqa: RUF012 (a NamedTuple's default, never mutated)
    spike: jax.Array | bool = False  # this step's loss spiked (train.on_spike): not applied
    spike_limit: jax.Array | float = float("inf")  # the loss over which it would have


@dataclass(frozen=True)
class Engine:
    """Everything built for one (problem, config, mesh): specs, shardings, jitted functions."""

    specs: Any  # params pytree of LeafSpecs
    tx: optax.GradientTransformation  # the optimizer (its state's structure)
    state_shardings: Any  # TrainState of NamedShardings
    batch_sharding: NamedSharding
    init: Any  # key -> TrainState, in its shardings (jaxpar.step.initial)
    step: Any  # jitted: (state, batch) -> (state, metrics); state donated where `donates`
    grads: Any  # jitted: (state, batch) -> the reduced gradients (diagnostics)
    layout: pipeline.Layout | None  # the pipeline's stage assignment (None: no pipeline)
    problem: Problem  # as trained: with a pipeline, its layer stack in pipeline layout
    # params pytree of leaf_layout.Leaf: each leaf as `specs` place it on the mesh, counted
    # once (what jaxpar.cost's formulas read)
    leaves: Any
    # parallel.dp_sync=params: jitted, parameters -> each device's copy and its fresh
    # optimizer state (jaxpar.step.local_sgd.Local)
    spread: Any = None
    # jitted: (state, batch) -> (the batch's mean loss, the model's reports), forward
    # only (held-out loss)
    evaluate: Any = None
    compiler_options: dict = dataclasses.field(default_factory=dict)  # XLA flags (GPU)
    # whether the step reuses its input state's buffers; not where every step's state is
    # saved, which the save then reads as it is, with no copy (checkpoint.every=1)
    donates: bool = True

    def export(self, params):
        """Parameters in the model's own layout (the layer stack unstaged)."""
        if self.layout is None:
            return params
        # on the host: offloaded master weights cannot be indexed on the device
        return staging.unstaged(self.problem, self.layout, jax.device_get(params))


def zero_policy(train: Train, par: Parallel, specs, names, frozen=frozenset()) -> ZeroPolicy:
    return ZeroPolicy(
        stage=par.zero,
        specs=specs,
        names=names,
        dtype=cost.DTYPES[train.precision],
        reduce_dtype=cost.DTYPES[cost.reduce_precision(train)],
        dp_mode=par.dp_collective,
        bucket_bytes=par.bucket_mb * 2**20,
        fetch=par.offload is Offload.OPTIMIZER_PARAMS,
        frozen=frozen,
    )


def jitted(
    mesh: Mesh,
    *,
    fresh,
    step,
    grads,
    evaluate,
    state_shardings,
    specs,
    problem,
    donates=True,
    **fields,
) -> Engine:
    """The Engine of these functions, jitted: `problem`'s init then `fresh` (parameters ->
    the step-0 state) into the state's shardings (jaxpar.step.initial), `step` donating
    its state (where `donates`), the batch split over the batch axes; on a GPU, compiled
    with jaxpar.step.xla_flags. Its leaves counted once, as `specs` place `problem`'s."""
    batch_sharding = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    options = xla_flags.for_step(scope.target(mesh), mesh.size)
    return Engine(
        state_shardings=state_shardings,
        batch_sharding=batch_sharding,
        init=initial.initializer(problem.init, fresh, state_shardings, problem.shapes),
        step=jax.jit(
            step,
            in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())),
            donate_argnums=0 if donates else (),
            compiler_options=options,
        ),
        grads=jax.jit(grads, compiler_options=options),
        evaluate=jax.jit(evaluate, compiler_options=options),
        compiler_options=options,
        donates=donates,
        specs=specs,
        problem=problem,
        leaves=leaf_layout(
            specs, problem.shapes, problem.names, dict(mesh.shape), problem.scans_layers
        ),
        **fields,
    )


def _context(train: Train, par: Parallel, mesh: Mesh, policy: ZeroPolicy) -> scope.Context:
    return scope.Context(
        rules=rules_for(par.sequence_parallel),
        mesh_shape=dict(mesh.shape),
        keep=policy.keep(par.remat),
        layer=policy.layer,
        whole=policy.whole,
        platform=scope.target(mesh),
        unroll=train.unroll,
        sequence=context.split_of(par, dict(mesh.shape), train.seq_len),
        sequence_parallel=par.sequence_parallel,
        batch_axes=() if par.dp_sync is DpSync.PARAMS else (*BATCH_AXES, CONTEXT),
    )


def _micro_batches(train: Train, par: Parallel, mesh: Mesh, batch):
    """This device's rows as [train.grad_accum, rows, ...]."""
    rows = batch_split(train, par, dict(mesh.shape)).accum
    return jax.tree.map(lambda x: x.reshape((train.grad_accum, rows) + x.shape[1:]), batch)


def per_micro_batch(reports: dict, train: Train) -> dict:
    """The model's reports summed over the micro-batches, as their mean (a maximum,
    scope.MAXIMUM's, as it is)."""
    return {
        name: value if name.startswith(scope.MAXIMUM) else value / train.grad_accum
        for name, value in reports.items()
    }


def device_mean(reports: dict) -> dict:
    """Each device's reports as the batch's: their mean over the devices (a maximum is
    the batch's already: jaxpar.step.qk_clip.reported)."""
    return {
        name: value if name.startswith(scope.MAXIMUM) else jax.lax.pmean(value, MANUAL_AXES)
        for name, value in reports.items()
    }


def at_least_one(count) -> jax.Array:
    """A loss's divisor: where nothing in the batch is trained, 1 (the loss and its
    gradient are then 0, not NaN)."""
    return jnp.maximum(count, 1.0)


def manual(specs, field: str):
    """The part of each leaf's spec that a shard_map manual over `data`, `expert` and
    `pipeline` sees (the other axes stay with the compiler)."""
    return jax.tree.map(
        lambda s: only_axes(getattr(s, field), (DATA, EXPERT, PIPE)),
        specs,
        is_leaf=lambda x: isinstance(x, LeafSpecs),
    )


def evaluator(
    problem: Problem,
    train: Train,
    par: Parallel,
    mesh: Mesh,
    policy: ZeroPolicy,
    layout,
    given: Problem,
):
    """(stored compute params, global batch) -> (the batch's mean loss, the model's
    reports' mean over micro-batches): the forward pass alone, in the training layout (a
    pipeline runs its forward ticks only, as GPipe; ZeRO-3 gathers each layer as in
    training), over train.grad_accum micro-batches. `problem` as trained
    (pipeline-staged), `given` as the user gave it."""
    ctx = _context(train, par, mesh, policy)
    if layout is None:

        def loss_sum(params, mb):
            with scope.reporting() as reports:
                losses = sequence.per_token(problem.loss(policy.compute_view(params), mb))
            return jnp.sum(losses.astype(jnp.float32)), dict(reports)

    else:
        kept = (Schedule.INTERLEAVED, *V_SHAPED)  # their layouts' own forward; the rest gpipe's
        forward = par.schedule if par.schedule in kept else Schedule.GPIPE
        pipe = pipelined.Pipe(problem, layout, forward, par.microbatches)
        loss_sum = functools.partial(pipelined.forward_loss, pipe, policy.compute_view)

    def local(params, batch):
        with scope.active(ctx):
            micro = _micro_batches(train, par, mesh, batch)
            sums, reports = jax.lax.map(lambda mb: loss_sum(params, mb), micro)
        reports = jax.tree.map(lambda r: jnp.mean(r, 0), reports)
        if layout is not None:  # reported on the last stage, zeros elsewhere
            reports = jax.tree.map(lambda r: jax.lax.psum(r, PIPE), reports)
        return jax.lax.psum(jnp.sum(sums), MANUAL_AXES), reports

    def mean_loss(params, batch):
        total, reports = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(manual(policy.specs, "storage"), PartitionSpec(BATCH_AXES)),
            out_specs=PartitionSpec(),
            axis_names=by_hand(mesh, MANUAL_AXES),
            check_vma=False,
        )(params, batch)
        return total / at_least_one(trained_count(given, batch)), reports

    return mean_loss


def local_value_and_grad(
    problem: Problem,
    train: Train,
    par: Parallel,
    mesh: Mesh,
    policy: ZeroPolicy,
    layout,
    clip_rules: list | None = None,
):
    """((params, this device's rows, the trained loss elements of the batch they are
    part of) -> ((its loss sum / that count, the model's reports summed), its gradients,
    accumulated over train.grad_accum micro-batches), the pipeline or None), with the
    model's context active; for a shard_map manual over the batch axes. `clip_rules`
    (QK-clip): attention's largest logits are reported too, and each one's weights
    kept there (jaxpar.step.qk_clip)."""
    ctx = _context(train, par, mesh, policy)
    pipe = None
    if layout is None:

        def value_and_grad(params, mb, count):
            def loss(trained):  # the frozen leaves are constants: no gradient
                view = policy.compute_view(problem.joined(params, trained))
                with scope.reporting() as reports, qk_clip.watched(clip_rules is not None) as seen:
                    losses = sequence.per_token(problem.loss(view, mb))
                reports |= qk_clip.reported(seen, clip_rules)
                return jnp.sum(losses.astype(jnp.float32)) / count, reports

            return jax.value_and_grad(loss, has_aux=True)(problem.trainable(params))

    else:
        pipe = pipelined.Pipe(problem, layout, par.schedule, par.microbatches)
        value_and_grad = pipelined.value_and_grad(pipe, policy.compute_view, clip_rules)

    def local(params, batch, count):
        count = at_least_one(count)
        with scope.active(ctx):
            return accumulate(
                lambda p, mb: value_and_grad(p, mb, count),
                policy.accumulator(problem.trainable(params)),
                each=policy.each_micro_batch,
            )(params, _micro_batches(train, par, mesh, batch))

    return local, pipe
