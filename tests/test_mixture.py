"""Pretraining data as the large runs feed it (jaxpar.data.feed): epochs that visit
every window once, mixtures whose blocks hold each source's exact share, phases that
switch at their step, a resume with a changed mixture, bad mixture files refused, and
kill -9 mid-phase resumed to the straight run's batches, bitwise."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import one_line_error

from jaxpar.cli import main as cli
from jaxpar.data import feed, order

SEQ = 16


def folder(path: Path, train_ids: int, stride: int, vocab: int = 256, tokenizer="tiny") -> Path:
    """A prepared folder, as `jaxpar prepare-data` writes one, of counting ids."""
    path.mkdir(parents=True)
    for split, n in (("train", train_ids), ("val", max(train_ids // 8, 4 * SEQ))):
        (np.arange(n) * stride % vocab).astype(np.uint16).tofile(path / f"{split}.bin")
    meta = {"vocab_size": vocab, "dtype": "uint16", "tokenizer": tokenizer}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def mixture_file(
    tmp: Path, text: str, sizes=(("web", 4000), ("code", 2500), ("math", 1500))
) -> Path:
    for i, (name, n) in enumerate(sizes):
        if not (tmp / name).exists():
            folder(tmp / name, n, i + 1)
    (tmp / "mix.yaml").write_text(text)
    return tmp / "mix.yaml"


THREE = """sources:
  web: {path: web, weight: 0.5}
  code: {path: code, weight: 0.3}
  math: {path: math, weight: 0.2}
phases:
  - {from_step: 300, weights: {web: 0.1, code: 0.2, math: 0.7}}
"""


def test_the_order_is_a_bijection_of_seed_and_epoch():
    for n in (1, 2, 3, 17, 1000, 4097):
        visits = order.permute(np.arange(n), n, order.keys(0, 0, 0))
        assert sorted(visits.tolist()) == list(range(n)), n
    a, b = (order.permute(np.arange(64), 64, order.keys(0, 0, e)) for e in (0, 1))
    assert (a != b).any()  # each epoch its own order


def counted(tmp: Path, windows: int) -> list[str]:
    """A prepared folder of `windows` windows whose ids count (a window's first id is its
    start), and the run keys that read it in epochs."""
    vocab = 1 << (windows * SEQ).bit_length()
    path = folder(tmp / "counted", windows * SEQ + 1, 1, vocab=vocab)
    return ["data.source=tokens", f"data.path={path}", f"model.vocab={vocab}",
            f"train.seq_len={SEQ}", "train.batch_size=8", "train.seed=3"]  # fmt: skip


@pytest.mark.parametrize("processes", [1, 2, 8])  # data=1; two processes; data=8's rows
def test_an_epoch_visits_every_window_once(processes, tmp_path):
    from jaxpar.config import presets
    from jaxpar.config.sections import given
    from jaxpar.objectives import lm

    cfg = presets.load("gpt-tiny", counted(tmp_path, 1000))  # 1000 windows
    fed = given(lm.batches, cfg, None, "train", {"data": processes})  # as the trainer reads
    share = 8 // processes

    def window_starts(step):  # each process builds its own rows only
        parts = [fed(step, rows=slice(p * share, (p + 1) * share)) for p in range(processes)]
        return np.concatenate([p["tokens"][:, 0] for p in parts])

    first = np.concatenate([window_starts(s) for s in range(125)])  # one epoch: 1000 windows
    assert np.array_equal(np.sort(first), np.arange(1000) * SEQ)
    second = np.concatenate([window_starts(s) for s in range(125, 250)])
    assert np.array_equal(np.sort(second), np.arange(1000) * SEQ)
    assert not np.array_equal(first, second)
    assert fed.position(250)["epochs"] == {"data": 2.0}
    assert fed.position(250)["tokens"] == 2000 * SEQ


# `jaxpar train` that logs the first id of every row each process builds, a line a step
LOGGED = """
import sys
import jax
from jaxpar.cli.main import main
from jaxpar.training import trainer

fetch = trainer.batch_for
def logged(batches, step, *a):
    def built(i, rows=slice(None)):
        batch = batches(i, rows=rows)
        with open(f"{sys.argv[1]}.{jax.process_index()}", "a") as log:
            log.write(f"{i} {rows.start or 0} {' '.join(map(str, batch['tokens'][:, 0]))}\\n")
        return batch
    return fetch(built, step, *a)
