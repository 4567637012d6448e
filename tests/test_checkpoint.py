"""Checkpoints: exact resume, restore into another layout, stops, kills, NaN, bad input."""

import dataclasses
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import THREE_D_1F1B, jax_durations, one_line_error
from safetensors.numpy import load_file

import jaxpar
from jaxpar.cli import main as cli
from jaxpar.config import presets, registry
from jaxpar.parallel.axes import AXES
from jaxpar.recipe import setup as model_setup
from jaxpar.step.build import build
from jaxpar.training import export


def setup(overrides):
    cfg = presets.load("gpt-tiny", list(overrides))
    n = math.prod(max(getattr(cfg.parallel, a), 1) for a in AXES)
    s = model_setup(cfg, jax.devices()[:n])
    return cfg, s.mesh, s.problem, s.batches


def train(overrides, out, batches=None, **kwargs):
    cfg, mesh, problem, shipped = setup(overrides)
    return jaxpar.train(
        problem, cfg, batches or shipped, mesh=mesh, out_dir=out, quiet=True, **kwargs
    )


def stopping_at(step, batches):
    """Batches that send this process SIGTERM when step `step` is asked for: the run
    stops after that step, as a Ctrl-C or a cluster's preemption would stop it."""

    def batch(i):
        if i == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return batches(i)

    return batch


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_identical(a, b):
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


