"""What a compiled step costs, described: describe_step(...) -> Report.

Built from the compiled program (its HLO, read by jaxpar.cost.ledger; its memory
analysis) and the engine's leaves, each counted once (jaxpar.parallel.leaf_layout), against
the textbook minimum of jaxpar.cost.formulas. Compiling it is jaxpar.step's; this room
only reads what compiling made.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh

from jaxpar.config import presets, registry
from jaxpar.config.sections import Config, DpSync, Model, Muon, Optimizer, Parallel, Train
from jaxpar.cost import blocks, ledger, newton_schulz, throughput
from jaxpar.cost import formulas as cost
from jaxpar.cost.report import Pipeline, ReplicaCheck, Report
from jaxpar.data.tokens import SEGMENT_IDS
from jaxpar.nn.problem import Problem, loss_elements
from jaxpar.parallel.axes import CONTEXT, PIPE, TENSOR
from jaxpar.parallel.batches import batch_split
from jaxpar.parallel.matrices import groups
from jaxpar.parallel.mesh import describe
from jaxpar.parallel.sharding import optional_unsplit, rules_for, unsplit_leaves
from jaxpar.step import replica_check as replicas
from jaxpar.step.build import CompiledStep
from jaxpar.step.engine import Engine
from jaxpar.step.local_sgd import SYNC_SCOPE


def describe_step(
    cfg: Config,
    mesh: Mesh,
    problem: Problem,
    engine: Engine,
    step: CompiledStep,
    batch,
    check: replicas.Check | None = None,
) -> Report:
    """The report of `step`, compiled by `engine` for `problem` (in its own layout) on
    `mesh`: memory against the ZeRO formula, collectives against the minimum, the
    pipeline's figures, the model's FLOPs; the replica check's cost where there is one."""
    mesh_shape = describe(mesh)
    par, train, trained = cfg.parallel, cfg.train, engine.problem
    shapes = jax.tree.map(lambda s: s.shape, trained.shapes)
    led = read_ledger(par, step.hlo, mesh_shape)
    split = batch_split(train, par, mesh_shape)
    leaves = engine.leaves
    documents = SEGMENT_IDS in batch
    minimum = _minimum(cfg.model, par, train, mesh_shape, problem, engine, documents)
    formula = cost.problem_state(par, train, leaves, trained, mesh_shape)
    device, host = ledger.memory(
        step.executable,
        step.state_shapes,
        cost.grad_bytes(trained.trainable(leaves)),
        step.host_activations,
        trained.frozen,
        trained.reference,
    )
    unsplit = unsplit_leaves(engine.specs, shapes, mesh_shape) if par.zero else []
    per_token, counted = throughput.flops_per_token(problem)
    model_flops = per_token * loss_elements(problem, batch) if per_token else None
    processes = [d.process_index for d in mesh.devices.flat]
    averaging = par.sync_every if par.dp_sync is DpSync.PARAMS else None
    assumed = ledger.assumes(par.zero, train.precision, cost.reduce_precision(train), averaging)
    comm = ledger.comm(led, minimum, processes, assumed)
    return Report(
        config=presets.to_dict(cfg),
        mesh=mesh_shape,
        devices=int(mesh.size),
        strategy=strategy_name(par, train, mesh_shape),
        compile_s=round(step.seconds, 3),
        xla_flags=engine.compiler_options,
        zero_unsplit_leaves=[{"path": p, "shape": list(s), "why": why} for p, s, _, why in unsplit],
        tensor_replicated=optional_unsplit(
            trained.names, shapes, rules_for(par.sequence_parallel), mesh_shape
        ),
        model_notes=registry.get(cfg.model.name).notes(cfg.model, train.seq_len),
        pipeline=_pipeline(par, train, problem, engine, step.hlo, led, batch, split.micro),
        memory_per_device=device,
        host_memory_per_device=host,
        state_bytes=ledger.state_bytes(step.executable, step.state_shapes, formula),
        collectives=ledger.kinds(led),
        collective_counts=led.counts(),
        comm=comm,
        replica_check=_replica_check(check, train.check_replicas_every, comm.wire_bytes_per_device),
        model_flops_per_token=per_token,
        flops_counted=counted,
        optimizer_groups=(
            groups(trained.trainable(trained.names)) if train.optimizer is Optimizer.MUON else {}
        ),
        newton_schulz=_newton_schulz(cfg.train, cfg.muon, trained, leaves, mesh_shape, model_flops),
    )


