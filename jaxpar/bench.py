"""`jaxpar bench`: every strategy on gpt-tiny, measured in one run.

Per strategy: compile time, bare step time and tokens/s, model-state bytes against the
ZeRO formula, wire bytes against the textbook minimum, the trainer's step time over
the bare compiled step, and the trainer's own host work per step (what that ratio
would cost if nothing overlapped).
"""

from __future__ import annotations

import time
from pathlib import Path

import jax

from jaxpar import config, metrics
from jaxpar.mesh import build_mesh, describe
from jaxpar.step import build
from jaxpar.trainer import (
    compile_step,
    describe_run,
    run_loop,
    shipped_problem,
    tokens_per_step,
)

PRESET = "gpt-tiny"
STRATEGIES = {
    "dp8-zero0": ("parallel.data=8", "parallel.zero=0"),
    "dp8-zero1": ("parallel.data=8", "parallel.zero=1"),
    "dp8-zero2": ("parallel.data=8", "parallel.zero=2"),
    "dp8-zero3": ("parallel.data=8", "parallel.zero=3"),
    "dp4-tp2-zero0": ("parallel.data=4", "parallel.tensor=2", "parallel.zero=0"),
    "dp4-tp2-zero3": ("parallel.data=4", "parallel.tensor=2", "parallel.zero=3"),
    "dp2-tp4-zero2": ("parallel.data=2", "parallel.tensor=4", "parallel.zero=2"),
    "tp8": ("parallel.data=1", "parallel.tensor=8"),
}
# Pipeline schedules on 8 devices (data=4 x pipeline=2), 8 micro-batches of 1 sequence.
SCHEDULES = {
    name: (
        "parallel.data=4",
        "parallel.pipeline=2",
        "parallel.microbatches=8",
        "train.batch_size=32",
        *extra,
    )
    for name, extra in {
        "gpipe": ("parallel.schedule=gpipe",),
        "1f1b": ("parallel.schedule=1f1b",),
        "interleaved-v2": ("parallel.schedule=interleaved", "parallel.virtual_stages=2"),
    }.items()
}
# Data-parallel gradient reduction, data=8, ZeRO-0.
DP_MODES = {
    "xla": ("parallel.data=8", "parallel.dp_collective=xla"),
    "ring": ("parallel.data=8", "parallel.dp_collective=ring"),
    "ring-0.1MB": ("parallel.data=8", "parallel.dp_collective=ring", "parallel.bucket_mb=0.1"),
    "server": ("parallel.data=8", "parallel.dp_collective=server"),
    "server-0.1MB": ("parallel.data=8", "parallel.dp_collective=server", "parallel.bucket_mb=0.1"),
}
# ZeRO-Offload on data=8.
OFFLOAD = {
    f"zero{zero} {precision} {mode}": (
        "parallel.data=8",
        f"parallel.zero={zero}",
        f"parallel.offload={mode}",
        f"train.precision={precision}",
    )
    for zero, modes in ((1, ("none", "optimizer")), (3, ("none", "optimizer+params")))
    for precision in ("fp32", "bf16")
    for mode in modes
}
# Activation checkpointing of the layers, data=8, ZeRO-1.
REMAT = {
    mode: ("parallel.data=8", "parallel.zero=1", f"parallel.remat={mode}")
    for mode in ("none", "full", "offload")
}
WARMUP = 3
REPEATS = 3


def measure(overrides: tuple[str, ...], steps: int) -> dict:
    cfg = config.load(PRESET, [*overrides, f"train.steps={steps}", "train.log_every=1"])
    mesh = build_mesh(cfg.parallel)
    problem, batches, tensor_elements = shipped_problem(cfg, describe(mesh))
    engine = build(problem, cfg, mesh)
    step = compile_step(engine, batches(0))
    compiled = step.executable
    summary = describe_run(cfg, mesh, engine, step, tensor_elements, batches(0))
    tokens = tokens_per_step(problem, batches(0))
    state = engine.init(jax.random.key(0))
    on_device = [jax.device_put(batches(i), engine.batch_sharding) for i in range(steps)]
    for batch in on_device[:WARMUP]:
        state, _ = compiled(state, batch)
    jax.block_until_ready(state)
    bare, loop = [], []
    for _ in range(REPEATS):  # alternate, keep each one's best: CPU timings are noisy
        start = time.perf_counter()
        previous = None
        for batch in on_device:
            state, step_metrics = compiled(state, batch)
            # One step in flight, as in the trainer: XLA:CPU collectives were seen to
            # deadlock with dozens of steps queued on 2 cores.
            jax.block_until_ready(previous)
            previous = step_metrics
        jax.block_until_ready(state)
        bare.append((time.perf_counter() - start) / steps)
        start = time.perf_counter()
        state, _, _ = run_loop(
            compiled, engine, state, batches, cfg, metrics.MetricsLog(None), tokens, False
        )
        loop.append((time.perf_counter() - start) / steps)
    bare, loop = min(bare), min(loop)
    # The trainer's own work per step (make and place a batch, read a step's metrics),
    # timed with the devices idle: what it adds when it cannot overlap with a step.
    start = time.perf_counter()
    for i in range(steps):
        jax.block_until_ready(jax.device_put(batches(i), engine.batch_sharding))
        jax.device_get(step_metrics)
    host = (time.perf_counter() - start) / steps
    return {
        "compile_s": step.seconds,
        "step_s": bare,
        "tokens_per_s": tokens / bare,
        "state": summary["state_bytes"],
        "comm": summary["comm"],
        "trainer_over_bare": loop / bare,
        "host_s": host,
        "temp": summary["memory_per_device"]["temp"],
        "pipeline": summary["pipeline"],
        "collective_counts": summary["collective_counts"],
        "memory": summary["memory_per_device"],
        "host_memory": summary["host_memory_per_device"],
    }


