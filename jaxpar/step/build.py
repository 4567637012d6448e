"""One setup path: prepare(cfg, problem, mesh, batch) -> Run, a compiled step and its report.

What `jaxpar.train`, `jaxpar bench` and the tests all call before running steps.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh

from jaxpar.config import presets, registry
from jaxpar.config.sections import Config, DpSync, Model, Parallel, Train
from jaxpar.cost import blocks, ledger, throughput
from jaxpar.cost import formulas as cost
from jaxpar.cost.report import Pipeline, ReplicaCheck, Report
from jaxpar.data.tokens import SEGMENT_IDS
from jaxpar.nn.problem import Problem, loss_elements
from jaxpar.parallel import layout_checks
from jaxpar.parallel.axes import CONTEXT, PIPE, TENSOR
from jaxpar.parallel.batches import batch_split
from jaxpar.parallel.mesh import describe
from jaxpar.parallel.sharding import optional_unsplit, rules_for, unsplit_leaves
from jaxpar.step import offload, preflight
from jaxpar.step import replica_check as replicas
from jaxpar.step.engine import Engine
from jaxpar.step.gradient_sync import build as build_grad_sync
from jaxpar.step.local_sgd import SYNC_SCOPE
from jaxpar.step.local_sgd import build as build_averaging


@dataclass(frozen=True)
class CompiledStep:
    executable: Any  # (state, batch) -> (state, metrics)
    hlo: str  # its optimized HLO text (what the ledger reads and step.hlo.txt keeps)
    seconds: float  # tracing, lowering and compiling it took
    state_shapes: Any  # TrainState of ShapeDtypeStructs, with their shardings
    batch_shapes: Any  # the global batch's ShapeDtypeStructs
    host_activations: int  # per-device bytes of layer inputs the step sends to the host


@dataclass(frozen=True)
class Run:
    cfg: Config
    mesh: Mesh
    problem: Problem  # as given (the model's own layout)
    engine: Engine
    step: CompiledStep
    report: Report  # of the compiled step; `trained` adds the run's figures
    tokens_per_step: int  # loss elements per global batch
    check: replicas.Check | None = None  # the replica consistency check (if asked for)
    flops_per_step: float = 0.0  # model FLOPs of one step, forward and backward
    peak_flops: float | None = None  # per device (None: not known, a CPU; no MFU)


def build(problem: Problem, cfg: Config, mesh: Mesh) -> Engine:
    """The engine of parallel.dp_sync: gradients synced every step (jaxpar.step.gradient_sync), or
    parameters averaged every sync_every steps (jaxpar.step.local_sgd). (The whole config:
    the last release's jaxpar.run.build takes it so.)"""
    builder = build_averaging if cfg.parallel.dp_sync is DpSync.PARAMS else build_grad_sync
    return builder(problem, cfg.parallel, cfg.train, mesh)


def prepare(cfg: Config, problem: Problem, mesh: Mesh, batch, force: bool = False) -> Run:
    """Check the config against the mesh, build the engine, compile the step for
    `batch`'s shapes (one global batch), and describe it. A step that would not fit in
    memory is refused before and after compiling, unless `force`."""
    mesh_shape = describe(mesh)
    layout_checks.check_train(cfg, mesh_shape)
    engine = build(problem, cfg, mesh)
    preflight.check_state(cfg, engine, mesh_shape, force)
    step = compile_step(engine, batch)

    def need_of(changed: Config) -> int:  # the step's bytes under another config
        rows = changed.train.batch_size
        smaller = jax.tree.map(lambda x: x[:rows], batch)
        return preflight.step_bytes(compile_step(build(problem, changed, mesh), smaller).executable)

    preflight.check_compiled(cfg, step.executable, mesh_shape, force, need_of, step.seconds)
    report = describe_step(cfg, mesh, problem, engine, step, batch)
    per_token, counted = throughput.flops_per_token(problem)
    tokens = loss_elements(problem, batch)
    report = dataclasses.replace(report, model_flops_per_token=per_token, flops_counted=counted)
    every = cfg.train.check_replicas_every
    check = replicas.compiled(mesh, step.state_shapes) if every else None
    if check:
        per_step = check.wire_bytes / every
        wire = report.comm.wire_bytes_per_device
        report = dataclasses.replace(
            report,
            replica_check=ReplicaCheck(
                every=every,
                leaves=sum(bool(axes) for axes in check.copied_over),
                wire_bytes_per_check=check.wire_bytes,
                collectives_per_check=check.collectives,
                share_of_step_comm=per_step / wire if wire else None,
            ),
        )
    return Run(
        cfg=cfg,
        mesh=mesh,
        problem=problem,
        engine=engine,
        step=step,
        report=report,
        tokens_per_step=tokens,
        check=check,
        flops_per_step=per_token * tokens,
        peak_flops=throughput.peak_flops(jax.devices()[0].device_kind),
    )


def step_inputs(engine: Engine, batch):
    """Shapes and shardings of the step's (state, batch), for tracing it without data."""
    state_shapes = jax.eval_shape(engine.init, jax.random.key(0))
    state_in = jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
        state_shapes,
        engine.state_shardings,
    )
    batch_in = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=engine.batch_sharding), batch
    )
    return state_in, batch_in


