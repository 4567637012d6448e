"""One setup path: prepare(cfg, problem, mesh, batch) -> Run, a compiled step and its report.

What `jaxpar.train`, `jaxpar bench` and the tests all call before running steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.sharding import Mesh

from jaxpar.compiled.describe import describe_step
from jaxpar.config.sections import Config, given
from jaxpar.cost import throughput
from jaxpar.cost.report import Report
from jaxpar.nn.problem import Problem, loss_elements
from jaxpar.parallel import layout_checks
from jaxpar.parallel.mesh import describe
from jaxpar.step import preflight
from jaxpar.step import replica_check as replicas
from jaxpar.step.build import CompiledStep, build, compile_step
from jaxpar.step.engine import Engine


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


def prepare(cfg: Config, problem: Problem, mesh: Mesh, batch, force: bool = False) -> Run:
    """Check the config against the mesh, build the engine, compile the step for
    `batch`'s shapes (one global batch), and describe it. A step that would not fit in
    memory is refused before and after compiling, unless `force`."""
    mesh_shape = describe(mesh)
    given(layout_checks.check, cfg, mesh_shape)
    engine = build(problem, cfg, mesh)
    preflight.check_state(cfg, engine, mesh_shape, force)
    step = compile_step(engine, batch)

    def need_of(changed: Config) -> int:  # the step's bytes under another config
        rows = changed.train.batch_size
        smaller = jax.tree.map(lambda x: x[:rows], batch)
        return preflight.step_bytes(compile_step(build(problem, changed, mesh), smaller).executable)

    preflight.check_compiled(cfg, step.executable, mesh_shape, force, need_of, step.seconds)
    every = cfg.train.check_replicas_every
    check = replicas.compiled(mesh, step.state_shapes) if every else None
    report = describe_step(cfg, mesh, problem, engine, step, batch, check)
    tokens = loss_elements(problem, batch)
    return Run(
        cfg=cfg,
        mesh=mesh,
        problem=problem,
        engine=engine,
        step=step,
        report=report,
        tokens_per_step=tokens,
        check=check,
        flops_per_step=report.model_flops_per_token * tokens,
        peak_flops=throughput.peak_flops(jax.devices()[0].device_kind),
    )
