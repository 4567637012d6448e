"""The jitted train step with gradient sync, composed from the techniques in their
own modules (parameter averaging, parallel.dp_sync=params, is jaxpar.step.local_sgd's).

    stored state ──► compute view (parallel/zero.py: cast; ZeRO-3 gather; offload fetch)
      └─► value_and_grad per micro-batch (plain, or step/pipelined.py for every pipeline
          schedule, each schedule's order from parallel/schedules.py)
      └─► accumulate (step/accumulate.py; ZeRO-2 reduce-scatters each micro-batch)
      └─► finish the data-parallel reduction (parallel/zero.py via
          parallel/data_parallel.py: xla | ring.py | server.py)
      └─► clip and AdamW (step/optimizer.py) on the device, or on the host (step/offload.py)

The pieces both step builders share (the Engine, the forward/backward on this device's
rows, the held-out loss) are jaxpar.step.engine's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec

from jaxpar.config.sections import Muon, Offload, OnSpike, Optimizer, Parallel, Train
from jaxpar.cost import formulas as cost
from jaxpar.nn import staging
from jaxpar.nn.problem import Problem, trained_count
from jaxpar.parallel.axes import BATCH_AXES, CONTEXT, MANUAL_AXES, PIPE
from jaxpar.parallel.mesh import by_hand
from jaxpar.parallel.sharding import named, pick, plan
from jaxpar.parallel.zero import ZeroPolicy
from jaxpar.step import muon as muon_lib
from jaxpar.step import offload, pipelined, qk_clip, spikes
from jaxpar.step import optimizer as optim
from jaxpar.step import state as state_lib
from jaxpar.step.engine import (
    Engine,
    StepMetrics,
    device_mean,
    evaluator,
    jitted,
    local_value_and_grad,
    manual,
    per_micro_batch,
    zero_policy,
)
from jaxpar.step.state import TrainState


def build(
    problem: Problem, par: Parallel, train: Train, mesh: Mesh, muon: Muon | None = None, donate=True
) -> Engine:
    """The step of `problem` on `mesh` as parallel.*, train.* and (train.optimizer=muon)
    muon.* say, donating its state where `donate`."""
    layout = staging.layout_for(problem, mesh.shape[PIPE], par.virtual_stages, par.schedule)
    trained = staging.staged(problem, layout) if layout else problem
    specs = plan(
        trained.names,
        jax.tree.map(lambda s: s.shape, trained.shapes),
        zero=par.zero,
        mesh_shape=dict(mesh.shape),
    )
    dtype = cost.DTYPES[train.precision]
    policy = zero_policy(train, par, specs, trained.names, trained.frozen)
    trainable = trained.trainable(trained.names)
    placed = None  # Muon's owners: on the device only (the host's update is not sharded)
    if train.optimizer is Optimizer.MUON and par.offload is Offload.NONE:
        own = trained.trainable
        placed = muon_lib.owners(mesh, own(specs), trainable, own(trained.shapes))
    tx, schedule = optim.optimizer(train, trainable, optim.balance_step(problem), muon, placed)
    opt_params = named(mesh, pick(specs, "opt"))  # the optimizer's split of the parameters
    watch = train.on_spike is not OnSpike.OFF
    device = state_lib.shardings(mesh, specs, tx, trained.shapes, trained.trainable, watch)
    clip = functools.partial(
        optim.clip, clip_norm=train.clip_norm, balance=optim.balancing(trainable)
    )
    verdict = functools.partial(optim.verdict, on_nonfinite=train.on_nonfinite)
    if par.offload is Offload.NONE:
        update = _device_update(tx, clip, verdict, device, opt_params, trained)
        shardings = device
    else:
        shardings = offload.layout(par.offload, device, opt_params)
        update = offload.host_update(tx, dtype, clip, verdict, shardings, opt_params, trained)
    tau = muon.qk_clip if muon else 0.0
    clip_rules = [] if tau else None  # QK-clip: each attention's weights, as traced
    grads_of = _local_grads(trained, train, par, mesh, policy, layout, clip_rules)
    mean_loss = evaluator(trained, train, par, mesh, policy, layout, problem)

    def fresh(params):
        compute = None if par.offload is Offload.NONE else offload.compute_copy(params, dtype)
        zero = jnp.zeros((), jnp.int32)
        opt = tx.init(trained.trainable(params))
        window = spikes.empty(train.spike_window) if watch else None
        return TrainState(zero, params, opt, zero, compute, window=window)

    def train_step(state: TrainState, batch):
        # the loss is the global batch's summed loss over its trained elements' count
        count = trained_count(problem, batch)
        (loss, reports), grads = grads_of(state.compute_params, batch, count)
        spike, limit = spikes.judged(loss, state.window, train.spike_sigmas)
        new, grad_norm, applied, finite = update(state, grads, loss, spike)
        if tau:  # QK-clip, on the weights where the update left them
            factors, reports = qk_clip.factors_of(reports, clip_rules, tau, set(trainable))
            if par.offload is Offload.NONE:
                new = new.replace(params=factors.applied(new.params, trained.names))
            else:
                new = offload.host_scaled(shardings, dtype, trained.names)(new, factors)
        new = new.advanced(applied, finite, train.on_nonfinite, loss, spike)
        metrics = (loss, schedule(state.step), grad_norm, new.skipped, count, reports)
        return new, StepMetrics(*metrics, spike=spike, spike_limit=limit)

    return jitted(
        mesh,
        specs=specs,
        tx=tx,
        state_shardings=shardings,
        fresh=fresh,
        step=train_step,
        grads=lambda state, batch: grads_of(
            state.compute_params, batch, trained_count(problem, batch)
        )[1],
        evaluate=lambda state, batch: mean_loss(state.compute_params, batch),
        layout=layout,
        problem=trained,
        donates=donate,
    )


def _device_update(tx, clip, verdict, shardings: TrainState, opt_params, problem: Problem):
    """(state, grads, loss, spike) -> (state with the update applied if `verdict` allows,
    gradient norm, applied, finite): clip, then AdamW on the optimizer's split of the
    trained parameters (ZeRO>=1: a slice), all-gathered back to their storage."""
    trained = problem.trainable

    def update(state: TrainState, grads, loss, spike):
        grads, grad_norm = clip(grads)
        applied, finite = verdict(loss, grad_norm, state.skipped, spike)
        stored = trained(state.params)
        params = jax.lax.with_sharding_constraint(stored, trained(opt_params))
        updates, opt = tx.update(grads, state.opt, params)
        new = jax.lax.with_sharding_constraint(
            optax.apply_updates(params, updates), trained(shardings.params)
        )
        # (choosing between the stored parameters, not their optimizer slices: one
        # all-gather of the new ones, as without the choice)
        params = problem.joined(state.params, optim.keep_if(applied, new, stored))
        opt = optim.keep_if(applied, opt, state.opt)
        return state.replace(params=params, opt=opt), grad_norm, applied, finite

    return update


def _local_grads(
    problem: Problem,
    train: Train,
    par: Parallel,
    mesh: Mesh,
    policy: ZeroPolicy,
    layout,
    clip_rules: list | None = None,
):
    """(compute params, global batch, its trained loss elements) -> ((global mean loss,
    the model's reports), this device's reduced gradients), as a shard_map manual over
    `replica`, `data`, `pipeline` and `context`; `clip_rules`: QK-clip's (engine's
    local_value_and_grad)."""
    value_and_grad, pipe = local_value_and_grad(
        problem, train, par, mesh, policy, layout, clip_rules
    )

    def local(params, batch, count):
        (loss, reports), grads = value_and_grad(params, batch, count)
        if pipe is not None:  # leaves every stage holds got their gradient on one stage
            grads = pipelined.reduce_shared(pipe, grads, policy.specs)
        grads = policy.finish(grads)
        if mesh.shape[CONTEXT] > 1:  # each device's tokens' part, summed once, as data leaves it
            grads = jax.lax.psum(grads, CONTEXT)
        reports = device_mean(per_micro_batch(reports, train))
        return (jax.lax.psum(loss, MANUAL_AXES), reports), grads

    def grads_of(params, batch, count):
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(manual(policy.specs, "storage"), PartitionSpec(BATCH_AXES), PartitionSpec()),
            out_specs=(PartitionSpec(), manual(policy.grad_specs, "opt")),
            axis_names=by_hand(mesh, MANUAL_AXES),
            check_vma=False,
        )(params, batch, count)

    return grads_of
