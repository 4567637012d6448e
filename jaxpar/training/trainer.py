"""The loop: data -> step -> metrics -> checkpoints -> run directory.

Step n is dispatched before step n-1's metrics are read to the host, so the device
never waits on Python. A first SIGINT (Ctrl-C) or SIGTERM finishes the step in flight,
saves, and returns; a second one exits at once (the last complete checkpoint stays).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from jaxpar import disk
from jaxpar.adapters.base import source as base_source
from jaxpar.compiled.run import Run, prepare
from jaxpar.config.sections import (
    Checkpoint,
    Config,
    Model,
    OnNonfinite,
    OnSpike,
    Train,
    profile_range,
)
from jaxpar.cost import throughput
from jaxpar.cost.report import Report
from jaxpar.errors import ConfigError, NonFinite, ReplicasDiverged, Stopped
from jaxpar.nn.problem import Problem
from jaxpar.parallel.batches import batch_for, check_first_batch
from jaxpar.parallel.mesh import build_mesh
from jaxpar.parallel.sharding import leaf_key
from jaxpar.training import checkpoint, console, metrics, rundir, watchdog
from jaxpar.training.checkpoint import Saver
from jaxpar.training.hooks import Hook
from jaxpar.training.spikes import Spike
from jaxpar.training.spikes import columns as spike_columns

STEP_EVENT = "/jaxpar/train/step"  # a jax.monitoring event per dispatched training step


@dataclass
class Result:
    losses: list[float]  # the loss of every step this call ran
    params: dict  # final parameters (global arrays), in the model's own layout
    report: Report  # what summary.json holds
    rows: list[dict]  # metrics rows as logged (a resumed run's earlier rows too)
    checkpoints: Path | None = None  # where the checkpoints are (None: not saved)
    stopped: str | None = None  # the signal that stopped the run early, if one did

    @property
    def summary(self) -> dict:
        """The report as summary.json has it."""
        return self.report.to_json()


def train(
    problem: Problem,
    cfg: Config,
    batches: Callable[[int], dict],
    *,
    out_dir: str | Path | None = None,
    mesh=None,
    progress: bool = True,
    quiet: bool = False,
    restart: bool = False,
    force: bool = False,
    source: str = "your batches(step)",
    params: Callable[[dict], dict] | None = None,
    peak_tflops: float | None = None,
    eval_batches: Callable[..., dict] | None = None,
    hooks: Sequence[Hook] = (),
    rollouts=None,
    benchmarks=None,
) -> Result:
    """Train `problem` with the strategy in `cfg`; batches(step) gives global numpy batches.

    With checkpoints (cfg.checkpoint, saved under out_dir/checkpoints unless checkpoint.dir
    says otherwise) it resumes from the latest one; `restart` sets the earlier run's files
    and checkpoints aside and starts fresh. A step that would not fit in memory is refused
    (ConfigError) unless `force`. `source` names the data in the start-up summary. `params`
    (default: the problem's own init from train.seed) gives the initial parameters of a
    fresh run: called with each leaf's ShapeDtypeStruct and sharding in the model's own
    layout, it returns the arrays (e.g. jaxpar.hf.initial_params, which reads each device's
    shard from the files). `peak_tflops` (per device) replaces the device kind's peak that
    MFU divides by. `eval_batches(i)` gives held-out batch i (train.batch_size rows, never
    trained on): every train.eval_every steps the mean loss over train.eval_batches of them
    is logged as eval_loss. `hooks` (jaxpar.training.hooks.Hook) run around the steps:
    rollouts before theirs, scores after (`rollouts=`, `benchmarks=` warn until 0.3.0)."""
    out_dir = None if out_dir is None else Path(out_dir)
    ckpt_dir = _checkpoint_dir(cfg.checkpoint, out_dir)
    _check_asked(cfg.train, out_dir, eval_batches, bool(ckpt_dir and cfg.checkpoint.every))
    hooks = _hooks(hooks, rollouts, benchmarks)
    lead = jax.process_index() == 0  # with many processes, process 0 writes and prints
    say = tqdm.write if lead and not quiet else (lambda *_: None)
    with _writing(out_dir, cfg.checkpoint, restart, lead, say), Saver(cfg, ckpt_dir) as saver:
        start = saver.latest or 0
        if start >= cfg.train.steps:  # said before anything compiles
            say(finished(start, cfg.train.steps))
        mesh = build_mesh(cfg.parallel) if mesh is None else mesh
        run = _peak(prepare(cfg, problem, mesh, _first(batches, cfg.train), force), peak_tflops)
        saver.bind(problem, run.engine, mesh)
        state = _first_state(cfg.model, cfg.train, problem, run, saver, params, start, say)
        start = int(state.step)  # the data position (a save racing a halt is labelled later)
        batches = _resumed_data(batches, saver, start, say)  # saver.position: what saves record
        n_params, trainable = _counts(problem)
        say(console.startup(run.report, n_params, jax.devices()[0].platform, source, trainable))
        _start_hooks(hooks, run, state, files := out_dir if out_dir and lead else None, start, say)
        log, profile = _run_files(files, run, cfg.train.profile_steps, saver, start, say)
        saver.rows = log.rows
        hang = watchdog.Watchdog(cfg.train.hang_timeout_s, start)
        with _Stops() as stops, contextlib.closing(log), hang:
            options = LoopOptions(
                progress=progress and not quiet and lead,
                every=cfg.checkpoint.every if ckpt_dir else 0,
                save=saver.save,
                stops=stops,
                profile=profile,
                evaluate=_evaluation(run, eval_batches) if cfg.train.eval_every else None,
                hooks=tuple(hooks),
                beat=hang.beat,
                **_spike_options(cfg.train, saver, problem, params, say),
            )
            loop = run_loop(run, state, batches, log, start, options)
        state = saver.finish(loop, start)
    _raise_a_failure(run, state, batches, loop, saver)
    report = _finish(run, loop, log.rows, files, saver, say, hooks)
    return Result(
        losses=loop.losses,
        params=_policy(problem, run.engine.export(state.params)),
        report=report,
        rows=log.rows,
        checkpoints=saver.directory if saver.opened else None,
        stopped=loop.stopped,
    )


def _start_hooks(hooks, run, state, out_dir: Path | None, start: int, say) -> None:
    """Each hook's start, and what it has to say (out_dir: None but on process 0)."""
    for hook in hooks:
        if lines := hook.start(run, state, out_dir, start):
            say(lines)


def _first(batches, train: Train) -> dict:
    """The first batch, checked: the step is compiled for its shapes."""
    first = batches(0)
    check_first_batch(first, train.batch_size)
    return first


def _peak(run: Run, peak_tflops: float | None) -> Run:
    """`run` with MFU over `peak_tflops` where given."""
    if peak_tflops is None:
        return run
    return dataclasses.replace(run, peak_flops=throughput.peak_flops("", peak_tflops))


def _run_files(files: Path | None, run, profile_steps: str, saver, start: int, say):
    """(the metrics log, the profile's folder or None): into the run directory `files`
    (None: this process writes none), with the compiled step's HLO beside them."""
    if files:
        files.mkdir(parents=True, exist_ok=True)
        disk.write_whole(files / rundir.HLO, run.step.hlo)
    log = metrics.MetricsLog(
        files / rundir.METRICS if files else None,
        resume_at=start,
        through=saver.rows_through,
        events=files / rundir.TENSORBOARD if files else None,
    )
    if files and importlib.util.find_spec("tensorboard") is not None:  # where it can be run
        say(f"tensorboard --logdir {files}")
    profile = files / rundir.PROFILE if files and profile_steps else None
    if profile:
        say(f"profiling steps {profile_steps} into {profile}")
    return log, profile


def _check_asked(train: Train, out_dir: Path | None, eval_batches, saves: bool) -> None:
    """What the config asks of train()'s arguments: held-out data, a run directory,
    checkpoints to roll back to (`saves`: the run saves every checkpoint.every steps)."""
    if train.on_spike is OnSpike.ROLLBACK and not saves:
        raise ConfigError(
            "train.on_spike=rollback returns to the newest checkpoint before a spike, but "
            "this run saves none: set checkpoint.every=N and give it a place (--out, "
            "train(..., out_dir=...) or checkpoint.dir), or use train.on_spike=skip"
        )
    if train.eval_every and eval_batches is None:
        raise ConfigError(
            f"train.eval_every={train.eval_every}: give the held-out data, "
            "train(..., eval_batches=fn) with fn(i) a batch like batches(i), or "
            "train.eval_every=0"
        )
    if train.profile_steps and out_dir is None:
        raise ConfigError(
            f"train.profile_steps={train.profile_steps}: a profile is written into the "
            "run directory's profile/ folder; give train(..., out_dir=...), or drop the key"
        )


def _first_state(model: Model, train: Train, problem: Problem, run, saver, params, start: int, say):
    """The state the loop starts from: checkpoint `start`'s (the frozen base made again),
    or a fresh one from `params` or the problem's init (the frozen base's hash kept)."""
    if start:
        state = saver.restore(start, _base(problem, saver, params, train.seed))
        if start < train.steps:  # said once the checkpoint has been read
            say(f"resuming from step {start}: {saver.where(start)}")
        return state
    if params is not None:  # given, e.g. read from a Hugging Face checkpoint
        state = saver.layout.fresh(params(saver.layout.params))
    else:
        state = run.engine.init(jax.random.key(train.seed))
    if problem.frozen:
        saver.base = {
            "from": base_source(model, train, params is not None),
            "hash": saver.layout.base_hash(state),
        }
    return state


def _base(problem: Problem, saver, params, seed: int) -> dict:
    """The frozen parameters a restore joins (not in the checkpoint: made again)."""
    return checkpoint.frozen_base(saver.layout, problem, params, seed) if problem.frozen else {}


def _spike_options(train: Train, saver, problem: Problem, params, say) -> dict:
    """LoopOptions' `say` and `rollback`: (checkpoint step, spiking step) -> the state
    saved at that checkpoint, its data position moved to the spiking step (the batches
    between skipped)."""

    def rollback(back_to: int, step: int):
        saver.wait()  # (the save of that step may still be writing)
        state = saver.restore(back_to, _base(problem, saver, params, train.seed))
        return state.replace(step=state.step + (step - back_to))

    return {"say": say, "rollback": rollback}


def _counts(problem: Problem) -> tuple[int, int]:
    """(the model's parameters, those trained): a frozen base and a reference copy are
    counted in the first only, as PEFT's print_trainable_parameters counts them."""
    paths = jax.tree_util.tree_leaves_with_path(problem.shapes)
    sizes = {leaf_key(p): math.prod(s.shape) for p, s in paths}
    held = set(problem.frozen) | set(problem.reference)
    model = sum(n for k, n in sizes.items() if k not in problem.reference)
    return model, sum(n for k, n in sizes.items() if k not in held)


def _raise_a_failure(run, state, batches, loop, saver) -> None:
    """The loop's end as an error: a non-finite step, diverged copies, a failure."""
    if loop.nonfinite is not None:
        raise NonFinite(_nonfinite_message(run, state, batches, loop, saver))
    if loop.diverged:
        where = f"saved to {saver.where(loop.end)}" if saver.opened else "not saved (no --out)"
        raise ReplicasDiverged(
            f"step {loop.end}: copies of parameters that must be identical differ: "
            f"{loop.diverged}. The state is {where}; a faulty device or a nondeterministic "
            "op can cause this: resume from an earlier checkpoint, and if it recurs on the "
            "same devices, leave them out"
        )
    if loop.failed is not None:
        where = f"; the state is saved to {saver.where(loop.end)}" if saver.opened else ""
        raise type(loop.failed)(f"step {loop.end + 1}: {loop.failed}{where}")


def _policy(problem: Problem, params):
    """The trained model's parameters: without the copy of a reference it holds."""
    if not problem.reference:
        return params
    return {k: v for k, v in params.items() if k not in problem.reference}


@contextlib.contextmanager
def _writing(out_dir: Path | None, ckpt: Checkpoint, restart: bool, lead: bool, say):
    """The run directory and checkpoints (both tiers) while the run writes them: checked,
    taken by this run alone (a second writer is refused), set aside on `restart`, never
    mixed with another run's."""
    ckpt_dir, local = _checkpoint_dir(ckpt, out_dir), _local_dir(ckpt, out_dir)
    for where, flag in ((out_dir, "out_dir"), (ckpt_dir, "checkpoint.dir"), (local, LOCAL)):
        if where and lead:
            rundir.check_writable(where, flag)
    # checkpoints of their own (checkpoint.dir, the local tier): taken as well, so that two
    # runs with different run directories never write one checkpoint folder
    apart = lead and ckpt_dir and not (out_dir and ckpt_dir == out_dir / "checkpoints")
    taken = [(f, flag) for f, flag in ((apart and ckpt_dir, "checkpoint.dir"), (local, LOCAL)) if f]
    with contextlib.ExitStack() as held:
        if out_dir and lead:
            held.enter_context(rundir.writing(out_dir))
        for folder, flag in taken if lead else ():
            held.enter_context(rundir.writing(folder, flag))
        if restart:
            if lead:
                moved = rundir.set_aside(out_dir, ckpt_dir, local)
                say(
                    f"restart: set aside {', '.join(moved)}"
                    if moved
                    else "restart: nothing to set aside"
                )
                for folder, flag in taken:  # the folders taken went aside: take the fresh ones
                    held.enter_context(rundir.writing(folder, flag))
            if jax.process_count() > 1:  # the others must not open what process 0 moves
                multihost_utils.sync_global_devices("jaxpar restart")
                if local:  # a tier of each host's own: each process its folder, where left
                    rundir.set_aside(None, local / checkpoint.OWN.format(jax.process_index()))
        rundir.refuse_another_run(out_dir, ckpt_dir, local)
        yield


def finished_at(ckpt: Checkpoint, steps: int, out_dir: Path | None) -> int | None:
    """The step of a run that is done (its latest checkpoint at train.steps or past it),
    found without compiling anything; None while there is something to train."""
    ckpt_dir = _checkpoint_dir(ckpt, out_dir)
    if ckpt_dir is None or not ckpt_dir.is_dir():
        return None
    latest = checkpoint.Checkpoints(ckpt_dir, create=False).latest
    return latest if latest is not None and latest >= steps else None


def finished(step: int, steps: int) -> str:
    return (
        f"already at step {step} of train.steps={steps}: nothing to train (raise "
        "train.steps to go on, or --restart to start again)"
    )


def _finish(run, loop, rows: list, files: Path | None, saver, say, hooks) -> Report:
    """The report with the run's figures, the closing table, summary.json (with what the
    hooks add) and loss.png, and where a stopped run resumes from."""
    report = run.report
    if saver.newest is not None:
        report = report.trained(checkpoint=str(saver.where(saver.newest)))
    if loop.losses:  # (a stop before the first step leaves none)
        step_time = float(np.median(loop.times))
        report = report.trained(
            tokens_per_step=run.tokens_per_step,
            final_loss=loop.losses[-1],
            step_time_s=step_time,
            peak_flops_per_device=run.peak_flops,
            eval_loss=loop.eval_losses[-1][1] if loop.eval_losses else None,
            **_throughput(run, step_time),
        )
        first = loop.end - len(loop.losses) + 1  # this call's first step
        say(console.closing(report, loop.losses, rows, first))
    if report.checkpoint and not loop.stopped:
        say(f"weights: {report.checkpoint}")
    if files:
        extra = {k: v for hook in hooks for k, v in hook.summary().items()}
        if loop.spikes:
            extra["spikes"] = [spike.to_json() for spike in loop.spikes]
        metrics.write_json(files / rundir.SUMMARY, {**report.to_json(), **extra})
        metrics.plot_loss(rows, files / rundir.LOSS_PLOT, report.strategy)
    if loop.stopped:
        where = f"saved to {saver.where(loop.end)}" if saver.directory else "nothing saved"
        say(f"\nstopped by {loop.stopped} after step {loop.end}: {where}")
        say("run the same command to resume")
    return report


@dataclass
class Loop:
    state: object
    end: int  # steps done (the data position)
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    saved: set[int] = field(default_factory=set)  # steps checkpointed
    stopped: str | None = None  # the signal that ended it early
    nonfinite: int | None = None  # the first step (1-based) that was not finite, with `stop`
    diverged: str | None = None  # which copies of which leaves differed (replica check)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    failed: Exception | None = None  # what stopped a rollout (a reward function's failure)
    spikes: list[Spike] = field(default_factory=list)  # train.on_spike's, in order
    rollback: Spike | None = None  # a spike settled that the loop is to roll back from


def _evaluation(run: Run, eval_batches: Callable[..., dict]) -> Callable:
    """state -> {"eval_loss": the mean loss over train.eval_batches held-out batches, and
    eval_NAME: the mean of what the model reports as NAME} (one compiled forward step,
    in the training layout)."""
    sharding, shapes = run.engine.batch_sharding, run.step.batch_shapes
    n = run.cfg.train.eval_batches

    def evaluate(state) -> dict:
        losses, reports = zip(
            *(
                run.engine.evaluate(state, batch_for(eval_batches, i, sharding, shapes))
                for i in range(n)
            ),
            strict=True,
        )
        means = jax.tree.map(lambda *r: float(np.mean(r)), *jax.device_get(reports))
        return {
            "eval_loss": float(np.mean(jax.device_get(losses))),
            **{f"eval_{k}": v for k, v in sorted(means.items())},
            **{
                f"{console.EVAL_LOSS_OF}{name}": alone(state)["eval_loss"]
                for name, alone in each.items()
            },
        }

    each = {n: _evaluation(run, b) for n, b in getattr(eval_batches, "alone", {}).items()}
    return evaluate


def _fed(position: dict) -> dict:
    """A metrics row's figures of the data position: tokens fed, each source's epochs."""
    epochs = position["epochs"]
    named = list(epochs) != ["data"]  # a mixture's sources, by name
    tokens = {
        f"{console.TOKENS_FED}/{n}": d * position["seq_len"] for n, d in position["drawn"].items()
    }
    return {
        console.TOKENS_FED: position["tokens"],
        **(tokens if named else {}),
        **{f"epoch/{n}" if named else "epoch": e for n, e in epochs.items()},
    }


def _resumed_data(batches, saver, start: int, say):
    """`batches` from the checkpoint at `start` on: a feed (jaxpar.data.feed) at the
    position it recorded, saying what changed in the data since; others as they are."""
    resumed = getattr(batches, "resumed", None)
    if start and resumed is not None:
        batches, changes = resumed(start, saver.meta(start).get("data"))
        if changes:
            say(
                f"data: changed since step {start}'s checkpoint ({'; '.join(changes)}); each "
                "source goes on from the draws it recorded"
            )
    saver.position = getattr(batches, "position", None)
    return batches


def _throughput(run: Run, step_s: float) -> dict:
    return throughput.figures(
        run.flops_per_step, run.tokens_per_step, step_s, run.mesh.size, run.peak_flops
    )


@dataclass(frozen=True)
class LoopOptions:
    """What a loop does beside stepping: all off by default (the bench's bare loop)."""

    progress: bool = False  # a progress bar
    every: int = 0  # save every N steps, with `save(state, step)`
    save: Callable | None = None
    stops: _Stops | None = None  # signals that ask it to stop after the step in flight
    profile: Path | None = None  # steps train.profile_steps traced into this folder
    evaluate: Callable | None = None  # state -> held-out loss, every train.eval_every steps
    hooks: tuple[Hook, ...] = ()  # run around the steps (jaxpar.training.hooks)
    beat: Callable[[], None] = lambda: None  # after each step settles (train.hang_timeout_s)
    # train.on_spike=rollback: (checkpoint step, spiking step) -> that checkpoint's state,
    # its data position past the spiking batch
    rollback: Callable | None = None
    say: Callable[[str], None] = lambda _: None  # a line above the progress bar


def run_loop(
    run: Run,
    state,
    batches,
    log: metrics.MetricsLog,
    start: int = 0,
    opts: LoopOptions | None = None,
) -> Loop:
    """Run steps start+1 .. train.steps (with what `opts` adds). Step n is dispatched
    before step n-1's metrics are read (`settle`), so the device never waits on Python.
    A spike settled under train.on_spike=rollback drops the step in flight and goes on
    from the checkpoint before it (`opts.rollback`), past the batches since."""
    cfg, opts = run.cfg.train, opts or LoopOptions()
    compiled, sharding = run.step.executable, run.engine.batch_sharding
    loop = Loop(state, start)
    # closed however the loop ends (a full disk met by a save, too), before its error prints
    with tqdm(
        total=cfg.steps, initial=start, desc="train", unit="step", disable=not opts.progress
    ) as bar:
        rows = _Rows(run, loop, log, bar, opts, getattr(batches, "position", None))
        pending = None  # (step, metrics on device) of the step in flight
        trace = _Trace(cfg, opts.profile)
        step = start
        while True:
            if loop.rollback is not None:  # the steps run on from a spike are dropped
                pending, step = None, _rolled_back(loop, opts)
            if step >= cfg.steps or _halted(loop, opts, step):
                if pending is not None:
                    rows.settle(*pending)
                    pending = None
                    continue  # (a last step that spiked rolls back)
                break
            if working := [hook for hook in opts.hooks if hook.before_due(step)]:
                if pending is not None:  # its step time without the hooks' work
                    rows.settle(*pending)
                    pending = None
                    continue
                try:
                    rows.extra = _before(working, loop.state, step)
                except Stopped as e:
                    loop.failed = e
                    break
                rows.last = time.perf_counter()
            trace.before(step)
            with jax.profiler.StepTraceAnnotation("train", step_num=step + 1):
                batch = batch_for(batches, step, sharding, run.step.batch_shapes)
                loop.state, step_metrics = compiled(loop.state, batch)
            jax.monitoring.record_event(STEP_EVENT)  # for listeners: the test suite's profile
            trace.after(step, loop.state)
            step = loop.end = step + 1
            if pending is not None:
                rows.settle(*pending)
            pending = (step - 1, step_metrics)
            if loop.rollback is None:
                pending = _after_step(run, loop, opts, rows, pending)
        trace.stop()
    if loop.nonfinite is not None:  # `stop` froze the state at the last good step
        loop.end = loop.nonfinite - 1
    loop.stopped = opts.stops.asked if opts.stops and loop.end < cfg.steps else None
    return loop


def _halted(loop: Loop, opts: LoopOptions, step: int) -> bool:
    """Must the loop stop before `step`? A non-finite step (stop), diverged copies, or a
    signal, at a boundary every hook keeps (rollouts': where a resume rolls out)."""
    boundary = all(hook.boundary(step) for hook in opts.hooks)
    asked = opts.stops and opts.stops.asked and boundary
    return bool(loop.nonfinite is not None or loop.diverged or asked)


def _after_step(run: Run, loop: Loop, opts: LoopOptions, rows, pending):
    """What follows a dispatched step: the replica check, the evaluations and the save
    due after it (its row settled first). The metrics still in flight, or None."""
    cfg = run.cfg.train
    if run.check and loop.end % cfg.check_replicas_every == 0:
        loop.diverged = run.check(loop.state)
        if loop.diverged:
            return pending  # (saved by checkpoint.Saver.finish, as the state it is)
    due = [f for f in _due(opts, loop.end, cfg.eval_every) if f is not None]
    due_save = opts.every and loop.end % opts.every == 0
    if due or due_save:
        # this step's metrics row (and held-out scores) is written before its checkpoint
        # exists: a resume from it then misses no row
        rows.settle(*pending, evaluate=_together(due) if due else None)
        pending = None
    if due_save and loop.rollback is None:  # (never the state of a step that spiked)
        opts.save(loop.state, loop.end)  # blocks until the state is copied off the device
        loop.saved.add(loop.end)
    return pending


def _rolled_back(loop: Loop, opts: LoopOptions) -> int:
    """Back to the checkpoint before the spike `loop.rollback` names, the data position
    past the spiking batch: the step to go on from."""
    spike = loop.rollback
    loop.rollback = None
    loop.state = opts.rollback(spike.back_to, spike.step)
    loop.end = spike.step
    opts.beat()  # (a restore is progress: train.hang_timeout_s)
    return spike.step


class _Trace:
    """train.profile_steps traced with jax.profiler into `folder` (None: never)."""

    def __init__(self, train: Train, folder: Path | None):
        self.folder = folder
        self.span = profile_range(train) if folder else None
        self.on = False

    def before(self, step: int) -> None:
        if self.span and step + 1 == self.span[0]:
            jax.profiler.start_trace(str(self.folder))
            self.on = True

    def after(self, step: int, state) -> None:
        if self.on and step + 1 == self.span[1]:
            jax.block_until_ready(state)  # the last profiled step, whole, in the trace
            self.stop()

    def stop(self) -> None:  # (also where the loop stopped inside the span)
        if self.on:
            jax.profiler.stop_trace()
            self.on = False


def _due(opts: LoopOptions, steps: int, eval_every: int) -> list[Callable | None]:
    """The evaluations due after `steps` steps: the held-out loss, the hooks' figures."""
    loss = opts.evaluate if opts.evaluate is not None and steps % eval_every == 0 else None
    return [loss, *(hook.after for hook in opts.hooks if hook.due(steps))]


def _before(hooks: list[Hook], state, step: int) -> dict:
    """The hooks' work before step `step`: the columns its metrics row gains."""
    return {k: v for hook in hooks for k, v in (hook.before(state, step) or {}).items()}


def _hooks(hooks, rollouts, benchmarks) -> list[Hook]:
    """`hooks`, and the hooks that came by their old keywords (with the warning)."""
    old = {"rollouts": rollouts, "benchmarks": benchmarks}
    for name in (n for n, hook in old.items() if hook is not None):
        warnings.warn(
            f"train(..., {name}=...) is train(..., hooks=[...]) (jaxpar.training.hooks); "
            "the keyword goes in jaxpar 0.3.0",
            DeprecationWarning,
            stacklevel=3,
        )
    every = [*hooks, *(hook for hook in old.values() if hook is not None)]
    for hook in (h for h in every if not isinstance(h, Hook)):
        raise ConfigError(
            f"train(..., hooks=...): {type(hook).__name__} is not a jaxpar.Hook; subclass "
            "jaxpar.Hook and override the methods it needs (jaxpar.training.hooks)"
        )
    return every


def _together(evaluations: list[Callable]) -> Callable:
    return lambda state: {k: v for f in evaluations for k, v in f(state).items()}


class _Rows:
    """Each settled step's loss and times into `loop`, and its metrics row (every
    train.log_every steps, the first and last, and any not finite) into `log` and the
    progress bar."""

    def __init__(self, run: Run, loop: Loop, log: metrics.MetricsLog, bar, opts, position=None):
        self.run, self.loop, self.log, self.bar, self.opts = run, loop, log, bar, opts
        self.position = position
        self.start = loop.end  # a checkpoint where the loop resumed from one
        self.last = time.perf_counter()
        self.since_log: list[float] = []
        self.extra: dict = {}  # the columns of a rollout made for the next step settled

    def settle(self, step: int, device_metrics, evaluate: Callable | None = None) -> None:
        """Step `step`'s metrics read to the host (waiting for that step only); with
        `evaluate`, the held-out loss of the state now (its time kept out of the step's)."""
        cfg, loop = self.run.cfg.train, self.loop
        host = jax.device_get(device_metrics)
        self.opts.beat()
        now = time.perf_counter()
        loop.times.append(now - self.last)
        self.since_log.append(now - self.last)
        held_out = evaluate(loop.state) if evaluate else {}
        eval_loss = held_out.get("eval_loss")
        self.last = time.perf_counter()
        loss, grad_norm = float(host.loss), float(host.grad_norm)
        loop.losses.append(loss)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if not finite and cfg.on_nonfinite is OnNonfinite.STOP and loop.nonfinite is None:
            loop.nonfinite = step + 1
        spiked = bool(host.spike)
        if spiked:
            self._spiked(step + 1, loss, float(host.spike_limit))
        self.bar.update(1)
        if eval_loss is not None:
            loop.eval_losses.append((step + 1, eval_loss))
        extra, self.extra = self.extra, {}
        logged = (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps or step == 0
        if not (logged or not finite or eval_loss is not None or extra or spiked):
            return
        dt = float(np.mean(self.since_log))
        self.since_log.clear()
        row = {
            "step": step + 1,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": float(host.lr),
            "step_time_s": dt,
            **_throughput(self.run, dt),
            "skipped": int(host.skipped),
            "trained_tokens": int(host.targets),  # the loss's divisor: trained targets
            **held_out,
            **(_fed(self.position(step + 1)) if self.position else {}),
            **{name: float(value) for name, value in sorted(host.reports.items())},
            **({"update_s": dt, **extra} if extra else {}),
            **(spike_columns(host) if cfg.on_spike is not OnSpike.OFF else {}),
        }
        self.log.write(row)
        speed = (
            {"mfu": f"{row['mfu']:.1%}"}
            if row["mfu"] is not None
            else {"gflop_s": f"{row['flops_per_s_per_device'] / 1e9:.1f}"}
        )
        if loop.eval_losses:
            speed["eval"] = f"{loop.eval_losses[-1][1]:.4f}"
        if row.get("reward") is not None:  # an RL objective's rollouts, live
            speed["reward"] = f"{row['reward']:.3f}"
        if row.get(console.DROPPED) is not None:  # a mixture's drops, live
            speed["dropped"] = f"{row[console.DROPPED]:.0%}"
        self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", **speed)

    def _spiked(self, step: int, loss: float, limit: float) -> None:
        """A spike settled: said, kept, and under `rollback` the loop's to roll back from
        the newest checkpoint before it (where there is none, it stays skipped)."""
        cfg, loop = self.run.cfg.train, self.loop
        back_to = None
        if cfg.on_spike is OnSpike.ROLLBACK:
            before = [s for s in (*loop.saved, self.start) if 0 < s < step]
            back_to = max(before, default=None)
        spike = Spike(step, loss, limit, back_to)
        loop.spikes.append(spike)
        said = spike.said(cfg.spike_sigmas, cfg.spike_window)
        if cfg.on_spike is OnSpike.ROLLBACK and back_to is None:
            said += " (rollback: no checkpoint before it, so it is skipped)"
        self.opts.say(said)
        if back_to is not None:
            loop.rollback = spike


class _Stops:
    """SIGINT / SIGTERM during training: the first asks the loop to stop after the step
    in flight; a second exits at once (os._exit: no cleanup that could touch the last
    complete checkpoint, and orbax never takes a half-written one for the latest)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.asked: str | None = None
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.asked:
            os._exit(128 + signum)
        self.asked = name
        tqdm.write(f"\n{name}: stopping after this step and saving (again to exit at once)")

    def __enter__(self) -> _Stops:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _checkpoint_dir(ckpt: Checkpoint, out_dir: Path | None) -> Path | None:
    if ckpt.dir:
        return Path(ckpt.dir)
    return out_dir / "checkpoints" if out_dir else None


LOCAL = "checkpoint.local_dir"


def _local_dir(ckpt: Checkpoint, out_dir: Path | None) -> Path | None:
    """The local tier's folder, where the run has one (and a shared tier beside it)."""
    return Path(ckpt.local_dir) if ckpt.local_dir and _checkpoint_dir(ckpt, out_dir) else None


def _nonfinite_message(run: Run, state, batches, loop: Loop, saver: checkpoint.Saver) -> str:
    """Which step, and which parameters' gradients were not finite: recomputed from the
    saved last good state and that step's batch (the same computation as the step)."""
    step = loop.nonfinite
    batch = batch_for(batches, step - 1, run.engine.batch_sharding, run.step.batch_shapes)
    grads = jax.device_get(run.engine.grads(state, batch))
    bad = [
        leaf_key(path)
        for path, g in jax.tree_util.tree_leaves_with_path(grads)
        if not np.isfinite(g).all()
    ]
    leaves = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
    where = f"saved to {saver.where(step - 1)}" if saver.opened else "not saved (no --out)"
    return (
        f"step {step}: the loss or gradients are not finite "
        f"({'gradients of ' + leaves if bad else 'the loss'}); the state before it is "
        f"{where}. Lower train.lr, or set train.on_nonfinite=skip to step over such batches"
    )
