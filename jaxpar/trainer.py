"""The loop: data -> step -> metrics -> run directory.

Step n is dispatched before step n-1's metrics are read to the host, so the device
never waits on Python.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxpar import config as config_lib
from jaxpar import data, ledger, metrics, offload, pipeline
from jaxpar.config import Config
from jaxpar.mesh import build_mesh, describe
from jaxpar.problem import Problem, from_nnx
from jaxpar.sharding import unsplit_leaves
from jaxpar.step import DTYPES, Engine, build


@dataclass
class Result:
    losses: list[float]  # every step's loss
    params: dict  # final parameters (global arrays)
    summary: dict
    rows: list[dict]  # metrics rows as logged


@dataclass(frozen=True)
class CompiledStep:
    executable: Any  # (state, batch) -> (state, metrics)
    hlo: str  # its optimized HLO text (what the ledger reads and step.hlo.txt keeps)
    seconds: float  # tracing, lowering and compiling it took
    state_shapes: Any  # ShapeDtypeStructs of the state, with their shardings
    host_activations: int  # per-device bytes of layer inputs the step sends to the host


def step_inputs(engine: Engine, batch_example: dict):
    """Shapes and shardings of the step's (state, batch), for tracing it without data."""
    state_shapes = jax.eval_shape(engine.init, jax.random.key(0))
    state_in = jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
        state_shapes,
        engine.state_shardings,
    )
    batch_in = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=engine.batch_sharding),
        batch_example,
    )
    return state_in, batch_in


def compile_step(engine: Engine, batch_example: dict) -> CompiledStep:
    """Trace, lower and compile the step for the state and batch shapes."""
    state_in, batch_in = step_inputs(engine, batch_example)
    start = time.perf_counter()
    traced = engine.step.trace(state_in, batch_in)
    compiled = traced.lower().compile()
    return CompiledStep(
        compiled,
        compiled.as_text(),
        time.perf_counter() - start,
        state_in,
        offload.offloaded_activation_bytes(traced.jaxpr),
    )


def tokens_per_step(problem: Problem, batch: dict) -> int:
    """Loss elements in one global batch: tokens for a language model, examples for a
    classifier (the unit of tokens_per_s)."""
    return math.prod(jax.eval_shape(problem.loss, problem.shapes, batch).shape)


def describe_run(
    cfg: Config,
    mesh,
    engine: Engine,
    step: CompiledStep,
    tensor_elements: int | None,
    batch: dict,
) -> dict:
    mesh_shape = describe(mesh)
    problem = engine.problem
    hlo = step.hlo
    led = ledger.read(hlo, mesh_shape)
    summary = {
        "config": config_lib.to_dict(cfg),
        "mesh": mesh_shape,
        "devices": int(mesh.size),
        "strategy": strategy_name(cfg, mesh_shape),
        "compile_s": round(step.seconds, 3),
        "zero_unsplit_leaves": [
            {"path": p, "shape": list(s)}
            for p, s, _ in unsplit_leaves(
                engine.specs, jax.tree.map(lambda x: x.shape, problem.shapes)
            )
        ]
        if cfg.parallel.zero and mesh_shape["data"] > 1
        else [],
        "pipeline": pipeline_summary(cfg, engine, hlo, led, mesh_shape, batch),
    }
    summary.update(
        ledger.report(
            step.executable,
            led,
            specs=engine.specs,
            shapes=problem.shapes,
            state_shapes=step.state_shapes,
            host_activations=step.host_activations,
            mesh_shape=mesh_shape,
            zero=cfg.parallel.zero,
            compute_bytes=jnp.dtype(DTYPES[cfg.train.precision]).itemsize,
            accum=cfg.train.grad_accum,
            tensor_elements=tensor_elements,
        )
    )
    return summary


def pipeline_summary(
    cfg: Config, engine: Engine, hlo: str, led: ledger.Ledger, mesh_shape: dict, batch
) -> dict:
    """Stage assignment, schedule, bubble (from the compiled tick loop) and hand-over bytes."""
    layout, parts = engine.layout, engine.problem.parts
    if layout is None:
        layers = engine.problem.shapes[parts.stack_keys[0]].shape[0] if parts else 0
        return {
            "stages": [list(range(layers))],
            "schedule": None,
            "bubble": 0.0,
            "bubble_formula": 0.0,
        }
    p, m, v = layout.stages, cfg.parallel.microbatches, layout.virtual
    schedule = cfg.parallel.schedule
    loop = max(ledger.loop_trip_counts(hlo, "pipeline_ticks"), default=0)
    rows = jax.tree.leaves(batch)[0].shape[0] // (mesh_shape["data"] * cfg.train.grad_accum * m)
    mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows,) + x.shape[1:], x.dtype), batch)
    h = jax.eval_shape(lambda prm, b: parts.pre(prm, b, None), engine.problem.shapes, mb)
    h_bytes = math.prod(h.shape) * jnp.dtype(DTYPES[cfg.train.precision]).itemsize
    # Each hand-over between consecutive chunks carries one activation each way per
    # micro-batch; p * v - 1 hand-overs, shared by p devices.
    minimum = 2 * m * cfg.train.grad_accum * h_bytes * (p * v - 1) / p
    permutes = led.wire_bytes({"pipeline"}, kinds={"collective-permute"}) * pipeline.handover_share(
        schedule, p, m
    )
    return {
        "stages": layout.device_layers(),
        "chunks": [list(c) for c in layout.chunks],
        "schedule": schedule,
        "microbatches": m,
        "virtual_stages": v,
        "ticks": loop,
        "bubble": pipeline.bubble(schedule, p, m, v, loop) if loop else None,
        "bubble_formula": pipeline.bubble_formula(p, m, v),
        "permute_bytes_per_device": permutes,
        "permute_minimum_per_device": minimum,
        "permute_ratio": permutes / minimum,
    }