# (plain data parallelism is inside each layout here, and resumes alone, data=2, in
# test_kill_9_where_it_can_hurt_resumes_to_the_straight_run)
RESUME = {
    "zero3-tp": ["parallel.data=4", "parallel.tensor=2", "parallel.zero=3"],
    "3d-1f1b": THREE_D_1F1B,
    # DiLoCo with tensor parallelism, saved between averages: each copy and its AdamW state
    "diloco-tp": [
        "parallel.data=4",
        "parallel.tensor=2",
        "parallel.dp_sync=params",
        "parallel.sync_every=3",
        "parallel.outer_lr=0.7",
        "parallel.outer_momentum=0.9",
    ],
    # Muon's momentum on each layer's owner (4 layers over data=4), its AdamW part sliced
    "muon-zero2-tp": [
        "parallel.data=4",
        "parallel.tensor=2",
        "parallel.zero=2",
        "train.optimizer=muon",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUME)
def test_resume_is_bit_identical(devices, tmp_path, name):
    """10 steps straight == 6 steps, a SIGTERM, and 4 resumed: every loss, every bit of
    the parameters, and metrics.jsonl with each step once."""
    overrides = [*RESUME[name], "train.steps=10", "checkpoint.every=4"]
    straight = train(overrides, tmp_path / "straight")
    _, _, _, batches = setup(overrides)
    first = train(overrides, tmp_path / "stopped", stopping_at(5, batches))
    assert first.stopped == "SIGTERM" and len(first.losses) == 6
    assert sorted(os.listdir(tmp_path / "stopped" / "checkpoints")) == ["4", "6"]
    resumed = train(overrides, tmp_path / "stopped")
    assert len(resumed.losses) == 4
    rows = [
        json.loads(x) for x in (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert losses(tmp_path / "stopped") == losses(tmp_path / "straight")
    assert_identical(resumed.params, straight.params)


def tiers(out: Path) -> list[str]:
    """A save every step to a local tier beside the run directory, every second one (and
    the last) to the shared tier, its checkpoints/."""
    local = out.with_name(f"{out.name}-local")
    return ["checkpoint.every=1", "checkpoint.shared_every=2", f"checkpoint.local_dir={local}"]


@pytest.mark.slow
def test_a_local_tier_takes_the_frequent_saves_and_a_resume_reads_the_newer(devices, tmp_path):
    """checkpoint.local_dir: steps 1 and 3 saved to the local tier, 2 to the shared one
    (and 3, the last, there too). A run stopped after step 3 and killed before its last
    save reached the shared tier resumes from the local tier's step 3; the same, its
    local tier lost with its machine, from the shared tier's step 2: each to the straight
    run's losses, each step once, and every bit of its parameters."""
    layout = ["parallel.data=4", "parallel.tensor=2", "parallel.zero=1", "train.steps=5"]
    run = {name: tmp_path / name for name in ("straight", "stopped", "lost")}
    straight = train([*layout, *tiers(run["straight"])], run["straight"])
    _, _, _, batches = setup(layout)
    stopped = [*layout, *tiers(run["stopped"])]
    assert len(train(stopped, run["stopped"], stopping_at(2, batches)).losses) == 3
    local = run["stopped"].with_name("stopped-local")
    assert sorted(os.listdir(local)) == [".lock", "1", "3"]
    assert sorted(os.listdir(run["stopped"] / "checkpoints")) == ["2", "3"]
    shutil.rmtree(run["stopped"] / "checkpoints" / "3")  # as a kill -9 leaves the tiers
    assert export.run_params(run["stopped"])[1]["step"] == 3  # jaxpar export: the newest
    shutil.copytree(run["stopped"], run["lost"])  # the same run on a machine without them
    for out, back_to in ((run["stopped"], 3), (run["lost"], 2)):
        resumed = train([*layout, *tiers(out)], out)
        assert len(resumed.losses) == 5 - back_to
        assert losses(out) == losses(run["straight"])  # each of the 5 steps once
        assert_identical(resumed.params, straight.params)
    assert sorted(os.listdir(run["lost"] / "checkpoints")) == ["2", "4", "5"]


LAYOUTS = {
    "dp8-zero0 -> 3d-zero3": (
        ["parallel.data=8", "parallel.zero=0"],
        [
            "parallel.data=2",
            "parallel.pipeline=2",
            "parallel.tensor=2",
            "parallel.zero=3",
            "parallel.microbatches=2",
        ],
    ),
    "tp4 -> one device": (["parallel.data=1", "parallel.tensor=4"], ["parallel.data=1"]),
    "zbv -> 1f1b": (  # out of a V's stages, into 1F1B's
        [
            "parallel.data=2",
            "parallel.pipeline=2",
            "parallel.microbatches=2",
            "parallel.schedule=zbv",
        ],
        ["parallel.data=2", "parallel.pipeline=2", "parallel.microbatches=2"],
    ),
    "cp4 zero3 -> dp2 cp2 tp2 sp": (
        ["parallel.data=2", "parallel.context=4", "parallel.zero=3"],
        [
            "parallel.data=2",
            "parallel.context=2",
            "parallel.tensor=2",
            "parallel.sequence_parallel=true",
        ],
    ),
    "offloaded 1f1b -> zero3 offloaded params": (
        [
            "parallel.data=2",
            "parallel.pipeline=2",
            "parallel.tensor=2",
            "parallel.zero=1",
            "parallel.microbatches=2",
            "parallel.offload=optimizer",
        ],
        [
            "parallel.data=4",
            "parallel.tensor=2",
            "parallel.zero=3",
            "parallel.offload=optimizer+params",
        ],
    ),
}


@pytest.mark.slow
def test_muon_trains_on_in_another_layout(devices, tmp_path):
    """Muon's momentum, saved from each layer's owner (4 layers over data=4 x tensor=2,
    ZeRO-2), read into data=2 x pipeline=2 (no owners: each stage's layers whole) and
    trained on: the straight run's losses and parameters."""
    muon = ["train.optimizer=muon", "checkpoint.every=2"]
    saved_as = ["parallel.data=4", "parallel.tensor=2", "parallel.zero=2", *muon]
    straight = train([*saved_as, "train.steps=3"], tmp_path / "straight")
    train([*saved_as, "train.steps=2"], tmp_path / "moved")
    moved_as = ["parallel.data=2", "parallel.pipeline=2", "parallel.microbatches=2", *muon]
    resumed = train([*moved_as, "train.steps=3"], tmp_path / "moved")
    assert len(resumed.losses) == 1
    np.testing.assert_allclose(losses(tmp_path / "moved"), straight.losses, rtol=1e-5)
    same = lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # noqa: E731
    jax.tree.map(same, jax.device_get(resumed.params), jax.device_get(straight.params))


@pytest.mark.slow
@pytest.mark.parametrize("pair", LAYOUTS)
def test_restore_into_another_layout(devices, tmp_path, pair):
    saved_as, restored_as = LAYOUTS[pair]
    steps = ["train.steps=2", "checkpoint.every=2"]
    result = train([*saved_as, *steps], tmp_path)
    cfg, mesh, problem, _ = setup([*restored_as, *steps])
    state = jaxpar.restore(tmp_path / "checkpoints", problem, cfg, mesh)
    engine = build(problem, cfg, mesh)
    assert int(state.step) == 2
    assert_identical(engine.export(state.params), result.params)
    # every leaf lives where the new run's plan puts it, not where it was saved from
    for got, want in zip(
        jax.tree.leaves(state.params), jax.tree.leaves(engine.state_shardings.params), strict=True
    ):
        assert got.sharding.is_equivalent_to(want, got.ndim)


@pytest.mark.slow
def test_sigterm_saves_and_exits_0(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxpar.cli.main",
            "train",
            "--config",
            "gpt-tiny",
            "--cpu-devices",
            "2",
            "parallel.data=2",
            "train.steps=100000",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    (saved,) = os.listdir(out / "checkpoints")  # checkpoint.every=0: only the stop saves
    assert (
        f"stopped by SIGTERM after step {saved}: saved to {out / 'checkpoints' / saved}" in output
    )
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert rows[-1]["step"] == int(saved)
    assert "WARNING" not in output  # orbax's, on making the save's handlers, was printed


# A `jaxpar train` that kills itself (SIGKILL: no handler, no cleanup) at one moment of
# step or save K, or during its restore: the moments a kill -9 can hurt.
KILLING = """
import os, signal, sys, threading
from jaxpar.cli.main import main
from jaxpar.training import checkpoint, trainer

where, k = sys.argv[1], int(sys.argv[2])
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
if where == "mid-step":  # step K-1 running on the devices, K's batch being read
    fetch = trainer.batch_for
    trainer.batch_for = lambda f, i, *a: die() if i == k else fetch(f, i, *a)
elif where == "in-save":  # save K started: its files being written in the background
    save = checkpoint.Checkpoints.save
    checkpoint.Checkpoints.save = lambda self, step, *a: (save(self, step, *a), step == k and die())
elif where == "at-commit":  # save K written in full, its folder not yet renamed into place
    rename = os.rename
    os.rename = lambda src, dst: die() if os.path.basename(dst) == str(k) else rename(src, dst)
elif where == "in-restore":  # the resume's restore under way
    restore = checkpoint.Checkpoints.restore
    def restoring(self, *a):
        threading.Timer(0.05, die).start()  # inside the restore, or at its end at the latest
        restore(self, *a)
        die()
    checkpoint.Checkpoints.restore = restoring
sys.exit(main(sys.argv[3:]))
"""
KILLS = {  # trial -> the kills before the run that finishes, each (where, K)
    "mid-step": [("mid-step", 4)],
    "in-save": [("in-save", 3)],
    "at-commit": [("at-commit", 3)],
    "in-restore": [("in-save", 3), ("in-restore", 0)],
}


@pytest.mark.slow
def test_kill_9_where_it_can_hurt_resumes_to_the_straight_run(tmp_path):
    """kill -9 mid-step, inside an asynchronous save, between a save and its commit,
    and during a restore; then the same command again until it finishes: each run ends
    with the straight run's losses, every step once."""
    args = ["train", "--config", "gpt-tiny", "--cpu-devices", "2", "parallel.data=2"]
    args += ["train.steps=6", "checkpoint.every=1", "checkpoint.keep=2"]
    args += ["data.source=synthetic"]

    def command(out, kill=("none", 0)):
        return [sys.executable, "-c", KILLING, *map(str, kill), *args, "--out", str(out)]

    straight = subprocess.run(command(tmp_path / "straight"), capture_output=True, text=True)
    assert straight.returncode == 0, straight.stderr
    for trial, kills in KILLS.items():
        out = tmp_path / trial
        for kill in kills:
            killed = subprocess.run(command(out, kill), capture_output=True, text=True)
            assert killed.returncode == -signal.SIGKILL, f"{trial} {kill}: {killed.stderr}"
        done = subprocess.run(command(out), capture_output=True, text=True)
        assert done.returncode == 0, f"{trial}: {done.stderr}"
        assert losses(out) == losses(tmp_path / "straight"), trial


def nan_problem():
    """A least-squares model whose batch of step 3 (the 4th step) holds a NaN."""

    def init(key):
        return {"w": jax.random.normal(key, (8, 8)) * 0.1, "b": jnp.zeros((8,))}

    def loss(params, batch):
        return jnp.mean((batch["x"] @ params["w"] + params["b"][None] - batch["y"]) ** 2, axis=-1)

    def batches(step):
        rng = np.random.default_rng(step)
        x = rng.normal(size=(16, 8)).astype(np.float32)
        if step == 3:
            x[0, 0] = np.nan
        return {"x": x, "y": x[:, ::-1].copy()}

    return jaxpar.from_pytree(
        init, loss, [("w", (jaxpar.EMBED, jaxpar.MLP)), ("b", (jaxpar.MLP,))]
    ), batches


def nan_config(mode, steps=6):
    return jaxpar.Config(
        parallel=jaxpar.Parallel(data=4, zero=1),
        train=jaxpar.Train(steps=steps, batch_size=16, lr=1e-2, on_nonfinite=mode),
        checkpoint=jaxpar.Checkpoint(every=2),
    )


@pytest.mark.slow
def test_nonfinite_stop_saves_the_last_good_state(devices, tmp_path):
    problem, batches = nan_problem()
    mesh = jaxpar.build_mesh(jaxpar.Parallel(data=4), devices[:4])
    with pytest.raises(jaxpar.NonFinite, match=r"step 4: .*gradients of b, w\).*checkpoints/3"):
        jaxpar.train(problem, nan_config("stop"), batches, mesh=mesh, out_dir=tmp_path, quiet=True)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "3"]
    good = jaxpar.train(problem, nan_config("stop", steps=3), batches, mesh=mesh, quiet=True)
    state = jaxpar.restore(tmp_path / "checkpoints", problem, nan_config("stop"), mesh)
    assert int(state.step) == 3 and int(state.skipped) == 0
    assert_identical(state.params, good.params)


def test_nonfinite_skip_leaves_the_state_and_counts(devices):
    problem, batches = nan_problem()
    mesh = jaxpar.build_mesh(jaxpar.Parallel(data=4), devices[:4])
    result = jaxpar.train(problem, nan_config("skip"), batches, mesh=mesh, quiet=True)
    assert [r["skipped"] for r in result.rows] == [0, 0, 0, 1, 1, 1]
    assert result.rows[3]["loss"] is None  # not finite: null in metrics.jsonl
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(result.rows) if i != 3)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.params))


