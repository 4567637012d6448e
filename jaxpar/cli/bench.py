"""`jaxpar bench`: every strategy on one model (gpt-tiny unless a config says otherwise),
measured in one run. A strategy that the model's dims or the devices cannot take is
listed as skipped, with the reason.

Per strategy: compile time, bare step time and tokens/s, model-state bytes against the
ZeRO formula, wire bytes against the textbook minimum, the trainer's step time over
the bare compiled step, and the trainer's own host work per step (what that ratio
would cost if nothing overlapped).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from jaxpar.config import presets, registry
from jaxpar.config import sections as config
from jaxpar.cost import hlo, ledger
from jaxpar.cost.report import human_bytes, table
from jaxpar.nn.problem import registered
from jaxpar.parallel.mesh import describe
from jaxpar.recipe import setup
from jaxpar.step.build import prepare, read_ledger
from jaxpar.training import checkpoint, metrics
from jaxpar.training.trainer import LoopOptions, run_loop

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
# Data parallelism across two hosts of 4 devices (simulated: the mesh's first and second
# halves): flat ZeRO over 8, ZeRO groups of 4 replicated twice, parameter averaging.
ACROSS_HOSTS = {
    "flat zero1": ("parallel.data=8", "parallel.zero=1"),
    "replica2 zero1": ("parallel.replica=2", "parallel.data=4", "parallel.zero=1"),
    "flat zero3": ("parallel.data=8", "parallel.zero=3"),
    "replica2 zero3": ("parallel.replica=2", "parallel.data=4", "parallel.zero=3"),
    **{
        f"params every {k}": (
            "parallel.data=8",
            "parallel.dp_sync=params",
            f"parallel.sync_every={k}",
        )
        for k in (1, 4, 36)
    },
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
# Long sequences on 8 devices at two lengths, 8 rows a step: whole sequences over data,
# then each split over context (each strategy), and with tensor + sequence parallelism.
CONTEXT_LENGTHS = (256, 1024)
CONTEXT_LAYOUTS = {
    "data=8": ("parallel.data=8",),
    "context=8 all_gather": ("parallel.data=1", "parallel.context=8"),
    "context=8 ulysses": (
        "parallel.data=1", "parallel.context=8", "parallel.context_strategy=ulysses"
    ),
    "data=2 context=4": ("parallel.data=2", "parallel.context=4"),
    "context=4 tensor=2 sp": (
        "parallel.data=1", "parallel.context=4", "parallel.tensor=2",
        "parallel.sequence_parallel=true",
    ),
}  # fmt: skip
CONTEXT = {
    f"S={seq} {name}": (*overrides, f"train.seq_len={seq}", "train.batch_size=8")
    for seq in CONTEXT_LENGTHS
    for name, overrides in CONTEXT_LAYOUTS.items()
}
# A mixture of experts in the base model's blocks (8 experts, top 2), its experts split
# over expert = 1, 2, 4, 8 (the rest of the 8 devices on data), ZeRO-0.
EXPERTS = {
    f"expert={x}{name}": (
        "model.name=mixtral", "model.experts=8", f"parallel.data={8 // x}", f"parallel.expert={x}",
        f"model.capacity_factor={factor}",
    )
    for x, name, factor in ((1, "", 1.25), (2, "", 1.25), (4, "", 1.25), (8, "", 1.25),
                            (2, ", capacity 2.0", 2.0), (1, ", dropless", 0),
                            (2, ", dropless", 0), (8, ", dropless", 0))
}  # fmt: skip
# Checkpointing overhead on data=8 ZeRO-3 (nothing replicated: the state on disk is the
# ledger's per-device state times the devices).
CHECKPOINTS = {
    "off": ("parallel.data=8", "parallel.zero=3", "checkpoint.every=0"),
    "every=1 (async)": ("parallel.data=8", "parallel.zero=3", "checkpoint.every=1"),
}
# Compile time against depth: each layout at these layer counts (the layer stack is
# scanned, so compiling should not grow with it).
COMPILE_LAYOUTS = {
    "dp8": ("parallel.data=8",),
    "dp8-zero3": ("parallel.data=8", "parallel.zero=3"),
    "dp2-tp4": ("parallel.data=2", "parallel.tensor=4"),
    "dp2-pp2-tp2-1f1b": (
        "parallel.data=2",
        "parallel.pipeline=2",
        "parallel.tensor=2",
        "parallel.microbatches=2",
    ),
}
COMPILE_DEPTHS = (4, 8, 16, 32)
# `jaxpar plan`'s heaviest case: a 70B GPT on 64 devices over 8 hosts (shapes only)
PLAN_70B = ("model.layers=80", "model.embed=8192", "model.heads=64", "model.mlp=28672",
            "model.vocab=32000", "train.seq_len=4096", "train.batch_size=512",
            "train.precision=bf16", "data.source=synthetic")  # fmt: skip
WARMUP = 3
REPEATS = 3


@dataclass(frozen=True)
class Base:
    """The model and batch measured: a preset or YAML file, and overrides on top (each
    strategy's own keys go on top of these)."""

    # the default model's tiny preset unless --config names another
    preset: str = field(default_factory=lambda: registry.tiny_preset(registry.default_name()))
    overrides: tuple[str, ...] = ()
    force: bool = False  # run even where the step looks too big for memory

    def __str__(self) -> str:
        return " ".join([self.preset, *self.overrides])


def measure(overrides: tuple[str, ...], steps: int, base: Base = Base()) -> dict:
    """Compile and time one configuration: {compile_s, step_s, tokens_per_s,
    trainer_over_bare, host_s, report}."""
    cfg = presets.load(
        base.preset, [*base.overrides, *overrides, f"train.steps={steps}", "train.log_every=1"]
    )
    s = setup(cfg)
    batches = s.batches
    run = prepare(cfg, s.problem, s.mesh, batches(0), base.force)
    compiled, sharding = run.step.executable, run.engine.batch_sharding
    state = run.engine.init(jax.random.key(0))
    on_device = [jax.device_put(batches(i), sharding) for i in range(steps)]
    for batch in on_device[:WARMUP]:
        state, _ = compiled(state, batch)
    jax.block_until_ready(state)
    bare, loop, saves = [], [], _Saves(cfg, s.problem, run, s.mesh)
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
        log = metrics.MetricsLog(None)
        state = run_loop(run, state, batches, log, 0, saves.options()).state
        dropped = log.rows[-1].get("moe/dropped")  # a mixture's, the last step's
        loop.append((time.perf_counter() - start) / steps)
    bare, loop = min(bare), min(loop)
    # The trainer's own work per step (make and place a batch, read a step's metrics),
    # timed with the devices idle: what it adds when it cannot overlap with a step.
    start = time.perf_counter()
    for i in range(steps):
        jax.block_until_ready(jax.device_put(batches(i), sharding))
        jax.device_get(step_metrics)
    host = (time.perf_counter() - start) / steps
    # bytes that would cross between two hosts holding the mesh's halves
    led = read_ledger(cfg.parallel, run.step.hlo, describe(s.mesh))
    halves = [2 * k // s.mesh.size for k in range(s.mesh.size)]
    return {
        "across_2_hosts": sum(ledger.across_processes(led, a, halves) for a in s.mesh.axis_names),
        "compile_s": run.step.seconds,
        "step_s": bare,
        "tokens_per_s": run.tokens_per_step / bare,
        "trainer_over_bare": loop / bare,
        "host_s": host,
        "report": run.report,
        **({"dropped": dropped} if dropped is not None else {}),
        **saves.figures(),
    }


class _Saves:
    """checkpoint.every > 0: each timed loop saves into a fresh directory; the time each
    save holds the loop (the blocking part: copying the state off the device), and the
    bytes one checkpoint takes on disk."""

    def __init__(self, cfg, problem, run, mesh):
        self.every = cfg.checkpoint.every
        self.blocking: list[float] = []
        self.ckpts = None
        if self.every:
            self.folder = Path(tempfile.mkdtemp(prefix="jaxpar-bench-"))
            self.layout = checkpoint.layout(
                problem, run.engine, mesh, cfg.parallel.zero, cfg.train.precision
            )
            self.meta = lambda step: checkpoint.meta(cfg, mesh, self.layout, step)

    def options(self) -> LoopOptions:
        """A timed loop's options: saving every checkpoint.every steps into a fresh folder."""
        if not self.every:
            return LoopOptions()
        if self.ckpts:
            self.ckpts.close()
        self.ckpts = checkpoint.Checkpoints(self.folder / str(len(self.blocking)), keep=2)

        def save(state, step: int) -> None:
            start = time.perf_counter()
            self.ckpts.save(step, self.layout.to_saved(state), self.meta(step))
            self.blocking.append(time.perf_counter() - start)

        return LoopOptions(every=self.every, save=save)

    def figures(self) -> dict:
        if not self.every:
            return {"save_blocking_s": None, "disk_bytes": None}
        self.ckpts.close()
        latest = self.ckpts.directory / str(self.ckpts.latest)
        disk = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file())
        shutil.rmtree(self.folder)
        return {"save_blocking_s": float(np.median(self.blocking)), "disk_bytes": disk}


def _bytes(read):
    return lambda r: human_bytes(read(r["report"]))


STRATEGY_COLUMNS = {
    "compile s": lambda r: f"{r['compile_s']:.1f}",
    "step ms": lambda r: f"{r['step_s'] * 1e3:.1f}",
    "tokens/s": lambda r: f"{r['tokens_per_s']:.0f}",
    "state": _bytes(lambda rep: rep.state_bytes.actual),
    "ZeRO formula": _bytes(lambda rep: rep.state_bytes.formula),
    "ratio": lambda r: f"{r['report'].state_bytes.ratio:.3f}",
    "comm/step": _bytes(lambda rep: rep.comm.wire_bytes_per_device),
    "minimum": _bytes(lambda rep: rep.comm.minimum_bytes_per_device),
    "ratio ": lambda r: f"{r['report'].comm.ratio:.3f}",
    "trainer/bare": lambda r: f"{r['trainer_over_bare']:.3f}",
    "host ms": lambda r: f"{r['host_s'] * 1e3:.2f}",
}
SCHEDULE_COLUMNS = {
    "bubble": lambda r: f"{r['report'].pipeline.bubble:.3f}",
    "formula": lambda r: f"{r['report'].pipeline.bubble_formula:.3f}",
    "temp": _bytes(lambda rep: rep.memory_per_device.temp),
    "step ms": STRATEGY_COLUMNS["step ms"],
    "tokens/s": STRATEGY_COLUMNS["tokens/s"],
    "permute": _bytes(lambda rep: rep.pipeline.permute_bytes_per_device),
    "minimum": _bytes(lambda rep: rep.pipeline.permute_minimum_per_device),
    "ratio": lambda r: f"{r['report'].pipeline.permute_ratio:.3f}",
}
DP_COLUMNS = {
    "step ms": STRATEGY_COLUMNS["step ms"],
    "wire/device": STRATEGY_COLUMNS["comm/step"],
    "minimum": STRATEGY_COLUMNS["minimum"],
    "busiest device": _bytes(lambda rep: rep.comm.busiest_device_bytes),
    "collectives": lambda r: str(
        sum(n for k, n in r["report"].collective_counts.items() if k.endswith("@data"))
    ),
}


ACROSS_HOSTS_COLUMNS = {
    "step ms": STRATEGY_COLUMNS["step ms"],
    "replica wire": _bytes(lambda rep: rep.comm.by_axis["replica"].wire),
    "replica min": _bytes(lambda rep: rep.comm.by_axis["replica"].minimum),
    "data wire": _bytes(lambda rep: rep.comm.by_axis["data"].wire),
    "data min": _bytes(lambda rep: rep.comm.by_axis["data"].minimum),
    "across 2 hosts": lambda r: human_bytes(r["across_2_hosts"]),
    "state": STRATEGY_COLUMNS["state"],
}
OFFLOAD_COLUMNS = {
    "step ms": STRATEGY_COLUMNS["step ms"],
    "device params": _bytes(lambda rep: rep.memory_per_device.params),
    "device opt state": _bytes(lambda rep: rep.memory_per_device.opt_state),
    "host params": _bytes(lambda rep: rep.host_memory_per_device.params),
    "host opt state": _bytes(lambda rep: rep.host_memory_per_device.opt_state),
}
CONTEXT_COLUMNS = {
    "step ms": STRATEGY_COLUMNS["step ms"],
    "tokens/s": STRATEGY_COLUMNS["tokens/s"],
    "device temp": _bytes(lambda rep: rep.memory_per_device.temp),
    "context wire": _bytes(lambda rep: rep.comm.by_axis["context"].wire),
    "context min": _bytes(lambda rep: rep.comm.by_axis["context"].minimum or 0),
    "tensor wire": _bytes(lambda rep: rep.comm.by_axis["tensor"].wire),
    "comm/step": STRATEGY_COLUMNS["comm/step"],
    "ratio": STRATEGY_COLUMNS["ratio "],
}
EXPERT_COLUMNS = {
    "step ms": STRATEGY_COLUMNS["step ms"],
    "tokens/s": STRATEGY_COLUMNS["tokens/s"],
    "device params": _bytes(lambda rep: rep.memory_per_device.params),
    "device opt state": _bytes(lambda rep: rep.memory_per_device.opt_state),
    "expert wire": _bytes(lambda rep: rep.comm.by_axis["expert"].wire),
    "expert min": _bytes(lambda rep: rep.comm.by_axis["expert"].minimum or 0),
    "dropped": lambda r: f"{r['dropped']:.1%}",
    "comm/step": STRATEGY_COLUMNS["comm/step"],
    "ratio": STRATEGY_COLUMNS["ratio "],
}
CHECKPOINT_COLUMNS = {
    "trainer step ms": lambda r: f"{r['step_s'] * r['trainer_over_bare'] * 1e3:.1f}",
    "blocking ms/save": lambda r: (
        "-" if r["save_blocking_s"] is None else f"{r['save_blocking_s'] * 1e3:.1f}"
    ),
    "on disk": lambda r: human_bytes(r["disk_bytes"]),
    "ledger state x devices": _bytes(lambda rep: rep.state_bytes.actual * rep.devices),
    "disk / ledger": lambda r: (
        "-"
        if r["disk_bytes"] is None
        else f"{r['disk_bytes'] / (r['report'].state_bytes.actual * r['report'].devices):.3f}"
    ),
}
REMAT_COLUMNS = {
    "step ms": STRATEGY_COLUMNS["step ms"],
    "device temp": _bytes(lambda rep: rep.memory_per_device.temp),
    "host activations": _bytes(lambda rep: rep.host_memory_per_device.activations),
    "compiled host temp": _bytes(lambda rep: rep.host_memory_per_device.temp),
    "comm/step": STRATEGY_COLUMNS["comm/step"],
}


def _show(tables: dict, section: str, title: str, text: str) -> None:
    """A section's table, printed and kept under `section` in `tables` (what --out
    writes beside the figures, and the docs show: scripts/update_docs.py)."""
    print(f"\n{title}\n")
    print(text)
    tables[section] = {"title": title, "table": text}


def _section(
    name: str, tables: dict, title: str, kind: str, configs: dict, columns: dict, steps: int, base
) -> dict:
    results, skipped = {}, {}
    for case, overrides in configs.items():
        try:
            results[case] = measure(overrides, steps, base)
        except config.ConfigError as e:
            skipped[case] = str(e)
        print(f"{'skipped' if case in skipped else 'measured'} {case}", flush=True)
    rows = [[case, *(cell(r) for cell in columns.values())] for case, r in results.items()]
    rows += [[case, *("-" for _ in columns)] for case in skipped]
    _show(tables, name, title, table(rows, [kind, *(h.strip() for h in columns)]))
    for case, reason in skipped.items():
        print(f"  skipped {case}: {reason}")
    return {**results, **{case: {"skipped": reason} for case, reason in skipped.items()}}


def compile_seconds(base: Base, tables: dict) -> dict:
    """Seconds to trace, lower and compile each layout's step at each depth, and the
    lines of its optimized HLO (what the compiler had to work through); printed as a
    table with compile(deepest) / compile(shallowest)."""
    results = {}
    for name, overrides in COMPILE_LAYOUTS.items():
        results[name] = {}
        for layers in COMPILE_DEPTHS:
            cfg = presets.load(base.preset, [*base.overrides, *overrides, f"model.layers={layers}"])
            s = setup(cfg)
            step = prepare(cfg, s.problem, s.mesh, s.batches(0), base.force).step
            lines = hlo.program_lines(step.hlo)
            results[name][layers] = {"seconds": step.seconds, "hlo_lines": lines}
        print(f"compiled {name}", flush=True)
    first, last = COMPILE_DEPTHS[0], COMPILE_DEPTHS[-1]
    rows = [
        [
            name,
            *(f"{t[n]['seconds']:.2f}" for n in COMPILE_DEPTHS),
            f"{t[last]['seconds'] / t[first]['seconds']:.2f}",
            f"{t[first]['hlo_lines']} / {t[last]['hlo_lines']}",
        ]
        for name, t in results.items()
    ]
    title = f"compile seconds by depth, {base} on {jax.device_count()} devices"
    header = ["layout", *map(str, COMPILE_DEPTHS), f"{last} / {first}", "HLO lines"]
    _show(tables, "compile", title, table(rows, header))
    return results


LONGEST_BUDGET = 256 * 2**20  # per-device temporaries, llama-tiny on the CPU
# 256, 384, 512, 768, ... 12288: steps of 1.5 and 4/3
LONGEST_LENGTHS = tuple(sorted(n * 2**k for n in (256, 384) for k in range(6)))
LONGEST_GPU = tuple(4096 * 2**k for k in range(9))  # 4k .. 1M (train.seq_len at most)


def longest_sequences(tables: dict) -> dict:
    """The longest sequence (of those listed) one row of which fits a per-device budget, for
    context = 1, 2, 4, 8: measured on llama-tiny from the compiled step's temporaries
    (compiled, not run; the CPU keeps each layer's [S/C, S] scores, so memory grows as
    S^2 / C there), and predicted by the planner for llama3-8b on 64 80 GB GPUs (tensor=8
    inside each host, ZeRO-3, no remat, cuDNN attention keeping no scores: S / C)."""
    from jaxpar.cost import planner

    measured = {}
    for c in (1, 2, 4, 8):
        fits = 0
        for seq in LONGEST_LENGTHS:
            overrides = ["parallel.data=1", f"parallel.context={c}", "train.batch_size=1"]
            cfg = presets.load("llama-tiny", [*overrides, f"train.seq_len={seq}"])
            s = setup(cfg, jax.devices()[:c])
            temp = prepare(cfg, s.problem, s.mesh, s.batches(0), True).report
            if temp.memory_per_device.temp > LONGEST_BUDGET:
                break
            fits = seq
        measured[c] = fits
    predicted, gpus = {}, planner.machine(64, "80GB", hosts=8)
    for c in (1, 2, 4, 8):
        fits = 0
        for seq in LONGEST_GPU:
            data = 8 // c
            layout = [f"parallel.data={data}", f"parallel.context={c}", "parallel.tensor=8"]
            layout += ["parallel.zero=3", f"train.batch_size={data}"]
            cfg = presets.load("llama3-8b", [*layout, f"train.seq_len={seq}"])
            trained = registered(cfg.model, seq)
            mesh = {"replica": 1, "data": data, "pipeline": 1, "context": c, "tensor": 8}
            guess = planner.predict(cfg, mesh, gpus, trained, planner.of_config(cfg))
            if guess.device > gpus.device_memory:
                break
            fits = seq
        predicted[c] = fits
    rows = [
        [str(c), f"{measured[c]:,}", f"{measured[c] / measured[1]:.1f}", f"{predicted[c]:,}",
         f"{predicted[c] / predicted[1]:.1f}"]
        for c in measured
    ]  # fmt: skip
    budget = human_bytes(LONGEST_BUDGET)
    title = (
        f"the longest sequence that fits, one row a device: llama-tiny in {budget} of "
        "temporaries (CPU, measured), llama3-8b in 80 GB (GPU, predicted)"
    )
    header = ["context", "CPU tokens", "x", "8B GPU tokens", "x"]
    _show(tables, "longest", title, table(rows, header))
    return {"measured": measured, "predicted": predicted}


def plan_seconds(tables: dict) -> dict:
    """Seconds `jaxpar plan` takes to rank every layout of PLAN_70B (gpt-tiny's model
    scaled to 70B) on 64 devices over 8 hosts, and how many it considered."""
    from jaxpar.cost import planner

    cfg = presets.load("gpt-tiny", list(PLAN_70B))
    problem, work = registered(cfg.model, cfg.train.seq_len), planner.of_config(cfg)
    start = time.perf_counter()
    plan = planner.make_plan(cfg, problem, planner.machine(64, "80GB", hosts=8), work)
    seconds = time.perf_counter() - start
    title = f"jaxpar plan, a 70B GPT on 64 devices over 8 hosts ({' '.join(PLAN_70B)})"
    rows = [[str(plan.considered), str(len(plan.ranked)), f"{seconds:.2f}"]]
    _show(tables, "plan", title, table(rows, ["layouts considered", "fit", "seconds"]))
    return {"seconds": seconds, "considered": plan.considered, "fit": len(plan.ranked)}


def run_bench(
    base: Base = Base(), steps: int = 20, out: Path | None = None, only: list[str] | None = None
) -> dict:
    """Measure the `only` sections (default: all) on `base`'s model and print their tables."""
    where = f"{base} on {jax.device_count()} {jax.devices()[0].platform} devices"
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
        "hosts": (
            f"data parallelism across 2 hosts of 4 devices, {where}; per device per step",
            "layout",
            ACROSS_HOSTS,
            ACROSS_HOSTS_COLUMNS,
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
        "context": (
            f"long sequences, {where}, 8 rows a step, ZeRO-0",
            "sequence layout",
            CONTEXT,
            CONTEXT_COLUMNS,
        ),
        "experts": (
            f"mixture of experts (model.name=mixtral, 8 experts, top 2; capacity factor 1.25 "
            f"unless named; dropped: the last step's share of choices), {where}, ZeRO-0",
            "experts over",
            EXPERTS,
            EXPERT_COLUMNS,
        ),
        "checkpoint": (
            f"checkpointing, {where}, data=8, ZeRO-3 (orbax, asynchronous)",
            "checkpoint",
            CHECKPOINTS,
            CHECKPOINT_COLUMNS,
        ),
    }
    extra = ("longest", "compile", "plan", "generate", "grpo")
    unknown = sorted(set(only or ()) - set(sections) - set(extra))
    if unknown:
        raise config.ConfigError(
            f"jaxpar bench --only {' '.join(unknown)}: no such section; "
            f"choose from {' '.join(sections)} {' '.join(extra)}"
        )
    tables: dict = {}
    results = {
        name: _section(name, tables, title, kind, configs, columns, steps, base)
        for name, (title, kind, configs, columns) in sections.items()
        if not only or name in only
    }
    if "strategies" in results:
        picture = out.with_suffix(".png") if out else Path("bench-strategies.png")
        measured = {n: r for n, r in results["strategies"].items() if "report" in r}
        metrics.plot_strategies(measured, picture, sections["strategies"][0])
        print(f"\npicture: {picture}")
    if not only or "longest" in only:
        results["longest"] = longest_sequences(tables)
    if not only or "compile" in only:
        results["compile"] = compile_seconds(base, tables)
    if not only or "plan" in only:
        results["plan"] = {"gpt-70b": plan_seconds(tables)}
    if not only or "generate" in only:
        from jaxpar.cli import bench_generate

        results["generate"] = bench_generate.layouts(tables, _show)
        results["generate-peer"] = bench_generate.against_peer(tables, _show)
    if not only or "grpo" in only:
        from jaxpar.cli import bench_grpo

        results["grpo"] = bench_grpo.steps(tables, _show)
    if out:
        metrics.write_json(
            out,
            {
                section: {
                    name: {**r, "report": r["report"].to_json()} if "report" in r else r
                    for name, r in rows.items()
                }
                for section, rows in results.items()
            }
            | {"tables": tables},
        )
    return results