def strategy_name(cfg: Config, mesh_shape: dict) -> str:
    axes = " x ".join(f"{axis}={n}" for axis, n in mesh_shape.items() if n > 1)
    extras = [f"ZeRO-{cfg.parallel.zero}", cfg.train.precision]
    if mesh_shape["pipeline"] > 1:
        p = cfg.parallel
        extras.insert(
            0,
            f"{p.schedule} m={p.microbatches}"
            + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else ""),
        )
    if cfg.train.grad_accum > 1:
        extras.append(f"grad_accum={cfg.train.grad_accum}")
    return ", ".join([axes or "single device", *extras])


def startup_text(summary: dict, params: int) -> str:
    mem = summary["memory_per_device"]
    comm = summary["comm"]
    lines = [
        f"jaxpar  {summary['strategy']}",
        f"  mesh      {' x '.join(f'{a}={n}' for a, n in summary['mesh'].items())} "
        f"({summary['devices']} devices: {jax.devices()[0].platform})",
        f"  model     {params / 1e6:.2f} M parameters",
        "  memory    per device: "
        + ", ".join(f"{k} {metrics.human_bytes(v)}" for k, v in mem.items()),
        f"  state     {summary['state_bytes']['ratio']:.3f} x the ZeRO formula",
        f"  comm      {metrics.human_bytes(comm['wire_bytes_per_device'])} per device per "
        f"step; {_ratio(comm['ratio'])} x the textbook minimum "
        f"({' + '.join(comm['ratio_axes'])})",
        f"  compiled  in {summary['compile_s']:.1f} s",
    ]
    host = summary["host_memory_per_device"]
    if any(host.values()):
        lines.append(
            "  host      per device: "
            + ", ".join(f"{k} {metrics.human_bytes(v)}" for k, v in host.items())
        )
    if host["activations"] and not host["temp"]:
        lines.append(
            f"  note      {metrics.human_bytes(host['activations'])} of layer inputs are sent "
            f"to host memory, but this backend's compiled step keeps them on the device "
            f"(host temp 0 B; XLA:CPU ignores in-step memory placement)"
        )
    pipe = summary["pipeline"]
    if pipe["schedule"]:
        lines.append(
            f"  stages    layers per device {pipe['stages']}; {pipe['schedule']}, "
            f"{pipe['ticks']} ticks, bubble {pipe['bubble']:.3f} "
            f"(formula {pipe['bubble_formula']:.3f})"
        )
    if summary["zero_unsplit_leaves"]:
        lines.append(
            f"  note      ZeRO left {len(summary['zero_unsplit_leaves'])} small leaf(s) "
            "replicated (no dim divisible by data); see summary.json"
        )
    return "\n".join(lines)


def _ratio(r) -> str:
    return "-" if r is None else f"{r:.3f}"


def train(
    problem: Problem,
    cfg: Config,
    batches: Callable[[int], dict],
    *,
    out_dir: Path | None = None,
    mesh=None,
    progress: bool = True,
    tensor_elements: int | None = None,
    quiet: bool = False,
) -> Result:
    """Train `problem` with the strategy in `cfg`; batches(step) gives global numpy batches."""
    mesh = build_mesh(cfg.parallel) if mesh is None else mesh
    config_lib.check_train(cfg, describe(mesh))
    engine = build(problem, cfg, mesh)
    step = compile_step(engine, batches(0))
    compiled = step.executable
    summary = describe_run(cfg, mesh, engine, step, tensor_elements, batches(0))
    tokens = tokens_per_step(problem, batches(0))
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(problem.shapes))
    say = (lambda *_: None) if quiet else tqdm.write
    say(startup_text(summary, n_params))
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "step.hlo.txt").write_text(step.hlo)
    log = metrics.MetricsLog(out_dir / "metrics.jsonl" if out_dir else None)
    state = engine.init(jax.random.key(cfg.train.seed))
    state, losses, times = run_loop(
        compiled, engine, state, batches, cfg, log, tokens, progress and not quiet
    )
    log.close()
    summary.update(
        tokens_per_step=tokens,
        final_loss=losses[-1],
        step_time_s=float(np.median(times)),
        tokens_per_s=tokens / float(np.median(times)),
    )
    if out_dir:
        metrics.write_json(out_dir / "summary.json", summary)
        metrics.plot_loss(log.rows, out_dir / "loss.png", summary["strategy"])
    say(end_table(summary, losses))
    return Result(
        losses=losses, params=engine.export(state["params"]), summary=summary, rows=log.rows
    )


