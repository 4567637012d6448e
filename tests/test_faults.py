"""Faults a long run meets on its disk: a disk that fills, wherever jaxpar writes
(checkpoints, the step's HLO, metrics, exports, prepared data), stops the command with
exit status 3 and one line naming the folder, the bytes free and how to go on; nothing
half-written is left where a reader would take it for whole, the newest whole checkpoint
stays readable, and a resume once there is room again ends where a straight run ends.
Exports are the same bytes each time. The disk is a small tmpfs (mounting one needs
root, as CI's machine has; elsewhere these tests skip)."""

import contextlib
import hashlib
import json
import os
import subprocess

import numpy as np
import pytest
from helpers import script

from jaxpar import disk, hf
from jaxpar.cli import main as cli
from jaxpar.data import tokens as data
from jaxpar.training import checkpoint, metrics


@pytest.fixture
def small_disk(tmp_path):
    """A 5 MiB disk, made bigger by `grow(folder)` and fuller by `fill(folder, free)`."""
    where = tmp_path / "disk"
    where.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(where)]
    if subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("a tmpfs cannot be mounted here (not root): no disk to fill")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)


def grow(where) -> None:
    subprocess.run(["mount", "-o", "remount,size=64m", str(where)], check=True)


def fill(where, free: int) -> None:
    """Leave `free` bytes (about: a page) on the disk at `where`."""
    with open(where / "filler", "wb") as f:
        f.write(b"\0" * (disk.free_bytes(where) - free))


def stopped(capsys, *needles: str) -> str:
    """The one `jaxpar: stopped:` line the command ended with, holding each needle."""
    err = capsys.readouterr().err
    line = err.rpartition("jaxpar: stopped: ")[2]
    assert "Traceback" not in err and "ERROR:absl" not in err, err
    assert err.endswith("\n") and line.count("\n") == 1, err
    for needle in ("the disk is full", *needles):
        assert needle in line, line
    return line


def train(*argv: str) -> int:
    base = ["train", "--config", "gpt-tiny", "parallel.data=8", "train.steps=3"]
    return cli.main([*base, *argv])


def test_safetensors_are_the_same_bytes_every_time(tmp_path):
    """safetensors orders the header's metadata by a hash map: jaxpar sorts it."""
    tensors = {"b": np.arange(6, dtype=np.float32), "a": np.ones(3, np.int32)}
    meta = {k: json.dumps({"of": k}) for k in ("jaxpar.step", "jaxpar.config", "x", "y", "z")}
    digests = set()
    for i in range(6):
        hf.save_safetensors(tensors, tmp_path / f"{i}.safetensors", meta)
        digests.add(hashlib.sha256((tmp_path / f"{i}.safetensors").read_bytes()).hexdigest())
    assert len(digests) == 1


@pytest.mark.slow
def test_a_full_disk_stops_a_run_in_one_line_and_its_resume_is_the_straight_run(
    tmp_path, small_disk, capsys, devices
):
    """Checkpoints on a 5 MiB disk, 2.7 MiB each: the second does not fit. The run stops
    with the one line, checkpoint 1 whole; with room again it resumes to the straight
    run's parameters, bit for bit; then an export to the full disk leaves nothing."""
    ckpt = small_disk / "checkpoints"
    argv = ["checkpoint.every=1", f"checkpoint.dir={ckpt}", "--out", str(tmp_path / "run")]
    assert train(*argv) == 3
    stopped(capsys, f"{ckpt}:", "free, 2.7 MiB needed", "checkpoint 2", "resumes from step 1")
    assert sorted(p for p in os.listdir(ckpt) if p.isdigit()) == ["1"]
    checkpoint.saved_params(ckpt, 1)  # readable
    assert train(*argv) == 3  # resumed while still full: the same line
    stopped(capsys, "resumes from step 1")

    grow(small_disk)
    assert train(*argv) == 0
    # the same command with room all along (checkpoint.every=1 builds a step that does not
    # donate its state, and XLA:CPU's arithmetic differs from the donating step's by a
    # rounding: the straight run is the same program)
    assert train("checkpoint.every=1", "--out", str(tmp_path / "straight")) == 0
    resumed, _ = checkpoint.saved_params(ckpt, 3)
    straight, _ = checkpoint.saved_params(tmp_path / "straight" / "checkpoints", 3)
    for k, v in straight.items():
        np.testing.assert_array_equal(resumed[k], v, err_msg=k)
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3]

    capsys.readouterr()
    fill(small_disk, 64 << 10)
    to = small_disk / "model.safetensors"
    assert cli.main(["export", str(tmp_path / "straight"), "--to", str(to)]) == 3
    stopped(capsys, f"{small_disk}:", "needed", "writing model.safetensors", "export again")
    assert sorted(os.listdir(small_disk)) == ["checkpoints", "filler"]


def test_a_full_disk_under_the_run_files_is_one_line(tmp_path, small_disk, capsys, devices):
    """The step's HLO text (about 0.7 MiB) on a disk with 64 KiB free: one line, and no
    part of the file left (nor the run folder it made); a metrics row that meets a full
    disk names its file."""
    fill(small_disk, 64 << 10)
    assert train("--out", str(small_disk / "run")) == 3
    stopped(capsys, f"{small_disk / 'run'}:", "writing step.hlo.txt", "run the same command")
    assert sorted(os.listdir(small_disk)) == ["filler"]

    (small_disk / "filler").unlink()
    fill(small_disk, 0)
    log = metrics.MetricsLog(small_disk / "metrics.jsonl")
    with pytest.raises(OSError) as failed:
        for step in range(1, 2000):
            log.write({"step": step, "loss": 1.0})
    with contextlib.suppress(OSError):  # its buffer cannot be flushed either
        log.close()
    assert disk.is_full(failed.value)
    assert "writing metrics.jsonl; then" in str(disk.from_error(failed.value, "then"))


def test_prepare_data_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, small_disk, capsys):
    tokenizer = tmp_path / "tokenizer"
    script("make_tiny_llama").save_tokenizer(tokenizer, data.corpus_bytes().decode()[:20000], 300)
    (tmp_path / "in.txt").write_bytes(data.corpus_bytes()[:400_000])
    fill(small_disk, 64 << 10)
    out = small_disk / "tokens"
    argv = ["prepare-data", str(tmp_path / "in.txt"), "--tokenizer", str(tokenizer)]
    assert cli.main([*argv, "--out", str(out)]) == 3
    stopped(capsys, f"{small_disk}:", "the dataset for --out", "run the same command again")
    assert sorted(os.listdir(small_disk)) == ["filler"]
