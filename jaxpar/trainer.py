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

import jax
import numpy as np
from tqdm import tqdm

from jaxpar import console, metrics
from jaxpar.config import Config
from jaxpar.mesh import build_mesh
from jaxpar.problem import Problem
from jaxpar.report import Report
from jaxpar.run import Run, prepare


@dataclass
class Result:
    losses: list[float]  # every step's loss
    params: dict  # final parameters (global arrays), in the model's own layout
    report: Report  # what summary.json holds
    rows: list[dict]  # metrics rows as logged

    @property
    def summary(self) -> dict:
        """The report as summary.json has it."""
        return self.report.to_json()


def train(
    problem: Problem,
    cfg: Config,
    batches: Callable[[int], dict],
    *,
    out_dir: Path | None = None,
    mesh=None,
    progress: bool = True,
    quiet: bool = False,
) -> Result:
    """Train `problem` with the strategy in `cfg`; batches(step) gives global numpy batches."""
    mesh = build_mesh(cfg.parallel) if mesh is None else mesh
    run = prepare(cfg, problem, mesh, batches(0))
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(problem.shapes))
    say = (lambda *_: None) if quiet else tqdm.write
    say(console.startup(run.report, n_params, jax.devices()[0].platform))
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "step.hlo.txt").write_text(run.step.hlo)
    log = metrics.MetricsLog(out_dir / "metrics.jsonl" if out_dir else None)
    state = run.engine.init(jax.random.key(cfg.train.seed))
    state, losses, times = run_loop(run, state, batches, log, progress and not quiet)
    log.close()
    step_time = float(np.median(times))
    report = run.report.trained(
        tokens_per_step=run.tokens_per_step,
        final_loss=losses[-1],
        step_time_s=step_time,
        tokens_per_s=run.tokens_per_step / step_time,
    )
    if out_dir:
        metrics.write_json(out_dir / "summary.json", report.to_json())
        metrics.plot_loss(log.rows, out_dir / "loss.png", report.strategy)
    say(console.closing(report, losses))
    return Result(
        losses=losses, params=run.engine.export(state.params), report=report, rows=log.rows
    )


def run_loop(run: Run, state, batches, log: metrics.MetricsLog, progress: bool):
    """Run cfg.train.steps steps; returns (state, losses, per-step seconds)."""
    steps, every = run.cfg.train.steps, run.cfg.train.log_every
    compiled, sharding = run.step.executable, run.engine.batch_sharding
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
                "tokens_per_s": run.tokens_per_step / dt,
            }
            log.write(row)
            bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")

    for step in range(steps):
        batch = jax.device_put(batches(step), sharding)
        state, step_metrics = compiled(state, batch)
        if pending is not None:
            settle(*pending)
        pending = (step, step_metrics)
    settle(*pending)
    bar.close()
    return state, losses, times
