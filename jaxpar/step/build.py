"""The step built and compiled: build(problem, cfg, mesh) -> Engine, and compile_step(engine,
batch) -> CompiledStep, the executable and its optimized HLO. What it costs is described
above this room (jaxpar.compiled), from the compiled program and the engine's leaves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh

from jaxpar.config.sections import Config, DpSync
from jaxpar.nn.problem import Problem
from jaxpar.step import offload
from jaxpar.step.engine import Engine
from jaxpar.step.gradient_sync import build as build_grad_sync
from jaxpar.step.local_sgd import build as build_averaging


@dataclass(frozen=True)
class CompiledStep:
    executable: Any  # (state, batch) -> (state, metrics)
    hlo: str  # its optimized HLO text (what the ledger reads and step.hlo.txt keeps)
    seconds: float  # tracing, lowering and compiling it took
    state_shapes: Any  # TrainState of ShapeDtypeStructs, with their shardings
    batch_shapes: Any  # the global batch's ShapeDtypeStructs
    host_activations: int  # per-device bytes of layer inputs the step sends to the host


def build(problem: Problem, cfg: Config, mesh: Mesh) -> Engine:
    """The engine of parallel.dp_sync: gradients synced every step (jaxpar.step.gradient_sync), or
    parameters averaged every sync_every steps (jaxpar.step.local_sgd). (The whole config:
    the last release's jaxpar.run.build takes it so.)"""
    builder = build_averaging if cfg.parallel.dp_sync is DpSync.PARAMS else build_grad_sync
    # saved every step: the save reads the state as it is, so the step must not reuse it
    donates = cfg.checkpoint.every != 1
    return builder(problem, cfg.parallel, cfg.train, mesh, cfg.muon, donates)


def step_inputs(engine: Engine, batch):
    """Shapes and shardings of the step's (state, batch), for tracing it without data."""
    state_shapes = engine.init.eval_shape(jax.random.key(0))
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