@pytest.mark.slow
def test_nonfinite_stop_exits_3_from_the_command(tmp_path, capsys, devices, monkeypatch):
    # no learning rate in train.lr's range diverges within a few steps: an infinite loss
    gpt = registry.get("gpt")
    infinite = dataclasses.replace(gpt, loss=lambda m, b: gpt.loss(m, b) * jnp.inf)
    monkeypatch.setitem(registry._SPECS, "gpt", infinite)
    code = cli.main(
        [
            "train",
            "--config",
            "gpt-tiny",
            "parallel.data=8",
            "train.steps=6",
            "--out",
            str(tmp_path),
        ]
    )
    last = capsys.readouterr().err.strip().splitlines()[-1]  # (the progress bar is above)
    assert code == 3, last
    assert last.startswith("jaxpar: stopped: step ") and "not finite" in last


def run_cli(*argv):
    return cli.main(["train", "--config", "gpt-tiny", "parallel.data=8", "train.steps=2", *argv])


@pytest.mark.slow
def test_checkpoint_of_another_model_exits_2(tmp_path, capsys, devices):
    assert run_cli("checkpoint.every=2", "--out", str(tmp_path)) == 0
    capsys.readouterr()
    assert run_cli("train.steps=4", "model.embed=128", "--out", str(tmp_path)) == 2
    needles = ("parameter blocks/attn/wo", "saved from another model", "--restart")
    said = one_line_error(capsys, *needles)
    assert "resuming" not in said  # said only once the restore holds


