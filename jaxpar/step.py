"""The jitted train step, composed from the techniques in their own modules.

    stored state ──► compute view (zero.py: cast; ZeRO-3 gather; offload fetch)
      └─► value_and_grad per micro-batch (plain, or schedules.py for every pipeline schedule)
      └─► accumulate (accumulate.py; ZeRO-2 reduce-scatters each micro-batch)
      └─► finish the data-parallel reduction (zero.py via dp.py: xla | ring | server)
      └─► clip and AdamW (optim.py) on the device, or on the host (offload.py)

Forward/backward runs inside a shard_map that is manual over `replica`, `data` and
`pipeline` (`tensor` stays with the compiler, which splits the model per the rules), so
each device holds its local gradients and the reductions are placed by hand.
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

from jaxpar import context, offload, optim, pipeline, schedules, xla_flags
from jaxpar import state as state_lib
from jaxpar.accumulate import accumulate
from jaxpar.axes import BATCH_AXES, DATA, PIPE, REPLICA
from jaxpar.config import (
    Config,
    DpSync,
    Offload,
    Precision,
    ReduceDtype,
    Schedule,
    batch_split,
)
from jaxpar.problem import Problem, loss_elements
from jaxpar.sharding import RULES, LeafSpecs, named, only_axes, pick, plan
from jaxpar.state import TrainState
from jaxpar.zero import ZeroPolicy

DTYPES = {Precision.FP32: jnp.float32, Precision.BF16: jnp.bfloat16}


class StepMetrics(NamedTuple):
    """What one step reports, on the device (read on the host a step later)."""

    loss: jax.Array
    lr: jax.Array
    grad_norm: jax.Array
    skipped: jax.Array  # steps skipped as not finite so far


@dataclass(frozen=True)
class Engine:
    """Everything built for one (problem, config, mesh): specs, shardings, jitted functions."""

    specs: Any  # params pytree of LeafSpecs
    tx: optax.GradientTransformation  # the optimizer (its state's structure)
    state_shardings: TrainState  # of NamedShardings
    batch_sharding: NamedSharding
    init: Any  # jitted: key -> TrainState, created directly in its sharding
    step: Any  # jitted: (state, batch) -> (state, metrics); state is donated
    grads: Any  # jitted: (state, batch) -> the reduced gradients (diagnostics)
    layout: pipeline.Layout | None  # the pipeline's stage assignment (None: no pipeline)
    problem: Problem  # as trained: with a pipeline, its layer stack in pipeline layout
    # parallel.dp_sync=params: jitted, parameters -> each device's copy and its fresh
    # optimizer state (jaxpar.local_sgd.Local)
    spread: Any = None
    # jitted: (state, batch) -> the batch's mean loss, forward only (held-out loss)
    evaluate: Any = None
    compiler_options: dict = dataclasses.field(default_factory=dict)  # XLA flags (GPU)

    def export(self, params):
        """Parameters in the model's own layout (the layer stack unstaged)."""
        if self.layout is None:
            return params
        # on the host: offloaded master weights cannot be indexed on the device
        return pipeline.unstaged(self.problem, self.layout, jax.device_get(params))


def zero_policy(cfg: Config, specs, names) -> ZeroPolicy:
    dtype, par = DTYPES[cfg.train.precision], cfg.parallel
    return ZeroPolicy(
        stage=par.zero,
        specs=specs,
        names=names,
        dtype=dtype,
        reduce_dtype=dtype if cfg.train.grad_reduce_dtype is ReduceDtype.COMPUTE else jnp.float32,
        dp_mode=par.dp_collective,
        bucket_bytes=par.bucket_mb * 2**20,
        fetch=par.offload is Offload.OPTIMIZER_PARAMS,
    )


