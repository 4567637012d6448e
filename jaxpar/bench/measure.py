"""What every `jaxpar bench` section shares: the model and batch measured (`Base`), one
configuration compiled and timed (`measure`), a section's table of layouts (`layouts`),
its columns, and a table printed and kept for the docs (`show`)."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from jaxpar.compiled.describe import read_ledger
from jaxpar.compiled.run import prepare
from jaxpar.config import presets, registry
from jaxpar.config import sections as config
from jaxpar.cost import ledger
from jaxpar.cost.report import human_bytes, table
from jaxpar.parallel.mesh import describe
from jaxpar.recipe import setup
from jaxpar.training import checkpoint, metrics
from jaxpar.training.trainer import LoopOptions, run_loop

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


def where(base: Base) -> str:
    """The model and the devices, as each section's title names them."""
    return f"{base} on {jax.device_count()} {jax.devices()[0].platform} devices"


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
    """checkpoint.every > 0: each timed loop saves as a run does (jaxpar's Saver) into a
    fresh directory (a local tier, where the config has one, in a fresh folder of its
    checkpoint.local_dir); the time each save holds the loop (the blocking part: copying
    the state off the device), and the bytes one checkpoint takes on disk."""

    def __init__(self, cfg, problem, run, mesh):
        self.cfg, self.bound = cfg, (problem, run.engine, mesh)
        self.every = cfg.checkpoint.every
        self.blocking: list[float] = []
        self.saver = None
        if self.every:
            self.folders = [Path(tempfile.mkdtemp(prefix="jaxpar-bench-"))]
            if local := cfg.checkpoint.local_dir:
                if not Path(local).is_dir():  # (the row is skipped, saying so)
                    raise config.ConfigError(f"checkpoint.local_dir={local}: no such folder here")
                self.folders.append(Path(tempfile.mkdtemp(prefix="jaxpar-bench-", dir=local)))

    def options(self) -> LoopOptions:
        """A timed loop's options: saving every checkpoint.every steps into fresh folders."""
        if not self.every:
            return LoopOptions()
        self._close()
        loop = str(len(self.blocking))
        local = {"local_dir": str(self.folders[1] / loop)} if len(self.folders) > 1 else {}
        ckpt = dataclasses.replace(self.cfg.checkpoint, keep=2, **local)
        self.saver = checkpoint.Saver(
            dataclasses.replace(self.cfg, checkpoint=ckpt), self.folders[0] / loop
        )
        self.saver.bind(*self.bound)

        def save(state, step: int) -> None:
            start = time.perf_counter()
            self.saver.save(state, step)
            self.blocking.append(time.perf_counter() - start)

        return LoopOptions(every=self.every, save=save)

    def _close(self) -> None:
        if self.saver is not None:
            self.saver.close()

    def figures(self) -> dict:
        if not self.every:
            return {"save_blocking_s": None, "disk_bytes": None}
        self._close()
        latest = self.saver.where(self.saver.newest)
        disk = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file())
        for folder in self.folders:
            shutil.rmtree(folder)
        return {"save_blocking_s": float(np.median(self.blocking)), "disk_bytes": disk}


def show(tables: dict, section: str, title: str, text: str) -> None:
    """A section's table, printed and kept under `section` in `tables` (what --out
    writes beside the figures, and the docs show: scripts/update_docs.py)."""
    print(f"\n{title}\n")
    print(text)
    tables[section] = {"title": title, "table": text}


def layouts(
    name: str, tables: dict, title: str, kind: str, configs: dict, columns: dict, steps: int, base
) -> dict:
    """Each configuration of `configs` measured (or skipped, with the reason the config
    check gives), as the table `name` of `columns`."""
    results, skipped = {}, {}
    for case, overrides in configs.items():
        try:
            results[case] = measure(overrides, steps, base)
        except config.ConfigError as e:
            skipped[case] = str(e)
        print(f"{'skipped' if case in skipped else 'measured'} {case}", flush=True)
    rows = [[case, *(cell(r) for cell in columns.values())] for case, r in results.items()]
    rows += [[case, *("-" for _ in columns)] for case in skipped]
    show(tables, name, title, table(rows, [kind, *(h.strip() for h in columns)]))
    for case, reason in skipped.items():
        print(f"  skipped {case}: {reason}")
    return {**results, **{case: {"skipped": reason} for case, reason in skipped.items()}}


def bytes_of(read):
    """A column of bytes read from a result's report."""
    return lambda r: human_bytes(read(r["report"]))


# columns several sections show


def step_ms(r: dict) -> str:
    return f"{r['step_s'] * 1e3:.1f}"


def tokens_per_s(r: dict) -> str:
    return f"{r['tokens_per_s']:.0f}"


def comm_ratio(r: dict) -> str:
    return f"{r['report'].comm.ratio:.3f}"


state = bytes_of(lambda rep: rep.state_bytes.actual)
comm = bytes_of(lambda rep: rep.comm.wire_bytes_per_device)
minimum = bytes_of(lambda rep: rep.comm.minimum_bytes_per_device)
