"""Loss spikes (train.on_spike): the rule against NumPy, a spiking batch skipped or rolled
back in several layouts, each equal to a run that never read the batches it dropped,
the window resumed with the state, and the bad input."""

import dataclasses
import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import THREE_D_1F1B, one_line_error

import jaxpar
from jaxpar.cli import main as cli
from jaxpar.config import presets
from jaxpar.errors import ConfigError
from jaxpar.parallel.axes import AXES
from jaxpar.recipe import setup as model_setup
from jaxpar.step import spikes

SPIKE = 5  # the batch (0-based) made to spike: step 6


def test_the_limit_is_the_windows_mean_and_deviations_once_half_full():
    rng = np.random.default_rng(0)
    losses = rng.normal(3.0, 0.2, size=11).astype(np.float32)
    window, n = spikes.empty(4), 4
    applied = [True, True, False, True, True, True, False, True, True, True, True]
    kept = []
    for loss, ok in zip(losses, applied, strict=True):
        limit = float(spikes.limit(window, 2.5))
        last = np.array(kept[-n:], np.float64)
        expected = last.mean() + 2.5 * last.std() if len(last) >= n // 2 else math.inf
        np.testing.assert_allclose(limit, expected, rtol=1e-6)
        window = spikes.after(window, jnp.float32(loss), jnp.bool_(ok), jnp.bool_(not ok))
        kept += [loss] if ok else []
    assert int(window.seen) == 9 and int(window.spikes) == 2
    spike, _ = spikes.judged(jnp.float32(np.inf), window, 2.5)
    assert not spike  # a loss that is not finite is train.on_nonfinite's


def least_squares():
    def init(key):
        return {"w": jax.random.normal(key, (8, 8)) * 0.1, "b": jnp.zeros((8,))}

    def loss(params, batch):
        return jnp.mean((batch["x"] @ params["w"] + params["b"][None] - batch["y"]) ** 2, axis=-1)

    names = [("w", (jaxpar.EMBED, jaxpar.MLP)), ("b", (jaxpar.MLP,))]
    return jaxpar.from_pytree(init, loss, names)


def batch(i):
    """Batch i of a least-squares run; batch SPIKE's inputs are 30 times as large."""
    x = np.random.default_rng(i).normal(size=(16, 8)).astype(np.float32)
    x = x * 30 if i == SPIKE else x
    return {"x": x, "y": x[:, ::-1].copy()}


def without(first: int, last: int, batches=batch):
    """The batches with first..last (0-based, both in) never read."""
    return lambda i: batches(i if i < first else i + last - first + 1)


LAYOUTS = {
    "data4-zero1": jaxpar.Parallel(data=4, zero=1),
    "data2-tensor2": jaxpar.Parallel(data=2, tensor=2),
    "offload": jaxpar.Parallel(data=4, zero=1, offload="optimizer"),
    # (averaging every step: the copies' cadence is in data positions, see docs)
    "dp_sync-params": jaxpar.Parallel(data=4, dp_sync="params", sync_every=1),
}


def config(par, mode, steps=10, every=0):
    train = jaxpar.Train(steps=steps, batch_size=16, lr=1e-2, on_spike=mode, spike_window=4)
    return jaxpar.Config(parallel=par, train=train, checkpoint=jaxpar.Checkpoint(every=every))


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_skipped_spike_leaves_the_run_a_run_without_its_batch(devices, name):
    par, problem = LAYOUTS[name], least_squares()
    mesh = jaxpar.build_mesh(par, devices[:4])
    spiked = jaxpar.train(problem, config(par, "skip"), batch, mesh=mesh, quiet=True)
    assert [r["spiked"] for r in spiked.rows] == [0] * SPIKE + [1] + [0] * 4
    assert spiked.rows[SPIKE]["loss"] > 100 * spiked.rows[SPIKE]["spike_limit"]
    assert spiked.rows[0]["spike_limit"] is None  # judged from half the window on
    dropped = without(SPIKE, SPIKE)
    straight = jaxpar.train(problem, config(par, "skip"), dropped, mesh=mesh, quiet=True)
    assert spiked.losses[SPIKE + 1 :] == straight.losses[SPIKE:9]
    off = jaxpar.train(problem, config(par, "off"), dropped, mesh=mesh, quiet=True)
    assert off.losses == straight.losses  # watching changes nothing where nothing spikes