@pytest.mark.slow
def test_averaged_copies_resume_only_as_they_were_saved(tmp_path, capsys, devices):
    averaged = ["parallel.data=8", "parallel.dp_sync=params", "parallel.sync_every=2"]
    train([*averaged, "train.steps=2", "checkpoint.every=2"], tmp_path)
    argv = ["train", "--config", "gpt-tiny", "--cpu-devices", "8", "--out", str(tmp_path)]
    assert cli.main([*argv, "parallel.data=4", "parallel.tensor=2", *averaged[1:]]) == 2
    saved = "saved with dp_sync=params over data=8, but this run has dp_sync=params over data=4"
    one_line_error(capsys, saved, "resume with the same parallel.dp_sync")


@pytest.mark.slow
def _garbage(state: Path) -> None:
    for root, _, files in os.walk(state):
        for name in files:
            (Path(root) / name).write_bytes(b"\x00garbage" * 7)


CORRUPTIONS = {  # what a disk or a copy cut short does to a saved state, and its name
    "every file garbage": (_garbage, "JSONDecodeError"),
    "array chunks gone": (
        lambda state: [f.unlink() for f in state.glob("ocdbt.process_*/d/*")],
        "Error reading",
    ),
    "array chunks truncated": (
        lambda state: [os.truncate(f, 10) for f in state.glob("ocdbt.process_*/d/*")],
        "Error reading",
    ),
    "manifest truncated": (
        lambda state: os.truncate(state / "manifest.ocdbt", 5),
        "manifest.ocdbt",
    ),
    "index gone": (lambda state: (state / "_METADATA").unlink(), "state/_METADATA"),
}