def compile_step(engine: Engine, batch) -> CompiledStep:
    """Trace, lower and compile the step for the state and batch shapes."""
    state_in, batch_in = step_inputs(engine, batch)
    start = time.perf_counter()
    traced = engine.step.trace(state_in, batch_in)
    compiled = traced.lower().compile()
    return CompiledStep(
        compiled,
        compiled.as_text(),
        time.perf_counter() - start,
        state_in,
        batch_in,
        offload.offloaded_activation_bytes(traced.jaxpr),
    )


def read_ledger(par: Parallel, hlo: str, mesh_shape: dict) -> ledger.Ledger:
    """The compiled step's collectives per step (parameter averaging's once per sync)."""
    averaging = par.dp_sync is DpSync.PARAMS
    return ledger.read(hlo, mesh_shape, {SYNC_SCOPE: 1 / par.sync_every} if averaging else None)


def describe_step(
    cfg: Config, mesh: Mesh, problem: Problem, engine: Engine, step: CompiledStep, batch
) -> Report:
    mesh_shape = describe(mesh)
    par, trained = cfg.parallel, engine.problem
    shapes = jax.tree.map(lambda s: s.shape, trained.shapes)
    averaging = par.dp_sync is DpSync.PARAMS
    led = read_ledger(par, step.hlo, mesh_shape)
    compute_bytes = cost.dtype_bytes(cfg.train.precision)
    split = batch_split(cfg.train, par, mesh_shape)
    spec = registry.get(cfg.model.name)
    documents = SEGMENT_IDS in batch
    minimum = _minimum(cfg.model, par, cfg.train, mesh_shape, problem, engine, documents)
    formula = cost.problem_state(cfg.parallel, cfg.train, engine.specs, trained, mesh_shape)
    device, host = ledger.memory(
        step.executable,
        step.state_shapes,
        cost.grad_bytes(
            trained.trainable(engine.specs), trained.trainable(trained.shapes), mesh_shape
        ),
        step.host_activations,
        trained.frozen,
        trained.reference,
    )
    unsplit = unsplit_leaves(engine.specs, shapes, mesh_shape) if par.zero else []
    return Report(
        config=presets.to_dict(cfg),
        mesh=mesh_shape,
        devices=int(mesh.size),
        strategy=strategy_name(cfg.parallel, cfg.train, mesh_shape),
        compile_s=round(step.seconds, 3),
        xla_flags=engine.compiler_options,
        zero_unsplit_leaves=[{"path": p, "shape": list(s), "why": why} for p, s, _, why in unsplit],
        tensor_replicated=optional_unsplit(
            trained.names, shapes, rules_for(par.sequence_parallel), mesh_shape
        ),
        model_notes=spec.notes(cfg.model, cfg.train.seq_len),
        pipeline=_pipeline(
            cfg.parallel,
            cfg.train.grad_accum,
            problem,
            engine,
            step.hlo,
            led,
            batch,
            split.micro,
            compute_bytes,
        ),
        memory_per_device=device,
        host_memory_per_device=host,
        state_bytes=ledger.state_bytes(step.executable, step.state_shapes, formula),
        collectives=ledger.kinds(led),
        collective_counts=led.counts(),
        comm=ledger.comm(
            led,
            minimum,
            [d.process_index for d in mesh.devices.flat],
            ledger.assumes(
                par.zero,
                cfg.train.precision,
                cost.reduce_precision(cfg.train),
                par.sync_every if averaging else None,
            ),
        ),
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
        engine.specs,
        engine.problem,
        mesh_shape,
        tensor_elements,
        attention,
        documents,
        experts,
    )


def _pipeline(
    par: Parallel, accum: int, problem, engine, hlo, led, batch, rows: int, compute_bytes: int
) -> Pipeline:
    layout, parts = engine.layout, problem.parts
    if layout is None:
        layers = problem.shapes[parts.stack_keys[0]].shape[0] if parts else 0
        return Pipeline(stages=[list(range(layers))], schedule=None, bubble=0.0, bubble_formula=0.0)
    # one micro-batch's activation at a chunk boundary: the residual stream at the compute
    # precision, what rides beside it (a mixture's routing sums) as it is
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows,) + x.shape[1:], x.dtype), batch)
    residual, *beside = jax.tree.leaves(jax.eval_shape(parts.pre, problem.shapes, micro))
    handed = math.prod(residual.shape) * compute_bytes
    handed += sum(math.prod(x.shape) * x.dtype.itemsize for x in beside)
    return ledger.pipeline_report(
        layout,
        par.schedule,
        par.microbatches,
        accum,
        hlo,
        led,
        handed,
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