def test_rollback_returns_to_the_checkpoint_and_skips_the_batches_since(devices, tmp_path, capsys):
    par, problem = LAYOUTS["data4-zero1"], least_squares()
    mesh = jaxpar.build_mesh(par, devices[:4])
    cfg = config(par, "rollback", every=3)
    rolled = jaxpar.train(problem, cfg, batch, mesh=mesh, out_dir=tmp_path, progress=False)
    said = capsys.readouterr().out
    assert "step 6: the loss" in said
    assert "rolled back to step 3's checkpoint, skipping batches 4-6" in said
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11)) and rows[SPIKE]["spiked"] == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(s["step"], s["back_to"]) for s in summary["spikes"]] == [(6, 3)]
    straight = jaxpar.train(problem, config(par, "off"), without(3, SPIKE), mesh=mesh, quiet=True)
    assert rolled.losses[6:] == straight.losses[3:7]
    # resumed from its last checkpoint (9), the window read with the state: the same step 10
    again = jaxpar.train(problem, cfg, batch, mesh=mesh, out_dir=tmp_path, quiet=True)
    assert again.losses == []  # (done: 10 of 10)


def test_the_window_resumes_with_the_state_and_runs_switch_watching(devices, tmp_path):
    par, problem = LAYOUTS["data4-zero1"], least_squares()
    mesh = jaxpar.build_mesh(par, devices[:4])

    def run(mode, steps=10):
        cfg = config(par, mode, steps=steps, every=2)
        cfg = dataclasses.replace(cfg, checkpoint=jaxpar.Checkpoint(every=2, keep=10))
        return jaxpar.train(problem, cfg, batch, mesh=mesh, out_dir=tmp_path, quiet=True)

    straight = run("skip")
    for late in ("6", "8", "10"):
        shutil.rmtree(tmp_path / "checkpoints" / late)
    resumed = run("skip")  # from step 4: its window judges step 6 as the straight run did
    assert resumed.losses == straight.losses[4:] and resumed.rows[SPIKE]["spiked"] == 1
    assert run("off", 12).losses  # a watched run's checkpoint resumes unwatched
    assert run("skip", 14).losses  # and an unwatched one's watched (an empty window)


def gpt_tiny_3d(steps: int, mode: str, every: int = 0):
    cfg = presets.load(
        "gpt-tiny",
        [
            *THREE_D_1F1B,
            f"train.steps={steps}",
            "train.lr=1e-2",
            "train.warmup=0",
            f"train.on_spike={mode}",
            "train.spike_window=4",
            f"checkpoint.every={every}",
        ],
    )
    n = math.prod(max(getattr(cfg.parallel, a), 1) for a in AXES)
    s = model_setup(cfg, jax.devices()[:n])
    fixed = s.batches(0)
    noise = {
        k: np.random.default_rng(1).integers(0, cfg.model.vocab, v.shape).astype(v.dtype)
        for k, v in fixed.items()
    }
    return cfg, s.mesh, s.problem, (lambda i: noise if i == 7 else fixed)


@pytest.mark.slow
def test_a_spike_in_pipeline_tensor_and_data_rolls_back_as_a_run_without_its_batches(
    devices, tmp_path
):
    # the same batch every step, learned by heart; batch 7 is noise, a spike over that
    cfg, mesh, problem, batches = gpt_tiny_3d(11, "rollback", every=4)
    rolled = jaxpar.train(problem, cfg, batches, mesh=mesh, out_dir=tmp_path, quiet=True)
    assert [r["step"] for r in rolled.rows if r["spiked"]] == [8]
    skip = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, on_spike="skip"))
    straight = jaxpar.train(problem, skip, lambda i: batches(0), mesh=mesh, quiet=True)
    assert not any(r["spiked"] for r in straight.rows)
    assert rolled.losses[8:] == straight.losses[4:7]  # back to 4, batches 5-8 skipped


def test_rollback_without_checkpoints_and_under_grpo_is_refused(devices, capsys):
    par, problem = LAYOUTS["data4-zero1"], least_squares()
    mesh = jaxpar.build_mesh(par, devices[:4])
    with pytest.raises(ConfigError, match="train.on_spike=rollback .* set checkpoint.every"):
        jaxpar.train(problem, config(par, "rollback"), batch, mesh=mesh, quiet=True)
    argv = ["train", "--config", "gpt-tiny", "train.on_spike=rollback"]
    assert cli.main(argv) == 2
    one_line_error(capsys, "train.on_spike=rollback", "checkpoint.every=N")
    assert cli.main([*argv[:3], "train.on_spike=rollbak"]) == 2
    one_line_error(capsys, "train.on_spike", "rollback")
    grpo = ["train.objective=grpo", "train.on_spike=rollback", "--out", "unused"]
    assert cli.main([*argv[:3], *grpo]) == 2
    one_line_error(capsys, "train.objective=grpo cannot roll back", "train.on_spike=skip")