def _bytes(*path):
    def get(r):
        for key in path:
            r = r[key]
        return metrics.human_bytes(r)

    return get


STRATEGY_COLUMNS = {
    "compile s": lambda r: f"{r['compile_s']:.1f}",
    "step ms": lambda r: f"{r['step_s'] * 1e3:.1f}",
    "tokens/s": lambda r: f"{r['tokens_per_s']:.0f}",
    "state": _bytes("state", "actual"),
    "ZeRO formula": _bytes("state", "formula"),
    "ratio": lambda r: f"{r['state']['ratio']:.3f}",
    "comm/step": _bytes("comm", "wire_bytes_per_device"),
    "minimum": _bytes("comm", "minimum_bytes_per_device"),
    "ratio ": lambda r: f"{r['comm']['ratio']:.3f}",
    "trainer/bare": lambda r: f"{r['trainer_over_bare']:.3f}",
    "host ms": lambda r: f"{r['host_s'] * 1e3:.2f}",
}
SCHEDULE_COLUMNS = {
    "bubble": lambda r: f"{r['pipeline']['bubble']:.3f}",
    "formula": lambda r: f"{r['pipeline']['bubble_formula']:.3f}",
    "temp": _bytes("temp"),
    "step ms": STRATEGY_COLUMNS["step ms"],
    "tokens/s": STRATEGY_COLUMNS["tokens/s"],
    "permute": _bytes("pipeline", "permute_bytes_per_device"),
    "minimum": _bytes("pipeline", "permute_minimum_per_device"),
    "ratio": lambda r: f"{r['pipeline']['permute_ratio']:.3f}",
}
DP_COLUMNS = {
    "step ms": STRATEGY_COLUMNS["step ms"],
    "wire/device": _bytes("comm", "wire_bytes_per_device"),
    "minimum": _bytes("comm", "minimum_bytes_per_device"),
    "busiest device": _bytes("comm", "busiest_device_bytes"),
    "collectives": lambda r: str(
        sum(n for k, n in r["collective_counts"].items() if k.endswith("@data"))
    ),
}


OFFLOAD_COLUMNS = {
    "step ms": STRATEGY_COLUMNS["step ms"],
    "device params": _bytes("memory", "params"),
    "device opt state": _bytes("memory", "opt_state"),
    "host params": _bytes("host_memory", "params"),
    "host opt state": _bytes("host_memory", "opt_state"),
}
REMAT_COLUMNS = {
    "step ms": STRATEGY_COLUMNS["step ms"],
    "device temp": _bytes("memory", "temp"),
    "host activations": _bytes("host_memory", "activations"),
    "compiled host temp": _bytes("host_memory", "temp"),
    "comm/step": STRATEGY_COLUMNS["comm/step"],
}


def _section(title: str, kind: str, configs: dict, columns: dict, steps: int) -> dict:
    results = {}
    for name, overrides in configs.items():
        results[name] = measure(overrides, steps)
        print(f"measured {name}", flush=True)
    rows = [[name, *(cell(r) for cell in columns.values())] for name, r in results.items()]
    print(f"\n{title}\n")
    print(metrics.table(rows, [kind, *(h.strip() for h in columns)]))
    return results


def run_bench(steps: int = 20, out: Path | None = None, only: list[str] | None = None) -> dict:
    """Measure the `only` sections (default: all) and print their tables."""
    where = f"{PRESET} on {jax.device_count()} {jax.devices()[0].platform} devices"
    sections = {
        "strategies": (
            f"{where}; step time is the best of {REPEATS} runs of {steps} steps",
            "strategy",
            STRATEGIES,
            STRATEGY_COLUMNS,
        ),
        "schedules": (
            f"pipeline schedules, {where}: {' '.join(SCHEDULES['gpipe'][:4])}",
            "schedule",
            SCHEDULES,
            SCHEDULE_COLUMNS,
        ),
        "dp": (
            f"data-parallel gradient reduction, {where}, data=8, ZeRO-0",
            "dp_collective",
            DP_MODES,
            DP_COLUMNS,
        ),
        "offload": (
            f"ZeRO-Offload, {where}, data=8",
            "zero precision offload",
            OFFLOAD,
            OFFLOAD_COLUMNS,
        ),
        "remat": (
            f"activation checkpointing, {where}, data=8, ZeRO-1",
            "parallel.remat",
            REMAT,
            REMAT_COLUMNS,
        ),
    }
    unknown = sorted(set(only or ()) - set(sections))
    if unknown:
        raise config.ConfigError(
            f"jaxpar bench --only {' '.join(unknown)}: no such section; "
            f"choose from {' '.join(sections)}"
        )
    results = {
        name: _section(title, kind, configs, columns, steps)
        for name, (title, kind, configs, columns) in sections.items()
        if not only or name in only
    }
    if out:
        metrics.write_json(out, results)
    return results