@pytest.mark.slow
def test_corrupt_checkpoint_exits_2(tmp_path, capsys, devices):
    """Each corruption, resumed or exported: one line naming the checkpoint and what is
    wrong in TensorStore's words (no spec, no pybind text, no echo of the reads still in
    flight), nothing said of resuming; the run directory as it was. So for a spoilt
    metrics.jsonl, which a resume would otherwise rewrite without its lines."""
    assert run_cli("checkpoint.every=2", "--out", str(tmp_path / "saved")) == 0
    capsys.readouterr()
    for name, (corrupt, needle) in CORRUPTIONS.items():
        run = tmp_path / name.replace(" ", "-")
        shutil.copytree(tmp_path / "saved", run)
        corrupt(run / "checkpoints" / "2" / "state")
        assert run_cli("train.steps=4", "--out", str(run)) == 2, name
        said = one_line_error(capsys, "checkpoints/2: cannot be read", needle, "--restart")
        assert "resuming" not in said, name
        assert sorted(os.listdir(run / "checkpoints")) == ["2"], name
        assert cli.main(["export", str(run), "--to", str(run / "w.safetensors")]) == 2, name
        one_line_error(capsys, "checkpoints/2: cannot be read", needle)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "pybind" not in err, err
    # metrics.jsonl spoilt past a torn last row: refused, and left as it was
    run = tmp_path / "metrics-spoilt"
    shutil.copytree(tmp_path / "saved", run)
    rows = run / "metrics.jsonl"
    rows.write_bytes(b"\x89PNG\r\n\x1a\n" + rows.read_bytes())
    spoilt = rows.read_bytes()
    assert run_cli("train.steps=4", "--out", str(run)) == 2
    one_line_error(capsys, "metrics.jsonl:1: not a JSON row of metrics", "move the file away")
    assert rows.read_bytes() == spoilt
    # cut inside the row of step 2, which checkpoint 2 was saved after: rows a kill
    # cannot tear are lost, so refused, and left as it was
    run = tmp_path / "metrics-cut"
    shutil.copytree(tmp_path / "saved", run)
    rows = run / "metrics.jsonl"
    cut = rows.read_bytes()[: rows.read_bytes().index(b'{"step": 2') + 12]
    rows.write_bytes(cut)
    assert run_cli("train.steps=4", "--out", str(run)) == 2
    one_line_error(capsys, "rows end at step 1", "checkpoint of step 2", "row of step 2")
    assert rows.read_bytes() == cut