def run_loop(
    compiled, engine: Engine, state, batches, cfg: Config, log, tokens: int, progress: bool
):
    """Run cfg.train.steps steps; returns (state, losses, per-step seconds)."""
    steps, every = cfg.train.steps, cfg.train.log_every
    losses: list[float] = []
    times: list[float] = []
    bar = tqdm(total=steps, desc="train", unit="step", disable=not progress, leave=True)
    pending = None  # (step, metrics on device) of the step in flight
    last = time.perf_counter()
    since_log: list[float] = []

    def settle(step: int, device_metrics) -> None:
        nonlocal last
        host = jax.device_get(device_metrics)  # waits for that step only
        now = time.perf_counter()
        times.append(now - last)
        since_log.append(now - last)
        last = now
        losses.append(float(host["loss"]))
        bar.update(1)
        if (step + 1) % every == 0 or step + 1 == steps:
            dt = float(np.mean(since_log))
            since_log.clear()
            row = {
                "step": step + 1,
                "loss": float(host["loss"]),
                "grad_norm": float(host["grad_norm"]),
                "lr": float(host["lr"]),
                "step_time_s": dt,
                "tokens_per_s": tokens / dt,
            }
            log.write(row)
            bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")

    for step in range(steps):
        batch = jax.device_put(batches(step), engine.batch_sharding)
        state, step_metrics = compiled(state, batch)
        if pending is not None:
            settle(*pending)
        pending = (step, step_metrics)
    settle(*pending)
    bar.close()
    return state, losses, times


def end_table(summary: dict, losses: list[float]) -> str:
    mem = summary["memory_per_device"]
    rows = [
        ["loss", f"{losses[0]:.4f} -> {losses[-1]:.4f}"],
        ["step time", f"{summary['step_time_s'] * 1e3:.1f} ms (median)"],
        ["tokens/s", f"{summary['tokens_per_s']:.0f}"],
        [
            "state / device",
            f"{metrics.human_bytes(mem['params'] + mem['opt_state'])} "
            f"({summary['state_bytes']['ratio']:.3f} x formula)",
        ],
        [
            "comm / device",
            f"{metrics.human_bytes(summary['comm']['wire_bytes_per_device'])} "
            f"({_ratio(summary['comm']['ratio'])} x minimum)",
        ],
    ]
    return "\n" + metrics.table(rows, ["done", summary["strategy"]])


def shipped_problem(cfg: Config, mesh_shape: dict):
    """(problem, batches, tensor_elements) for a shipped model (`model.*`) on `data.*`."""
    import models  # noqa: PLC0415 (models import jaxpar; keep `import jaxpar` cycle-free)

    config_lib.check_model(cfg.model, mesh_shape)
    config_lib.check_train(cfg, mesh_shape)
    tokens = data.load_tokens(cfg.data, cfg.train, cfg.model)
    problem = from_nnx(
        lambda rngs: models.build(cfg.model, cfg.train.seq_len, rngs),
        models.next_token_loss,
        models.stages(cfg.model, cfg.train.seq_len),
    )
    t = cfg.train

    def batches(step: int) -> dict:
        return data.batch_at(
            tokens,
            seed=t.seed,
            step=step,
            batch_size=t.batch_size,
            seq_len=t.seq_len,
            vocab=cfg.model.vocab,
        )

    rows = t.batch_size // (mesh_shape["data"] * t.grad_accum)
    # With a pipeline each device runs some layers, and the head or embedding on some
    # stages only: the Megatron count per device has no single value.
    tensor = (
        None
        if mesh_shape["pipeline"] > 1
        else models.tensor_allreduce_elements(cfg.model, rows, t.seq_len)
    )
    return problem, batches, tensor


def train_config(cfg: Config, out_dir: Path | None = None, **kwargs) -> Result:
    """Train a shipped model as the config says (what `jaxpar train` runs)."""
    mesh = build_mesh(cfg.parallel)
    problem, batches, tensor_elements = shipped_problem(cfg, describe(mesh))
    return train(
        problem, cfg, batches, out_dir=out_dir, mesh=mesh, tensor_elements=tensor_elements, **kwargs
    )
