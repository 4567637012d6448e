"""Run a shipped preset on a sub-mesh and compare runs."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import math
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from jaxpar.compiled.run import Run, prepare
from jaxpar.config import presets
from jaxpar.cost.report import Report
from jaxpar.parallel.axes import AXES
from jaxpar.recipe import setup
from jaxpar.training.trainer import train

# data=2 x pipeline=2 x tensor=2, ZeRO-1, 1F1B: the 3D layout several tests share
THREE_D_1F1B = [
    "parallel.data=2",
    "parallel.pipeline=2",
    "parallel.tensor=2",
    "parallel.zero=1",
    "parallel.microbatches=2",
    "parallel.schedule=1f1b",
]


def _setup(preset: str, overrides):
    """(cfg, setup on as many devices as the degrees ask for)."""
    cfg = presets.load(preset, list(overrides))
    n = math.prod(max(getattr(cfg.parallel, a), 1) for a in AXES)
    return cfg, setup(cfg, jax.devices()[:n])


def _shipped(preset: str, overrides):
    """(cfg, mesh on as many devices as the degrees ask for, problem, batches)."""
    cfg, s = _setup(preset, overrides)
    return cfg, s.mesh, s.problem, s.batches


STEPS = 4  # optimizer steps a proof trains: enough to prove sharded optimizer state


def run(preset: str, overrides: list[str], steps: int = STEPS):
    """Train `preset` with `overrides` (and its held-out data, if it evaluates)."""
    cfg, s = _setup(preset, [f"train.steps={steps}", *overrides])
    return train(s.problem, cfg, s.batches, mesh=s.mesh, quiet=True, eval_batches=s.eval_batches)


@dataclass(frozen=True)
class Trained:
    """What a finished run leaves for comparison: every step's loss, final parameters,
    (QK-clip's) every step's largest attention logit, and the report of the program
    trained (its collectives, memory and figures: no second trace to read them)."""

    losses: list[float]
    params: dict
    max_logits: list = ()
    report: Report | None = None


def trained(preset: str, overrides=(), steps: int = STEPS) -> Trained:
    """`run`'s losses and parameters, trained once per test session for all the files
    and xdist workers that ask for the same run: keyed by the resolved config (so two
    spellings of one layout share it) and the devices; the others read it from the
    session's folder."""
    path = _run_file(preset, [f"train.steps={steps}", *overrides])
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one trains; the others wait, then read
        if not path.exists():
            result = run(preset, list(overrides), steps)
            logits = [row["attn/max_logit"] for row in result.rows if "attn/max_logit" in row]
            done = Trained(
                list(result.losses), jax.device_get(result.params), logits, result.report
            )
            path.write_bytes(pickle.dumps(done))
        return pickle.loads(path.read_bytes())


def _run_file(preset: str, overrides: list[str]) -> Path:
    """Where the session keeps the run of `preset` with `overrides` (their resolved
    config)."""
    cfg = presets.load(preset, overrides)
    what = json.dumps([presets.to_dict(cfg), preset], sort_keys=True, default=str)
    folder = Path(os.environ["JAXPAR_TEST_CACHE"]) / "runs"
    folder.mkdir(exist_ok=True)
    return folder / f"{hashlib.sha256(what.encode()).hexdigest()[:16]}.pkl"


def _trained_already(preset: str, overrides: list[str]) -> Trained | None:
    """The session's run of this config, if a test has trained it (None: none has)."""
    path = _run_file(preset, overrides)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # not while another process writes it
        return pickle.loads(path.read_bytes()) if path.exists() else None


ONE_DEVICE = ("parallel.replica=1", "parallel.data=1", "parallel.tensor=1")


def reference(preset: str, extra: tuple[str, ...] = (), steps: int = STEPS) -> Trained:
    """`preset` trained on ONE device (with `extra` overrides) for `steps` steps: the truth
    the parallel layouts are compared with (trained once per session)."""
    return trained(preset, (*ONE_DEVICE, *extra), steps)


def assert_same_training(result, reference, rtol: float = 1e-4, per_leaf: bool = True) -> None:
    """Every step's loss, and the final parameters, within relative `rtol`: each leaf
    (per_leaf) or the whole parameter vector. The whole-vector form is for models where
    even one device with grad_accum=4 versus 1 misses the per-leaf form: float32
    reassociation, amplified by Adam on near-zero gradients of small leaves (biases)."""
    losses, ref_losses = np.array(result.losses), np.array(reference.losses)
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol, atol=0)
    got_leaves = jax.tree_util.tree_leaves_with_path(result.params)
    want_leaves = jax.tree_util.tree_leaves_with_path(reference.params)
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
    pairs = [
        (jax.tree_util.keystr(path), np.asarray(got), np.asarray(want))
        for (path, got), (_, want) in zip(got_leaves, want_leaves, strict=True)
    ]
    if not per_leaf:
        diff = np.sqrt(sum(np.sum((g - w) ** 2) for _, g, w in pairs))
        err = diff / np.sqrt(sum(np.sum(w**2) for _, _, w in pairs))
        assert err <= rtol, f"parameters: relative error {err:.2e} > {rtol}"
        return
    for name, got, want in pairs:
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= rtol, f"parameter {name}: relative error {err:.2e} > {rtol}"


@functools.cache
@contextlib.contextmanager
def jax_durations(event: str):
    """The seconds of each `event` (one of jax's duration events, e.g.
    /jax/core/compile/backend_compile_duration) while the block runs."""
    seen = []

    def listen(name, seconds, **_):
        if name == event:
            seen.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:  # others' listeners stay (the suite profile's)
        jax.monitoring.unregister_event_duration_listener(listen)