def test_two_runs_never_share_a_checkpoint_dir(tmp_path, capsys, devices):
    """checkpoint.dir taken by another run (its lock held here, as a live run holds it):
    refused in one line naming the process, with nothing made."""
    from jaxpar.training import rundir

    held = rundir.lock(tmp_path / "ckpt", "checkpoint.dir")
    try:
        argv = [f"checkpoint.dir={tmp_path / 'ckpt'}", "--out", str(tmp_path / "b")]
        assert run_cli(*argv) == 2
    finally:
        held.close()
    one_line_error(capsys, f"checkpoint.dir={tmp_path / 'ckpt'}", f"process {os.getpid()}")
    assert not (tmp_path / "b").exists()


def test_checkpoint_dir_that_is_a_file_exits_2(tmp_path, capsys, devices):
    (tmp_path / "ckpt").write_text("not a directory")
    assert run_cli(f"checkpoint.dir={tmp_path / 'ckpt'}", "--out", str(tmp_path / "run")) == 2
    one_line_error(capsys, "is a file, not a directory")


def test_unreadable_checkpoint_dir_exits_2(tmp_path, capsys, devices, monkeypatch):
    # (these tests run as root, whom permissions do not stop: ask the check itself)
    (tmp_path / "ckpt").mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(tmp_path / "ckpt"))
    assert run_cli(f"checkpoint.dir={tmp_path / 'ckpt'}", "--out", str(tmp_path / "run")) == 2
    one_line_error(capsys, "cannot be read and written")


@pytest.mark.slow
def test_a_run_directory_without_checkpoints_is_not_overwritten(tmp_path, capsys, devices):
    assert run_cli("checkpoint.final=false", "--out", str(tmp_path)) == 0
    before = (tmp_path / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert run_cli("checkpoint.final=false", "--out", str(tmp_path)) == 2
    one_line_error(capsys, "holds a run", "--restart")
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert run_cli("checkpoint.final=false", "--restart", "--out", str(tmp_path)) == 0
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("set-aside-")]
    assert (aside / "metrics.jsonl").read_text() == before
    assert "restart: set aside" in capsys.readouterr().out


def test_one_process_writes_a_replicated_array_whole(devices, tmp_path):
    """orbax's replica-parallel write slices a replicated array, one slice a replica (a
    compiled program each: 3,159 of the suite's 5,437 compiles); in one process, where
    every replica is on this host, jaxpar's handler writes it whole: the save traces no
    program, and the array reads back equal. (Two processes write in parallel:
    test_distributed.py's checkpoints move between two processes and one.)"""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxpar.training.checkpoint import Checkpoints

    everywhere = NamedSharding(jax.make_mesh((8,), ("data",)), PartitionSpec())
    x = jax.device_put(np.arange(24 * 40, dtype=np.float32).reshape(24, 40), everywhere)
    jax.block_until_ready(x)
    checkpoints = Checkpoints(tmp_path / "ck")
    with jax_durations("/jax/core/compile/jaxpr_trace_duration") as traced:
        checkpoints.save(1, {"x": x}, {"step": 1})
        checkpoints.wait()
    assert traced == []
    like = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=everywhere)
    assert np.array_equal(checkpoints.restore(1, {"x": like})["x"], x)


