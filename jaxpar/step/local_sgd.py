"""Parameter averaging (parallel.dp_sync=params): local SGD, and DiLoCo's outer optimizer.

Each device of `data` holds its own copy of the parameters and its own AdamW state and
takes `sync_every` optimizer steps on its own rows of each batch, communicating
nothing but the loss. Then the copies are averaged over `data` (one all-reduce of the
fp32 parameters), and an outer optimizer, Nesterov SGD with `outer_lr` and
`outer_momentum`, applies the averaged change to the global parameters, which every
copy restarts from: DiLoCo (Douillard et al., 2023). outer_lr=1 with no momentum is
plain averaging. The last step of a run always averages, so what it exports is whole.

The state: `params` are the global parameters (what checkpoints, export and the
consistency check read), `opt` the outer optimizer's state, and `local` the copies:
every leaf with a leading dim of one entry per device, split over `data`. The inner
AdamW state stays local, never averaged, as in DiLoCo: averaging its two moments would
triple the bytes of every average, and each copy's moments describe its own path.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.config.sections import Muon, OnSpike, Parallel, Train
from jaxpar.nn.problem import Problem, trained_count
from jaxpar.parallel.axes import BATCH_AXES, DATA, EXPERT, PIPE, REPLICA
from jaxpar.parallel.mesh import by_hand
from jaxpar.parallel.sharding import only_axes, pick, plan
from jaxpar.step import optimizer as optim
from jaxpar.step import qk_clip, spikes
from jaxpar.step import state as state_lib
from jaxpar.step.engine import (
    StepMetrics,
    at_least_one,
    evaluator,
    jitted,
    local_value_and_grad,
    per_micro_batch,
    zero_policy,
)
from jaxpar.step.state import TrainState

SYNC_SCOPE = "dp_sync"  # named scope of the average: the ledger counts it once per sync_every


@struct.dataclass
class Local:
    params: Any  # each leaf [data, ...]: one copy per device
    opt: Any  # the inner AdamW state of those copies (moments [data, ...], one count)


def outer_optimizer(par: Parallel) -> optax.GradientTransformation:
    """Nesterov SGD on the averaged change (DiLoCo's outer step); plain SGD without momentum."""
    momentum = par.outer_momentum or None
    return optax.sgd(par.outer_lr, momentum=momentum, nesterov=momentum is not None)


def _stacked(spec: PartitionSpec) -> PartitionSpec:
    return PartitionSpec(DATA, *spec)


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _manual(tree):
    """The specs as shard_map's in- and out-specs over its manual axes (data, pipeline)."""
    return jax.tree.map(lambda s: only_axes(s, (DATA, PIPE)), tree, is_leaf=_is_spec)


def _copies(problem: Problem, mesh: Mesh, compute, inner, global_state):
    """(the specs of each device's copy and its inner optimizer state, stacked over data;
    the whole state's shardings, the copies' beside the global state's)."""
    n = mesh.shape[DATA]
    copies = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype), problem.shapes)
    copy_specs = jax.tree.map(_stacked, compute, is_leaf=_is_spec)
    inner_specs = state_lib.map_params(
        inner,
        lambda _, spec: spec,
        jax.eval_shape(inner.init, copies),
        copy_specs,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=_is_spec,
    )
    named = functools.partial(jax.tree.map, lambda s: NamedSharding(mesh, s), is_leaf=_is_spec)
    local = Local(params=named(copy_specs), opt=named(inner_specs))
    return Local(params=copy_specs, opt=inner_specs), global_state.replace(local=local)


def _device_step(
    problem: Problem, train: Train, every: int, inner, outer, value_and_grad, clip, qk=None
):
    """One device's step, inside shard_map: its local step on its rows, then (every
    `every` steps, and at the last) the copies averaged into the outer optimizer. `qk`:
    QK-clip's (tau, rules), each copy's heads clipped by its own rows' logits as a lone
    trainer's would be."""

    def device_step(local: Local, params, outer_opt, batch, step, skipped, window, total):
        """One device's local step on its rows, then (every `every` steps) the average."""
        mine = jax.tree.map(lambda x: x[0], local.params)
        # each copy's loss is over its own rows' trained elements
        count = trained_count(problem, batch)
        (loss, reports), grads = value_and_grad(mine, batch, count)
        reports, factors = per_micro_batch(reports, train), None
        if qk is not None:
            rules, tau = qk
            trained = set(problem.trainable(problem.names))
            factors, reports = qk_clip.factors_of(reports, rules, tau, trained)
        reports = {k: (jax.lax.pmax if k == qk_clip.MAX_LOGIT else jax.lax.pmean)(v, DATA)
                   for k, v in reports.items()}  # fmt: skip
        grads, norm = clip(grads)
        # the global batch's loss: the copies' sums over all their trained elements
        loss = jax.lax.psum(loss * count, DATA) / at_least_one(jax.lax.psum(count, DATA))
        norm_max = jax.lax.pmax(norm, DATA)
        spike, limit = spikes.judged(loss, window, train.spike_sigmas)
        applied, finite = optim.verdict(loss, norm_max, skipped, spike, train.on_nonfinite)
        opt = state_lib.map_params(inner, lambda x: x[0], local.opt)
        updates, new_opt = inner.update(grads, opt, mine)
        mine = optim.keep_if(applied, optax.apply_updates(mine, updates), mine)
        if factors is not None:
            mine = factors.applied(mine, problem.names)
        opt = optim.keep_if(applied, new_opt, opt)
        opt = state_lib.map_params(inner, lambda x: x[None], opt)
        sync = ((step + 1) % every == 0) | (step + 1 == total)

        def average(mine, params, outer_opt):
            with jax.named_scope(SYNC_SCOPE):
                mean = jax.lax.pmean(mine, DATA)
            change = jax.tree.map(jnp.subtract, params, mean)  # the outer "gradient"
            updates, outer_opt = outer.update(change, outer_opt, params)
            params = optax.apply_updates(params, updates)
            return params, params, outer_opt

        mine, params, outer_opt = jax.lax.cond(sync, average, lambda *a: a, mine, params, outer_opt)
        local = Local(params=jax.tree.map(lambda x: x[None], mine), opt=opt)
        norm = jax.lax.pmean(norm, DATA)
        return local, params, outer_opt, loss, norm, applied, finite, reports, spike, limit

    return device_step


