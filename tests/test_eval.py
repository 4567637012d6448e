"""Held-out loss (train.eval_every): data never trained on, the same value under every
layout, continuous across a resume."""

import json
import os
import signal

import numpy as np
import pytest
from helpers import THREE_D_1F1B, _shipped, one_line_error

import jaxpar
from jaxpar import recipe
from jaxpar.cli import main as cli
from jaxpar.config import presets
from jaxpar.data import tokens as data

EVAL = ["train.eval_every=2", "train.eval_batches=2"]


def test_the_corpus_tail_is_held_out_and_never_trained_on():
    cfg = presets.load("gpt-tiny", EVAL)
    whole = np.frombuffer(data.corpus_bytes(), dtype=np.uint8)
    trained = data.load_tokens(cfg.data, cfg.train, cfg.model)
    held_out = data.load_eval_tokens(cfg.data, cfg.train, cfg.model)
    assert len(trained) + len(held_out) == len(whole)
    assert len(held_out) == len(whole) // 10
    np.testing.assert_array_equal(held_out, whole[len(trained) :])
    # every window of a training batch lies in the first part, of an eval batch in the tail
    tail = held_out.tobytes()
    batch = recipe.held_out_batches(cfg)(0)["tokens"].astype(np.uint8)
    assert all(row.tobytes() in tail for row in batch)
    starts = np.random.default_rng([0, 0]).integers(0, len(trained) - 65, size=16)
    assert starts.max() + 65 <= len(trained)


def test_a_prepared_folder_evaluates_on_val_bin(tmp_path):
    (tmp_path / "train.bin").write_bytes(np.arange(0, 100, dtype="<u2").repeat(10).tobytes())
    (tmp_path / "val.bin").write_bytes(np.arange(100, 200, dtype="<u2").repeat(10).tobytes())
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 256, "dtype": "uint16"}))
    cfg = presets.load("gpt-tiny", [*EVAL, "data.source=tokens", f"data.path={tmp_path}"])
    held_out = recipe.held_out_batches(cfg)(1)["tokens"]
    assert held_out.min() >= 100
    trained = data.batch_at(
        data.load_tokens(cfg.data, cfg.train, cfg.model),
        seed=0, step=1, batch_size=16, seq_len=64, vocab=256,
    )["tokens"]  # fmt: skip
    assert trained.max() < 100


def test_synthetic_eval_batches_are_fresh_draws():
    cfg = presets.load("gpt-tiny", [*EVAL, "data.source=synthetic"])
    _, batches = recipe.model_problem(cfg, {"data": 1, "pipeline": 1, "tensor": 1})
    held_out = recipe.held_out_batches(cfg)
    assert not np.array_equal(held_out(0)["tokens"], batches(0)["tokens"])


def test_a_flat_token_file_has_no_split_to_evaluate(tmp_path, capsys):
    ids = tmp_path / "ids.bin"
    ids.write_bytes((np.arange(1000) % 256).astype("<u2").tobytes())
    argv = ["train", "--config", "gpt-tiny", "data.source=tokens", f"data.path={ids}"]
    assert cli.main([*argv, "train.eval_every=5"]) == 2
    one_line_error(capsys, "train.eval_every=5 with data.path=", "val.bin")


def test_python_training_without_eval_batches_is_refused(devices):
    cfg, mesh, problem, batches = _shipped("gpt-tiny", EVAL)
    with pytest.raises(jaxpar.ConfigError, match="train.eval_every=2: give the held-out data"):
        jaxpar.train(problem, cfg, batches, mesh=mesh, quiet=True)


def run_eval(overrides, out=None, batches=None):
    cfg, mesh, problem, shipped = _shipped("gpt-tiny", [*EVAL, "train.steps=4", *overrides])
    result = jaxpar.train(
        problem,
        cfg,
        batches or shipped,
        mesh=mesh,
        quiet=True,
        out_dir=out,
        eval_batches=recipe.held_out_batches(cfg),
    )
    return [(r["step"], r["eval_loss"]) for r in result.rows if "eval_loss" in r]


@pytest.fixture(scope="module")
def single(devices):
    return run_eval(["parallel.data=1"])


LAYOUTS = {
    "dp8-zero3": ["parallel.data=8", "parallel.zero=3"],
    "3d-1f1b": THREE_D_1F1B,
    "context4-ulysses-replica2": [
        "parallel.replica=2",
        "parallel.data=1",
        "parallel.context=4",
        "parallel.context_strategy=ulysses",
        "parallel.zero=1",
    ],
    "zbv": [  # the V's own forward ticks
        "parallel.data=2",
        "parallel.pipeline=2",
        "parallel.microbatches=4",
        "parallel.schedule=zbv",
    ],
    "interleaved": [
        "parallel.data=2",
        "parallel.pipeline=2",
        "parallel.microbatches=4",
        "parallel.schedule=interleaved",
        "parallel.virtual_stages=2",
    ],
}
SGD = ["train.optimizer=sgd", "train.lr=0.5", "train.clip_norm=0", "train.weight_decay=0"]


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_held_out_loss_is_the_same_under_every_layout(single, name):
    got = run_eval(LAYOUTS[name])
    assert [s for s, _ in got] == [s for s, _ in single] == [2, 4]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in single], rtol=1e-4)
    assert got[-1][1] < got[0][1] + 0.5  # (and it is a loss of the model being trained)


@pytest.mark.slow
def test_averaged_parameters_are_evaluated(devices):
    """Parameter averaging evaluates the global parameters: with plain SGD averaged every
    step they are the all-reduced ones."""
    want = run_eval(["parallel.data=1", *SGD])
    got = run_eval(["parallel.data=8", *SGD, "parallel.dp_sync=params", "parallel.sync_every=1"])
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-5)


@pytest.mark.slow
def test_a_resumed_run_keeps_its_eval_rows(devices, tmp_path):
    """8 steps straight == 5 steps, a SIGTERM, and 3 resumed: eval rows at 2, 4, 6, 8."""
    steps = ["train.steps=8", "checkpoint.every=2", "parallel.data=8"]
    cfg, _, _, shipped = _shipped("gpt-tiny", [*EVAL, *steps])
    straight = run_eval(steps, tmp_path / "straight")

    def stopping(i):
        if i == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return shipped(i)

    run_eval(steps, tmp_path / "stopped", stopping)
    run_eval(steps, tmp_path / "stopped")
    rows = [
        json.loads(x) for x in (tmp_path / "stopped" / "metrics.jsonl").read_text().split("\n") if x
    ]
    resumed = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    assert [s for s, _ in resumed] == [2, 4, 6, 8]
    np.testing.assert_allclose([v for _, v in resumed], [v for _, v in straight], rtol=1e-6)