@pytest.mark.slow
def test_saving_every_step_hands_orbax_the_state_itself_and_the_step_keeps_it(devices):
    """checkpoint.every=1: the step does not donate its state (its program aliases no
    input to an output), so a save hands orbax the state's own arrays, with no copy to
    hold the loop; at every=2 the step donates, and a save copies."""
    from helpers import prepared

    from jaxpar.training import checkpoint

    for every, donates in ((1, False), (2, True)):
        run = prepared("gpt-tiny", ("parallel.data=2", f"checkpoint.every={every}"))
        assert run.engine.donates is donates
        assert ("input_output_alias" in run.step.hlo) is donates
        layout = checkpoint.layout(run.problem, run.engine, run.mesh, 0, run.cfg.train.precision)
        state = run.engine.init(jax.random.key(0))
        saved = layout.to_saved(state)["params"]
        pointers = lambda x: [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]  # noqa: E731
        own = [pointers(saved[k]) == pointers(x) for k, x in state.params.items()]
        assert all(own) if not donates else not any(own)


def test_arrays_are_saved_uncompressed_unless_asked_and_either_restores(devices, tmp_path):
    """checkpoint.compress=false (the default) writes the arrays as they are; true has
    orbax zstd them (a run's Saver passes the key on): a compressible state then takes a
    fraction of the bytes. A run resumes from either, whatever its own key says."""
    from jaxpar.training.checkpoint import Checkpoints, Saver

    state = {"x": jnp.zeros((256, 256)), "y": jnp.arange(4096.0)}
    like = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )
    sizes = {}
    for compress in (False, True):
        cfg = jaxpar.Config(checkpoint=jaxpar.Checkpoint(every=1, compress=compress))
        saver = Saver(cfg, tmp_path / str(compress))
        saver.ckpts.save(1, state, {"step": 1})
        saver.ckpts.close()
        files = (tmp_path / str(compress) / "1" / "state").rglob("*")
        sizes[compress] = sum(f.stat().st_size for f in files if f.is_file())
        other = Checkpoints(tmp_path / str(compress), compress=not compress)
        assert_identical(other.restore(1, like), state)
    assert sizes[False] > (256 * 256 + 4096) * 4 > 10 * sizes[True], sizes


@pytest.mark.slow
def test_export_writes_safetensors_in_the_model_layout(tmp_path, capsys, devices):
    overrides = [
        "parallel.data=2",
        "parallel.pipeline=2",
        "parallel.tensor=2",
        "parallel.microbatches=2",
        "train.steps=2",
        "checkpoint.every=2",
    ]
    result = train(overrides, tmp_path / "run")
    assert cli.main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "m.safetensors")]) == 0
    assert "of step 2" in capsys.readouterr().out
    umask = os.umask(0)
    os.umask(umask)  # readable as the umask allows (safetensors alone writes 0600)
    assert stat.S_IMODE((tmp_path / "m.safetensors").stat().st_mode) == 0o666 & ~umask
    exported = load_file(str(tmp_path / "m.safetensors"))  # safetensors alone, no jaxpar
    assert set(exported) == set(result.params)
    for key, value in exported.items():
        np.testing.assert_array_equal(value, np.asarray(result.params[key]))
    cfg, _, problem, batches = setup(overrides)
    model = jaxpar.to_nnx(
        lambda rngs: registry.get("gpt").build(cfg.model, cfg.train.seq_len, rngs),
        jaxpar.load_exported(tmp_path / "m.safetensors"),
    )
    np.testing.assert_array_equal(model.head[...], exported["head"])
    per_token = registry.get("gpt").loss(model, batches(0))
    assert per_token.shape == (16, 64) and bool(jnp.isfinite(per_token).all())


def test_export_without_checkpoints_exits_2(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path), "--to", str(tmp_path / "m.safetensors")]) == 2
    one_line_error(capsys, "no complete checkpoint")