def build(problem: Problem, cfg: Config, mesh: Mesh) -> Engine:
    par = cfg.parallel
    if par.dp_sync is DpSync.PARAMS:
        from jaxpar import local_sgd

        return local_sgd.build(problem, cfg, mesh)
    layout = pipeline.layout_for(problem, mesh.shape[PIPE], par.virtual_stages)
    trained = pipeline.staged(problem, layout) if layout else problem
    specs = plan(
        trained.names,
        jax.tree.map(lambda s: s.shape, trained.shapes),
        zero=par.zero,
        mesh_shape=dict(mesh.shape),
    )
    dtype = DTYPES[cfg.train.precision]
    policy = zero_policy(cfg, specs, trained.names)
    tx, schedule = optim.optimizer(cfg.train, trained.names)
    opt_params = named(mesh, pick(specs, "opt"))  # the optimizer's split of the parameters
    device = state_lib.shardings(mesh, specs, tx, trained.shapes)
    clip = functools.partial(optim.clip, clip_norm=cfg.train.clip_norm)
    verdict = functools.partial(optim.verdict, on_nonfinite=cfg.train.on_nonfinite)
    if par.offload is Offload.NONE:
        shardings, update = device, _device_update(tx, clip, verdict, device, opt_params)
    else:
        shardings = offload.layout(par.offload, device, opt_params)
        update = offload.host_update(tx, dtype, clip, verdict, shardings, opt_params)
    grads_of = _local_grads(trained, cfg, mesh, policy, layout)
    mean_loss = evaluator(trained, cfg, mesh, policy, layout, problem)

    def init(key):
        params = trained.init(key)
        compute = (
            None if par.offload is Offload.NONE else jax.tree.map(lambda p: p.astype(dtype), params)
        )
        zero = jnp.zeros((), jnp.int32)
        return TrainState(zero, params, tx.init(params), zero, compute)

    def train_step(state: TrainState, batch):
        count = loss_elements(problem, batch)  # the loss is a mean over the global batch
        loss, grads = grads_of(state.compute_params, batch, count)
        new, grad_norm, applied, finite = update(state, grads, loss)
        new = new.advanced(applied, finite, cfg.train.on_nonfinite)
        return new, StepMetrics(loss, schedule(state.step), grad_norm, new.skipped)

    return jitted(
        mesh,
        specs=specs,
        tx=tx,
        state_shardings=shardings,
        init=init,
        step=train_step,
        grads=lambda state, batch: grads_of(
            state.compute_params, batch, loss_elements(problem, batch)
        )[1],
        evaluate=lambda state, batch: mean_loss(state.compute_params, batch),
        layout=layout,
        problem=trained,
    )


def jitted(mesh: Mesh, *, init, step, grads, evaluate, state_shardings, **fields) -> Engine:
    """The Engine of these functions, jitted: `init` straight into the state's shardings,
    `step` donating its state, the batch split over the batch axes; on a GPU, compiled
    with jaxpar.xla_flags."""
    batch_sharding = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    options = xla_flags.for_step(context.target(mesh), mesh.size)
    return Engine(
        state_shardings=state_shardings,
        batch_sharding=batch_sharding,
        init=jax.jit(init, out_shardings=state_shardings),
        step=jax.jit(
            step,
            in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())),
            donate_argnums=0,
            compiler_options=options,
        ),
        grads=jax.jit(grads, compiler_options=options),
        evaluate=jax.jit(evaluate, compiler_options=options),
        compiler_options=options,
        **fields,
    )


def _device_update(tx, clip, verdict, shardings: TrainState, opt_params):
    """(state, grads, loss) -> (state with the update applied if `verdict` allows, gradient
    norm, applied, finite): clip, then AdamW on the optimizer's split of the parameters
    (ZeRO>=1: a slice), all-gathered back to their storage."""

    def update(state: TrainState, grads, loss):
        grads, grad_norm = clip(grads)
        applied, finite = verdict(loss, grad_norm, state.skipped)
        params = jax.lax.with_sharding_constraint(state.params, opt_params)
        updates, opt = tx.update(grads, state.opt, params)
        new = jax.lax.with_sharding_constraint(
            optax.apply_updates(params, updates), shardings.params
        )
        # (choosing between the stored parameters, not their optimizer slices: one
        # all-gather of the new ones, as without the choice)
        params = optim.keep_if(applied, new, state.params)
        opt = optim.keep_if(applied, opt, state.opt)
        return state.replace(params=params, opt=opt), grad_norm, applied, finite

    return update


def _context(cfg: Config, mesh: Mesh, policy: ZeroPolicy) -> context.Context:
    return context.Context(
        rules=RULES,
        mesh_shape=dict(mesh.shape),
        keep=policy.keep(cfg.parallel.remat),
        layer=policy.layer,
        whole=policy.whole,
        platform=context.target(mesh),
        unroll=cfg.train.unroll,
    )


def _micro_batches(cfg: Config, mesh: Mesh, batch):
    """This device's rows as [train.grad_accum, rows, ...]."""
    rows = batch_split(cfg.train, cfg.parallel, dict(mesh.shape)).accum
    return jax.tree.map(lambda x: x.reshape((cfg.train.grad_accum, rows) + x.shape[1:]), batch)