trainer.batch_for = logged
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_two_processes_read_each_window_once_an_epoch(tmp_path):
    """Two real processes (jaxpar launch, data=2), each building its own rows of a
    prepared folder: together they read each of its 32 windows once an epoch, 2 epochs."""
    script = tmp_path / "logged.py"
    script.write_text(LOGGED)
    args = ["train", "--config", "gpt-tiny", *counted(tmp_path, 32), "parallel.data=2"]
    args += ["train.steps=8", "train.eval_every=0", "checkpoint.every=0", "--out"]
    done = subprocess.run(
        [str(Path(sys.executable).with_name("jaxpar")), "launch", "--processes", "2",
         "--cpu-devices-per-process", "1", "--", str(script), str(tmp_path / "rows"), *args,
         str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    built = {}  # (step, first row) -> the window starts, the last built of each
    for p in (0, 1):
        for line in (tmp_path / f"rows.{p}").read_text().splitlines():
            step, first, *starts = map(int, line.split())
            built[step, first] = starts
    assert sorted(built) == [(s, r) for s in range(8) for r in (0, 4)]  # each its half
    for epoch in (0, 1):
        starts = [x for (s, _), v in built.items() if s // 4 == epoch for x in v]
        assert sorted(starts) == list(range(0, 32 * SEQ, SEQ)), epoch


def three_source_feed(tmp_path, text=THREE, batch_size=10):
    from jaxpar.config.sections import Data, Train

    train = Train(batch_size=batch_size, seq_len=SEQ, seed=5)
    data = Data(mixture=str(mixture_file(tmp_path, text)))
    return feed.mixed(data, train, 256, "train")


def test_blocks_hold_exact_shares_and_a_phase_switches_at_its_step(tmp_path):
    fed = three_source_feed(tmp_path)
    which = np.concatenate([fed.draws(s)[0] for s in range(500)])  # 5000 windows, 5 blocks
    for block, shares in [(0, (500, 300, 200)), (1, (500, 300, 200)), (2, (500, 300, 200))]:
        got = np.bincount(which[block * 1000 : (block + 1) * 1000], minlength=3)
        assert tuple(got) == shares, block
    # step 300 (window 3000) starts the phase: its blocks count from there
    assert tuple(np.bincount(which[3000:4000], minlength=3)) == (100, 200, 700)
    assert tuple(np.bincount(which[2990:3000], minlength=3)) != (1, 2, 7)  # step 299: before
    # each source's draws go on across the switch: every draw number once, in order
    for i in range(3):
        draws = np.concatenate([fed.draws(s)[1][fed.draws(s)[0] == i] for s in range(500)])
        assert np.array_equal(draws, np.arange(len(draws))), i
    # a source that runs out starts its next epoch: math's 93 windows, drawn 2000 times
    position = fed.position(500)  # 3000 windows at 5:3:2, then 2000 at 1:2:7
    assert position["drawn"] == {"web": 1700, "code": 1300, "math": 2000}
    assert position["epochs"]["math"] == pytest.approx(2000 / ((1500 - 1) // SEQ))


def test_a_changed_mixture_goes_on_from_the_recorded_position(tmp_path):
    fed = three_source_feed(tmp_path)
    record = json.loads(json.dumps(fed.position(350)))  # as a checkpoint holds it
    same, changes = fed.resumed(350, record)
    assert changes == []
    for s in (350, 420):
        assert np.array_equal(same(s)["tokens"], fed(s)["tokens"])  # bitwise the straight run's
    changed = THREE.replace("web: 0.1, code: 0.2, math: 0.7", "web: 0.4, code: 0.4, math: 0.2")
    other = three_source_feed(tmp_path, changed)
    resumed, changes = other.resumed(350, record)
    assert changes == ["weights web 0.1 -> 0.4, code 0.2 -> 0.4, math 0.7 -> 0.2"]
    assert resumed.drawn(350) == record["drawn"]  # each source from its recorded draws
    after = resumed.position(450)  # 100 steps x 10 rows = one block at the new weights
    assert {k: after["drawn"][k] - record["drawn"][k] for k in record["drawn"]} == {
        "web": 400,
        "code": 400,
        "math": 200,
    }
    again, changes = other.resumed(450, json.loads(json.dumps(after)))  # resumed once more
    assert changes == [] and np.array_equal(again(460)["tokens"], resumed(460)["tokens"])
    bigger, changes = three_source_feed(tmp_path, THREE, batch_size=20).resumed(350, record)
    assert changes == ["train.batch_size 10 -> 20"] and bigger.drawn(350) == record["drawn"]


BAD = {
    "missing folder": (
        THREE.replace("path: code", "path: nowhere"),
        "source 'code' has path",
    ),
    "weights not summing to 1": (THREE.replace("weight: 0.2", "weight: 0.3"), "sum to 1.1, not 1"),
    "phase out of order": (
        THREE + "  - {from_step: 200, weights: {web: 1.0}}\n",
        "phase 2 has from_step=200, not after 300",
    ),
    "unknown source in a phase": (
        THREE.replace("math: 0.7}", "math: 0.6, books: 0.1}"),
        "weighs 'books', which is not a source",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_mixture_files_are_refused_in_one_line(case, tmp_path, capsys):
    text, needle = BAD[case]
    path = mixture_file(tmp_path, text)
    _refused(path, needle, capsys)


def test_sources_with_different_vocabularies_are_refused(tmp_path, capsys):
    folder(tmp_path / "books", 3000, 5, vocab=512, tokenizer="other")
    text = THREE.replace("  math:", "  books: {path: books, weight: 0.0}\n  math:")
    _refused(mixture_file(tmp_path, text), "prepared with different vocabularies", capsys)


def _refused(path: Path, needle: str, capsys) -> None:
    argv = ["train", "--config", "gpt-tiny", f"data.mixture={path}"]
    assert cli.main([*argv, "model.vocab=512", "--out", str(path.parent / "run")]) == 2
    one_line_error(capsys, needle, "data.mixture=")


def test_prepare_data_expands_globs_in_order(tmp_path):
    from jaxpar.data.prepare import expand
    from jaxpar.errors import ConfigError

    for name in ("b.jsonl", "a.jsonl", "sub/c.jsonl", "notes.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("{}")
    got = expand([tmp_path / "notes.txt", tmp_path / "**" / "*.jsonl"])
    assert got == [tmp_path / n for n in ("notes.txt", "a.jsonl", "b.jsonl", "sub/c.jsonl")]
    with pytest.raises(ConfigError, match="matches no file"):
        expand([tmp_path / "*.parquet"])


# `jaxpar train` that writes each batch's hash as it is read, and kills itself
# (SIGKILL: no cleanup) when it reads batch K
HASHING = """
import hashlib, os, signal, sys
from jaxpar.cli.main import main
from jaxpar.training import trainer

log, k = open(sys.argv[1], "a"), int(sys.argv[2])
fetch = trainer.batch_for
def hashed(f, i, *a):
    if i == k:
        os.kill(os.getpid(), signal.SIGKILL)
    log.write(f"{i} {hashlib.sha256(f(i)['tokens'].tobytes()).hexdigest()}\\n"); log.flush()
    return fetch(f, i, *a)
trainer.batch_for = hashed
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.slow
def test_kill_9_mid_phase_resumes_to_the_straight_runs_batches(tmp_path):
    """Killed at step 7, inside the phase that starts at step 4: the resumed run reads
    the straight run's batches bitwise and ends with its losses; the held-out losses of
    each source are in metrics.jsonl and the closing table."""
    text = THREE.replace("from_step: 300", "from_step: 4")
    path = mixture_file(tmp_path, text, (("web", 6000), ("code", 3000), ("math", 1200)))
    args = ["train", "--config", "gpt-tiny", "--cpu-devices", "2", "parallel.data=2"]
    args += [f"data.mixture={path}", "model.vocab=256", "train.steps=9", "checkpoint.every=2"]
    args += ["train.eval_every=3", "train.eval_batches=1", "train.log_every=1"]

    def run(out: Path, kill: int = -1):
        command = [sys.executable, "-c", HASHING, str(out) + ".hashes", str(kill), *args]
        return subprocess.run([*command, "--out", str(out)], capture_output=True, text=True)

    straight = run(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr
    assert "held-out loss math" in straight.stdout + straight.stderr
    killed = run(tmp_path / "killed", kill=7)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = run(tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr

    def hashes(out):  # step -> the batch's hash, the last read of each step
        lines = (tmp_path / f"{out}.hashes").read_text().split()
        return dict(zip(lines[::2], lines[1::2], strict=True))

    assert hashes("killed") == hashes("straight")
    rows = {o: _rows(tmp_path / o) for o in ("straight", "killed")}
    assert [r["loss"] for r in rows["killed"]] == [r["loss"] for r in rows["straight"]]
    assert {"eval_loss/web", "eval_loss/code", "eval_loss/math", "epoch/math", "tokens"} <= {
        k for r in rows["straight"] for k in r
    }


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]