def _mean_grads(problem: Problem, mesh: Mesh, local_specs, compute, value_and_grad):
    """(state, batch) -> the copies' gradients on their rows, averaged (diagnostics)."""

    def mean_grads(state: TrainState, batch):
        def one(local, batch):
            mine = jax.tree.map(lambda x: x[0], local.params)
            count = trained_count(problem, batch)
            return jax.lax.pmean(value_and_grad(mine, batch, count)[1], DATA)

        return jax.shard_map(
            one,
            mesh=mesh,
            in_specs=(_manual(local_specs), PartitionSpec(BATCH_AXES)),
            out_specs=_manual(compute),
            axis_names=by_hand(mesh, (REPLICA, DATA, EXPERT, PIPE)),
            check_vma=False,
        )(state.local, batch)

    return mean_grads


def build(
    problem: Problem, par: Parallel, train: Train, mesh: Mesh, muon: Muon | None = None, donate=True
):
    """The engine of parallel.dp_sync=params: each device's copy trained on its rows by the
    inner optimizer (Muon's keys `muon`), averaged every parallel.sync_every steps into the
    outer one; its step donating its state where `donate`."""
    n = mesh.shape[DATA]
    every = par.sync_every
    shapes = jax.tree.map(lambda s: s.shape, problem.shapes)
    specs = plan(problem.names, shapes, zero=0, mesh_shape=dict(mesh.shape))
    policy = zero_policy(train, par, specs, problem.names)
    inner, schedule = optim.optimizer(train, problem.names, optim.balance_step(problem), muon)
    outer = outer_optimizer(par)
    compute = pick(specs, "compute")
    watch = train.on_spike is not OnSpike.OFF
    global_state = state_lib.shardings(mesh, specs, outer, problem.shapes, window=watch)
    local_specs, shardings = _copies(problem, mesh, compute, inner, global_state)
    tau = muon.qk_clip if muon else 0.0
    rules = [] if tau else None  # QK-clip: each attention's weights, as traced
    value_and_grad, _ = local_value_and_grad(problem, train, par, mesh, policy, None, rules)
    mean_loss = evaluator(problem, train, par, mesh, policy, None, problem)  # global params
    clip = functools.partial(
        optim.clip, clip_norm=train.clip_norm, balance=optim.balancing(problem.names)
    )

    def spread(params) -> Local:
        stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (n, *p.shape)), params)
        return Local(params=stacked, opt=inner.init(stacked))

    def fresh(params):
        zero = jnp.zeros((), jnp.int32)
        window = spikes.empty(train.spike_window) if watch else None
        return TrainState(zero, params, outer.init(params), zero, None, spread(params), window)

    qk = (rules, tau) if tau else None
    device_step = _device_step(problem, train, every, inner, outer, value_and_grad, clip, qk)

    def train_step(state: TrainState, batch):
        specs_in = (
            _manual(local_specs),
            _manual(compute),
            _manual(jax.tree.map(lambda s: s.spec, global_state.opt)),
            PartitionSpec(BATCH_AXES),
            PartitionSpec(),
            PartitionSpec(),
            PartitionSpec(),
        )
        out = jax.shard_map(
            functools.partial(device_step, total=train.steps),
            mesh=mesh,
            in_specs=specs_in,
            out_specs=(specs_in[0], specs_in[1], specs_in[2], *(PartitionSpec(),) * 7),
            axis_names=by_hand(mesh, (REPLICA, DATA, EXPERT, PIPE)),
            check_vma=False,
        )(state.local, state.params, state.opt, batch, state.step, state.skipped, state.window)
        local, params, outer_opt, loss, norm, applied, finite, reports, spike, limit = out
        new = state.replace(params=params, opt=outer_opt, local=local)
        new = new.advanced(applied, finite, train.on_nonfinite, loss, spike)
        count = trained_count(problem, batch)
        metrics = (loss, schedule(state.step), norm, new.skipped, count, reports)
        return new, StepMetrics(*metrics, spike=spike, spike_limit=limit)

    mean_grads = _mean_grads(problem, mesh, local_specs, compute, value_and_grad)

    return jitted(
        mesh,
        specs=specs,
        tx=outer,
        state_shardings=shardings,
        fresh=fresh,
        step=train_step,
        grads=mean_grads,
        evaluate=lambda state, batch: mean_loss(state.params, batch),
        layout=None,
        problem=problem,
        spread=jax.jit(spread, out_shardings=shardings.local),
        donates=donate,
    )