def _manual(specs, field: str):
    """The part of each leaf's spec that a shard_map manual over `data` and `pipeline`
    sees (the other axes stay with the compiler)."""
    return jax.tree.map(
        lambda s: only_axes(getattr(s, field), (DATA, PIPE)),
        specs,
        is_leaf=lambda x: isinstance(x, LeafSpecs),
    )


def evaluator(
    problem: Problem, cfg: Config, mesh: Mesh, policy: ZeroPolicy, layout, given: Problem
):
    """(stored compute params, global batch) -> the batch's mean loss: the forward pass
    alone, in the training layout (a pipeline runs its forward ticks only, as GPipe;
    ZeRO-3 gathers each layer as in training), over train.grad_accum micro-batches.
    `problem` as trained (pipeline-staged), `given` as the user gave it."""
    ctx = _context(cfg, mesh, policy)
    if layout is None:

        def loss_sum(params, mb):
            return jnp.sum(problem.loss(policy.compute_view(params), mb).astype(jnp.float32))

    else:
        forward = (
            Schedule.INTERLEAVED
            if cfg.parallel.schedule is Schedule.INTERLEAVED
            else Schedule.GPIPE
        )
        pipe = schedules.Pipe(problem, layout, forward, cfg.parallel.microbatches)
        loss_sum = functools.partial(schedules.forward_loss, pipe, policy.compute_view)

    def local(params, batch):
        with context.active(ctx):
            sums = jax.lax.map(lambda mb: loss_sum(params, mb), _micro_batches(cfg, mesh, batch))
        return jax.lax.psum(jnp.sum(sums), (REPLICA, DATA, PIPE))

    def mean_loss(params, batch):
        total = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(_manual(policy.specs, "storage"), PartitionSpec(BATCH_AXES)),
            out_specs=PartitionSpec(),
            axis_names={REPLICA, DATA, PIPE},
            check_vma=False,
        )(params, batch)
        return total / loss_elements(given, batch)

    return mean_loss


def local_value_and_grad(problem: Problem, cfg: Config, mesh: Mesh, policy: ZeroPolicy, layout):
    """((params, this device's rows, loss elements) -> (its loss sum / loss elements, its
    gradients, accumulated over train.grad_accum micro-batches), the pipeline or None),
    with the model's context active; for a shard_map manual over the batch axes."""
    ctx = _context(cfg, mesh, policy)
    pipe = None
    if layout is None:

        @jax.value_and_grad
        def value_and_grad(params, mb, count):
            losses = problem.loss(policy.compute_view(params), mb)
            return jnp.sum(losses.astype(jnp.float32)) / count

    else:
        pipe = schedules.Pipe(problem, layout, cfg.parallel.schedule, cfg.parallel.microbatches)
        value_and_grad = schedules.value_and_grad(pipe, policy.compute_view)

    def local(params, batch, count):
        with context.active(ctx):
            return accumulate(
                lambda p, mb: value_and_grad(p, mb, count),
                policy.accumulator(params),
                each=policy.each_micro_batch,
            )(params, _micro_batches(cfg, mesh, batch))

    return local, pipe


def _local_grads(problem: Problem, cfg: Config, mesh: Mesh, policy: ZeroPolicy, layout):
    """(compute params, global batch, loss elements) -> (global mean loss, this device's
    reduced gradients), as a shard_map manual over `replica`, `data` and `pipeline`."""
    value_and_grad, pipe = local_value_and_grad(problem, cfg, mesh, policy, layout)

    def local(params, batch, count):
        loss, grads = value_and_grad(params, batch, count)
        if pipe is not None:  # leaves every stage holds got their gradient on one stage
            grads = schedules.reduce_shared(pipe, grads, policy.specs)
        grads = policy.finish(grads)
        return jax.lax.psum(loss, (REPLICA, DATA, PIPE)), grads

    def grads_of(params, batch, count):
        return jax.shard_map(
            functools.partial(local, count=count),
            mesh=mesh,
            in_specs=(_manual(policy.specs, "storage"), PartitionSpec(BATCH_AXES)),
            out_specs=(PartitionSpec(), _manual(policy.specs, "opt")),
            axis_names={REPLICA, DATA, PIPE},
            check_vma=False,
        )(params, batch)

    return grads_of