def prepared(preset: str, overrides: tuple[str, ...]) -> Run:
    """A compiled (not run) step and its report. Of STEPS steps, unless the overrides say
    otherwise: the very program `trained` runs for the same layout (the schedule's length
    is in it), so that whichever of the two comes second reads it from the session's
    compilation cache instead of compiling it again. Kept in the process for the tests
    that ask for it again (tracing and lowering it again cost as much as a compile)."""
    if not any(o.startswith("train.steps=") for o in overrides):
        overrides = (f"train.steps={STEPS}", *overrides)
    return _prepared(preset, tuple(overrides))


@functools.lru_cache(maxsize=16)
def _prepared(preset: str, overrides: tuple[str, ...]) -> Run:
    cfg, mesh, problem, batches = _shipped(preset, overrides)
    return prepare(cfg, problem, mesh, batches(0))


def compile_only(preset: str, overrides: tuple[str, ...]) -> Report:
    """The report of a compiled (not run) step: memory, collectives, comm. The very
    program's report kept with its run where a test of the session has trained it (no
    trace, lowering or cache read again); else compiled (and kept in the process)."""
    done = _trained_already(preset, [f"train.steps={STEPS}", *overrides])
    return done.report if done is not None else prepared(preset, overrides).report


def training_env() -> dict:
    """The environment for a subprocess that trains tens of steps: XLA's backend at -O1
    instead of the suite's -O0 (conftest), where running the steps costs more than
    compiling them. The walk-through's 60-step fine-tune of tiny-llama: 3.0 s to
    compile against 2.1 s, 138 ms a step against 322 ms (28 s to 16 s in all)."""
    level = "--xla_backend_optimization_level="
    assert f"{level}0" in os.environ["XLA_FLAGS"], "conftest's -O0 has moved"
    return {**os.environ, "XLA_FLAGS": os.environ["XLA_FLAGS"].replace(f"{level}0", f"{level}1")}


def jaxpar_command(*args: str) -> subprocess.CompletedProcess:
    """`jaxpar ARGS` in a fresh process (so --cpu-devices really sets up jax)."""
    return subprocess.run(
        [sys.executable, "-m", "jaxpar.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def pair_keys(folder, objective: str, *more: str) -> tuple[str, ...]:
    """The run keys of a preference objective on the `folder` fixture's pairs: a row a
    pair, 8 pairs a step, plain SGD (`more` sets the rate, and overrides any of them)."""
    # fmt: off
    return ("model.vocab=512", "data.source=tokens", f"data.path={folder}",
            f"train.objective={objective}", "train.seq_len=96", "train.batch_size=8",
            "train.optimizer=sgd", "train.warmup=0", "train.clip_norm=0",
            "train.weight_decay=0", *more)
    # fmt: on


def one_line_error(capsys, *needles: str) -> str:
    """What the command printed to stderr is one `jaxpar: error:` line holding every
    needle; returns what it printed to stdout before it."""
    out, err = capsys.readouterr()
    assert err.startswith("jaxpar: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    return out


def perturb_one_copy(x: jax.Array, device_id: int, delta: float = 1e-3) -> jax.Array:
    """`x` with the copy (or block) on device `device_id` changed by `delta` at one
    element: a replica gone wrong, as a faulty device would leave it."""
    blocks = []
    for shard in x.addressable_shards:
        block = np.array(shard.data)
        if shard.device.id == device_id:
            block.reshape(-1)[0] += delta
        blocks.append(jax.device_put(block, shard.device))
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, blocks)


def script(name: str):
    """scripts/NAME.py as a module (what a test reuses of a script: a tokenizer maker,
    a data writer)."""
    import importlib.util

    path = Path(__file__).parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_drawn(model, directory: Path) -> Path:
    """A transformers `model` with every parameter drawn (norms' scales near 1, so that
    each block's output counts in the logits; biases and routers too, so that a wrong
    mapping shows; DeepSeek's balancing bias drawn away from 0, so that it chooses),
    saved to `directory` by its save_pretrained. The draws follow torch's generator as
    the caller seeded it (before building the model)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return directory


def changed_config(directory: Path, change: dict, to: Path) -> Path:
    """A checkpoint folder at `to`: `directory`'s files, linked, with its config.json
    updated by `change`."""
    to.mkdir()
    for f in directory.iterdir():
        if f.name != "config.json":
            (to / f.name).symlink_to(f)
    config = json.loads((directory / "config.json").read_text()) | change
    (to / "config.json").write_text(json.dumps(config))
    return to


def family_logits(cfg, params, tokens: np.ndarray) -> np.ndarray:
    """A registered Llama-family model's logits of `tokens` (one device, no step)."""
    import jaxpar
    from jaxpar.config import registry

    spec = registry.get(cfg.model.name)
    model = jaxpar.to_nnx(lambda rngs: spec.build(cfg.model, tokens.shape[1], rngs), params)
    x = jaxpar.scan_layers(model.blocks, model.embed(tokens), lambda block, h: block(h))
    return np.asarray(model.logits(x))


def run_logits_error(run: Path, want: np.ndarray, tokens: np.ndarray) -> float:
    """The largest gap between the logits of `tokens` by a run's saved parameters (a
    registered Llama-family model) and `want`, over want's scale."""
    import jaxpar
    from jaxpar.config import presets

    params, meta = jaxpar.training.checkpoint.saved_params(run / "checkpoints")
    cfg = presets.from_dict(meta["config"])
    return float(np.abs(family_logits(cfg, params, tokens) - want).max() / np.abs(want).max())