def _newton_schulz(
    train: Train, muon: Muon, trained: Problem, leaves, mesh_shape: dict, model_flops
) -> dict:
    """Muon's Newton-Schulz FLOPs a step, temporaries and least bytes moved (its path's
    minimum) per device, and the model's FLOPs a step (`model_flops`, all devices') per device
    beside them; {} without Muon."""
    if train.optimizer is not Optimizer.MUON:
        return {}
    trainable = trained.trainable(leaves), trained.trainable(trained.names)
    ns = newton_schulz.cost(*trainable, muon.ns_steps)
    model = model_flops / math.prod(mesh_shape.values()) if model_flops else None
    return {
        "flops": ns.flops,
        "temp_bytes": ns.temp_bytes,
        "wire_bytes": ns.wire_bytes,
        "model_flops": model,
    }


def read_ledger(par: Parallel, hlo: str, mesh_shape: dict) -> ledger.Ledger:
    """The compiled step's collectives per step (parameter averaging's once per sync)."""
    averaging = par.dp_sync is DpSync.PARAMS
    return ledger.read(hlo, mesh_shape, {SYNC_SCOPE: 1 / par.sync_every} if averaging else None)


def _replica_check(check: replicas.Check | None, every: int, wire: float) -> ReplicaCheck | None:
    """What checking the replicas every `every` steps costs, against the step's `wire`."""
    if check is None:
        return None
    return ReplicaCheck(
        every=every,
        leaves=sum(bool(axes) for axes in check.copied_over),
        wire_bytes_per_check=check.wire_bytes,
        collectives_per_check=check.collectives,
        share_of_step_comm=check.wire_bytes / every / wire if wire else None,
    )


def _minimum(
    model: Model, par: Parallel, train: Train, mesh_shape: dict, problem: Problem, engine: Engine,
    documents: bool,
):  # fmt: skip
    """The step's textbook minimum bytes per device over each axis (jaxpar.cost.formulas),
    from the model's own dims: its attention, its experts, its Megatron all-reduces."""
    split = batch_split(train, par, mesh_shape)
    # With a pipeline each device runs some layers, and the head or embedding on some
    # stages only: the Megatron count per device has no single value.
    t = mesh_shape[TENSOR]
    tensor_elements = (
        blocks.tensor_elements(problem, split.accum, t) if mesh_shape[PIPE] == 1 else None
    )
    spec = registry.get(model.name)
    attention = spec.attention_dims(model) if spec.attention_dims else None
    experts = spec.expert_dims(model, train.seq_len) if spec.expert_dims else None
    return cost.minimum(
        par,
        train,
        engine.leaves,
        engine.problem,
        mesh_shape,
        tensor_elements,
        attention,
        documents,
        experts,
    )


def _pipeline(
    par: Parallel, train: Train, problem: Problem, engine: Engine, hlo, led, batch, rows: int
) -> Pipeline:
    layout, parts = engine.layout, problem.parts
    if layout is None:
        layers = problem.shapes[parts.stack_keys[0]].shape[0] if parts else 0
        return Pipeline(stages=[list(range(layers))], schedule=None, bubble=0.0, bubble_formula=0.0)
    # one micro-batch's activation at a chunk boundary: the residual stream at the compute
    # precision, what rides beside it (a mixture's routing sums) as it is
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows,) + x.shape[1:], x.dtype), batch)
    residual, *beside = jax.tree.leaves(jax.eval_shape(parts.pre, problem.shapes, micro))
    handed = math.prod(residual.shape) * cost.dtype_bytes(train.precision)
    handed += sum(math.prod(x.shape) * x.dtype.itemsize for x in beside)
    return ledger.pipeline_report(
        layout, par.schedule, par.microbatches, train.grad_accum, hlo, led, handed
    )


def strategy_name(par: Parallel, train: Train, mesh_shape: dict) -> str:
    axes = " x ".join(f"{axis}={n}" for axis, n in mesh_shape.items() if n > 1)
    extras = [f"ZeRO-{par.zero}", train.precision]
    if mesh_shape[PIPE] > 1:
        extras.insert(
            0,
            f"{par.schedule} m={par.microbatches}"
            + (f" v={par.virtual_stages}" if par.virtual_stages > 1 else ""),
        )
    if mesh_shape.get(CONTEXT, 1) > 1:
        extras.insert(
            0, f"context {par.context_strategy}" + (" balanced" if par.context_balance else "")
        )
    if par.sequence_parallel:
        extras.insert(0, "sequence parallel")
    if train.grad_accum > 1:
        extras.append(f"grad_accum={train.grad_accum}")
    if par.dp_sync is DpSync.PARAMS:
        outer = (
            "averaged"
            if (par.outer_lr, par.outer_momentum) == (1, 0)
            else (f"outer Nesterov lr={par.outer_lr:g} momentum={par.outer_momentum:g}")
        )
        extras.insert(0, f"params synced every {par.sync_every} steps, {outer}")
    return ", ".join([axes or "single device", *extras])
