"""Runs that survive losing machines: the shrinking rule, and `jaxpar launch
--max-restarts` losing a worker (kill -9) and a hung one (SIGSTOP)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import jaxpar_command

from jaxpar.config import presets
from jaxpar.config.sections import given
from jaxpar.errors import ConfigError
from jaxpar.training import elastic

ZERO1_TP = ["parallel.data=4", "parallel.tensor=2", "parallel.zero=1", "train.batch_size=24"]


def shrunk(overrides, before=4, left=3, per=2, least=1):
    return given(elastic.shrink, presets.load("gpt-tiny", overrides), before, left, per, least)


def test_data_shrinks_first_and_accumulation_keeps_the_batch():
    plain = shrunk([*ZERO1_TP[:2], ZERO1_TP[3]])  # no ZeRO: data=3 fits the 3 left
    assert plain.processes == 3 and plain.layout == "data=3 x tensor=2"
    # 24 rows over 4 copies = 6 a device; over 3, 8 unless accumulated in 2 steps of 4
    assert plain.overrides == ("parallel.replica=1", "parallel.data=3", "train.grad_accum=2")
    zero = shrunk(ZERO1_TP)  # ZeRO-1 cannot split gpt-tiny's dims 3 ways: 2 of the 3
    assert zero.processes == 2 and zero.layout == "data=2 x tensor=2"
    assert zero.overrides[1:] == ("parallel.data=2", "train.grad_accum=2")
    assert zero.said.startswith("data=4 x tensor=2 -> data=2 x tensor=2 on 2 of the 3 ")
    assert "(not data=3 x tensor=2: parallel.zero=1: 14 parameter leaves have no dim" in zero.said
    hybrid = shrunk(["parallel.replica=2", "parallel.data=4"], before=2, left=1, per=4)
    assert hybrid.overrides == ("parallel.replica=2", "parallel.data=2", "train.grad_accum=2")


def test_a_layout_that_fits_no_processes_left_is_refused_naming_why():
    with pytest.raises(ConfigError) as e:
        shrunk(ZERO1_TP, least=3)
    said = str(e.value)
    assert said.startswith("elastic restart: no layout of data=4 x tensor=2 fits on 3 to 3 ")
    assert "Lower --min-processes" in said


def test_a_restart_replaces_the_commands_own_degrees():
    argv = ["train", "--config", "gpt-tiny", "parallel.data=4", "--out", "r"]
    assert elastic.replaced(argv, ("parallel.data=2", "train.grad_accum=2")) == [
        "train", "--config", "gpt-tiny", "--out", "r", "parallel.data=2", "train.grad_accum=2"
    ]  # fmt: skip


def _launch(out, processes: int, restarts: int, *overrides) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jaxpar.cli.main", "launch", "--processes", str(processes),
         "--cpu-devices-per-process", str(8 // processes), "--max-restarts", str(restarts),
         "--", "train", "--config", "gpt-tiny", *overrides, "checkpoint.keep=100",
         "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _worker(out, rank: int) -> int:
    """The pid of the live worker `rank` of the launch writing into `out`."""
    for proc in os.listdir("/proc"):
        try:
            environ = Path(f"/proc/{proc}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{proc}/cmdline").read_bytes()
        except OSError:
            continue
        if f"JAX_PROCESS_ID={rank}".encode() in environ and str(out).encode() in cmdline:
            return int(proc)
    raise AssertionError(f"no worker {rank}")


def _when(done, launcher, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.1)


def _saved(out, step: int):
    return lambda: (out / "checkpoints" / str(step)).is_dir()


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_lost_worker_restarts_on_those_left_as_a_straight_run_would(tmp_path):
    """4 processes x 2 devices, data=4 x tensor=2, ZeRO-1: kill -9 of worker 2 once step
    4 is saved; the launch restarts on the processes left (data=2, accumulation keeping
    the batch) and finishes, each step logged once, the steps after the checkpoint as a
    straight run restored into that layout from it."""
    out = tmp_path / "elastic"
    steps = [*ZERO1_TP, "train.steps=10", "checkpoint.every=4"]
    launcher = _launch(out, 4, 1, *steps)
    _when(_saved(out, 4), launcher)
    os.kill(_worker(out, 2), signal.SIGKILL)
    said, err = launcher.communicate(timeout=400)
    assert launcher.returncode == 0, said + err
    assert "Traceback" not in said
    assert "restart 1 of at most 1: process 2 of 4 was killed by SIGKILL in step" in said
    assert "  layout   data=4 x tensor=2 -> data=2 x tensor=2 on 2 of the 3 processes left" in said
    resumed = re.search(r"  resume   from step (\d+) in ", said)
    assert resumed, said
    k = int(resumed[1])
    table = said[said.index("jaxpar launch: restarts") :].splitlines()
    recovery, startup = map(float, table[3].split()[-2:])
    assert "4 -> 2" in table[3] and recovery < 2 * startup  # the target
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, 11))
    straight = tmp_path / "straight"  # the checkpoint restored into the new layout
    shutil.copytree(out / "checkpoints" / str(k), straight / "checkpoints" / str(k))
    done = jaxpar_command(
        "train", "--config", "gpt-tiny", "--cpu-devices", "4", *steps, "parallel.data=2",
        "train.grad_accum=2", "--out", str(straight),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    np.testing.assert_allclose(
        [r["loss"] for r in rows[k:]], [r["loss"] for r in _rows(straight)], rtol=1e-5
    )


@pytest.mark.slow
def test_a_hung_worker_is_named_and_restarted_and_a_second_death_gives_up(tmp_path):
    """train.hang_timeout_s: worker 1 stopped (SIGSTOP) leaves worker 0 waiting in a
    collective; it exits within the timeout with its stacks, the launcher names the
    stopped one and restarts without it. A second death: --max-restarts 1 gives up in
    one line naming both."""
    out = tmp_path / "hung"
    launcher = _launch(
        out, 2, 1, "parallel.data=8", "train.steps=200", "checkpoint.every=2",
        "train.hang_timeout_s=5",
    )  # fmt: skip
    _when(_saved(out, 2), launcher)
    stopped = _worker(out, 1)
    os.kill(stopped, signal.SIGSTOP)
    at = time.monotonic()
    _when(lambda: (out / "process-0.log.1").exists(), launcher, 60)
    assert time.monotonic() - at < 5 + 10  # the timeout, and the launcher's poll
    log = (out / "process-0.log.1").read_text()
    assert "jaxpar: process 0 of 2: step " in log and "made no progress for 5 s" in log
    assert "Current thread" in log or "Thread 0x" in log  # faulthandler's stacks
    _when(lambda: out.joinpath("process-0.log").exists() and "resuming from step"
          in out.joinpath("process-0.log").read_text(), launcher, 120)  # fmt: skip
    first = max(r["step"] for r in _rows(out))
    _when(lambda: max(r["step"] for r in _rows(out)) > first + 1, launcher, 120)
    os.kill(_worker(out, 0), signal.SIGKILL)
    said, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + signal.SIGKILL, said + err
    line = err.splitlines()[0]
    assert re.match(
        r"jaxpar launch: giving up after 1 restart\(s\) \(--max-restarts 1\): process 1 of 2 "
        r"was stopped \(no progress\): process 0 found step \d+ hung; then process 0 of 1 was "
        r"killed by SIGKILL in step \d+; stopped the other 0; resume from step \d+",
        line,
    ), line
    with pytest.raises(ProcessLookupError):  # the stopped worker is gone too
        os.kill(stopped, 0)


@pytest.mark.parametrize("statuses, ends", [("1 4 0", 0), ("2", 2), ("1 1 1 1", 1)])
def test_the_slurm_script_retries_a_failed_step_but_not_bad_input(tmp_path, statuses, ends):
    """scripts/slurm/train.sbatch with an `srun` that fails as told: a death or a hang
    (exit 4) is retried within the allocation, up to MAX_RESTARTS=3; bad input is not."""
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "activate").write_text("")
    (tmp_path / "statuses").write_text(statuses)
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text(
        '#!/bin/bash\nset -- $(cat statuses)\necho "$*" >> calls\n'
        'status=$1; shift; echo "$*" > statuses; exit "${status:-0}"\n'
    )
    srun.chmod(0o755)
    script = Path(__file__).parent.parent / "scripts" / "slurm" / "train.sbatch"
    env = {**os.environ, "PATH": f"{srun.parent}:{os.environ['PATH']}", "SLURM_JOB_ID": "7"}
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    assert done.returncode == ends, done.stdout + done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == {"1 4 0": 3, "2": 1, "1 1 1 1": 4}[statuses]
