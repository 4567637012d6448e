"""Many processes on this machine (jaxpar launch, gloo): the same training as one process."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import THREE_D_1F1B, jaxpar_command, run

from jaxpar.parallel.distributed import free_port

pytestmark = pytest.mark.slow  # every test here starts processes

ZERO3_TP = ["parallel.data=4", "parallel.tensor=2", "parallel.zero=3"]
LAYOUTS = {  # and ZERO3_TP, in test_checkpoints_move_between_two_processes_and_one
    "dp": ["parallel.data=8"],
    "3d-1f1b": THREE_D_1F1B,
    # one replica per process: only the replicas' reduction crosses
    "hsdp-zero3": ["parallel.replica=2", "parallel.data=4", "parallel.zero=3"],
}


def decoy(folder: Path) -> Path:
    """A folder whose `jaxpar/` is not jaxpar (as a checkout's root holds another one):
    a worker that imported the working directory's package would die on it."""
    (folder / "jaxpar").mkdir(parents=True, exist_ok=True)
    (folder / "jaxpar" / "__init__.py").write_text("raise ImportError('the decoy jaxpar')\n")
    return folder


def launch(out, *overrides, processes=2):
    """`jaxpar launch` (the installed command) run from a folder holding a decoy `jaxpar/`."""
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("jaxpar")),
            "launch",
            "--processes",
            str(processes),
            "--cpu-devices-per-process",
            str(8 // processes),
            "--",
            "train",
            "--config",
            "gpt-tiny",
            *overrides,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=decoy(out.parent / "cwd"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", LAYOUTS)
def test_two_processes_train_like_one(devices, tmp_path, name):
    launch(tmp_path, *LAYOUTS[name], "train.steps=5")
    one = run("gpt-tiny", LAYOUTS[name], steps=5)
    np.testing.assert_allclose([r["loss"] for r in rows(tmp_path)], one.losses, rtol=1e-6)
    assert one.report.comm.by_axis["data"].across_processes == 0
    summary = same_program(tmp_path, one.report.collective_counts)
    data, replica = (summary["comm"]["by_axis"][a] for a in ("data", "replica"))
    if name == "dp":  # one ring of 8 over two processes: 2 of its 8 hops cross
        assert data["across_processes"] == pytest.approx(data["wire"] * 2 / 8)
    if name == "hsdp-zero3":  # the replicas' all-reduce of 1/data of the gradients, alone
        assert data["across_processes"] < 4  # the loss: one float all-reduced over all 8
        assert replica["across_processes"] == pytest.approx(replica["minimum"], rel=1e-4)
        assert replica["minimum"] == pytest.approx(2 * (2 - 1) / 2 * 4 * 235_904 / 4)
    else:
        assert 0 < data["across_processes"] <= data["wire"]


def same_program(two: Path, counts: dict) -> dict:
    """The two processes' summary.json, whose ledger read the one process's program (the
    same collectives, per device, per step, `counts`) on 8 devices; a log per process."""
    summary = json.loads((two / "summary.json").read_text())
    assert summary["collective_counts"] == counts
    assert summary["devices"] == 8
    assert {p.name for p in two.glob("process-*.log")} == {"process-0.log", "process-1.log"}
    return summary


def test_checkpoints_move_between_two_processes_and_one(devices, tmp_path):
    """ZeRO-3 with tensor parallelism: two processes train like one (the losses, the
    program's collectives and the bytes that cross); saved by 2 processes, resumed by 1;
    saved by 1, resumed by 2: each resumed run goes on as the straight run does."""
    steps = [*ZERO3_TP, "train.steps=6", "checkpoint.every=3"]
    run_one(tmp_path / "one", steps)
    straight = [r["loss"] for r in rows(tmp_path / "one")]
    launch(tmp_path / "two", *steps)
    np.testing.assert_allclose([r["loss"] for r in rows(tmp_path / "two")], straight, rtol=1e-6)
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert one["comm"]["by_axis"]["data"]["across_processes"] == 0
    data = same_program(tmp_path / "two", one["collective_counts"])["comm"]["by_axis"]["data"]
    assert 0 < data["across_processes"] <= data["wire"]
    keep_first_half(tmp_path / "two")
    resumed = run_one(tmp_path / "two", steps)
    np.testing.assert_allclose([r["loss"] for r in rows(tmp_path / "two")], straight, rtol=1e-6)
    assert resumed.returncode == 0 and "resuming from step 3" in resumed.stdout
    keep_first_half(tmp_path / "one")  # the straight run, saved by one process
    launch(tmp_path / "one", *steps)
    np.testing.assert_allclose([r["loss"] for r in rows(tmp_path / "one")], straight, rtol=1e-6)


def test_a_local_tier_two_processes_write_is_one_checkpoint_or_each_its_own(devices, tmp_path):
    """checkpoint.local_dir with two processes. One folder both see: each writes its
    shards into one checkpoint (process 0 the index), the tiers as one process makes them;
    one process resumes from the local tier's step 3 and goes on as the straight run. A
    folder of each host's own (each process given its own): each process saves its own
    pieces in process-N; process 1's step 3 lost, the two resume from the newest step both
    hold, 2, not 3, and go on as the straight run (process 0's step 3 deleted)."""
    local = tmp_path / "two-local"
    steps = [*ZERO3_TP, "train.steps=4", "checkpoint.every=1", "checkpoint.shared_every=2"]
    launch(tmp_path / "two", *steps, f"checkpoint.local_dir={local}")
    straight = [r["loss"] for r in rows(tmp_path / "two")]
    assert sorted(os.listdir(local)) == [".lock", "1", "3"]
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["2", "4"]
    shutil.rmtree(tmp_path / "two" / "checkpoints" / "4")  # stopped after step 3
    resumed = run_one(tmp_path / "two", [*steps, f"checkpoint.local_dir={local}"])
    assert f"resuming from step 3: {local / '3'}" in resumed.stdout
    np.testing.assert_allclose([r["loss"] for r in rows(tmp_path / "two")], straight, rtol=1e-6)

    own, hosts = tmp_path / "own", [tmp_path / f"host{i}" for i in range(2)]
    steps[-1] = "checkpoint.shared_every=4"  # local 1, 2, 3; shared 4
    by_hand(own, steps, hosts)
    assert [sorted(os.listdir(h / f"process-{i}")) for i, h in enumerate(hosts)] == [
        ["1", "2", "3"]
    ] * 2
    np.testing.assert_allclose([r["loss"] for r in rows(own)], straight, rtol=1e-6)
    shutil.rmtree(own / "checkpoints" / "4")
    shutil.rmtree(hosts[1] / "process-1" / "3")
    assert "resuming from step 2: " + str(hosts[0] / "process-0" / "2") in by_hand(
        own, steps, hosts
    )
    np.testing.assert_allclose([r["loss"] for r in rows(own)], straight, rtol=1e-6)
    assert [r["step"] for r in rows(own)] == [1, 2, 3, 4]
    assert sorted(os.listdir(hosts[0] / "process-0")) == ["1", "2", "3"]  # 3 saved again


def by_hand(out, steps, hosts) -> str:
    """Two processes started by hand, as on two hosts, each its own checkpoint.local_dir
    (`hosts`); process 0's output."""
    port, logs = free_port(), [out.with_name(f"{out.name}-{i}.log") for i in range(2)]
    with contextlib.ExitStack() as files:
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jaxpar.cli.main",
                    "train",
                    "--config",
                    "gpt-tiny",
                    "--cpu-devices",
                    "4",
                    "--coordinator",
                    f"127.0.0.1:{port}",
                    "--num-processes",
                    "2",
                    "--process-id",
                    str(i),
                    *steps,
                    f"checkpoint.local_dir={hosts[i]}",
                    "--out",
                    str(out),
                ],
                stdout=files.enter_context(log.open("w")),
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            for i, log in enumerate(logs)
        ]
        codes = [w.wait(timeout=300) for w in workers]
    assert codes == [0, 0], logs[1].read_text()[-3000:]
    return logs[0].read_text()


def run_one(out, steps):
    done = jaxpar_command(
        "train", "--config", "gpt-tiny", "--cpu-devices", "8", *steps, "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    return done


def keep_first_half(out):
    """Make a finished 6-step run look stopped after step 3 (train.steps=3 would change
    the learning-rate schedule): only its step-3 checkpoint stays; a resume drops the
    rows after it itself."""
    for step in (out / "checkpoints").iterdir():
        if step.name != "3":
            shutil.rmtree(step)


def test_a_missing_process_times_out_naming_it(tmp_path):
    start = time.time()
    done = jaxpar_command(
        "train",
        "--config",
        "gpt-tiny",
        "--cpu-devices",
        "4",
        "--coordinator",
        f"127.0.0.1:{free_port()}",
        "--num-processes",
        "3",
        "--process-id",
        "0",
        "distributed.timeout_s=5",
        "parallel.data=8",
        "--out",
        str(tmp_path),
    )
    assert time.time() - start < 5 + 30
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "jaxpar: error: distributed: 1 of 3 processes arrived within distributed.timeout_s=5; "
        "missing process ids [1, 2]. Start them all (same --coordinator and --num-processes), "
        "or raise the timeout"
    ]


def _workers(out) -> dict[int, int]:
    """JAX_PROCESS_ID -> pid of the live `jaxpar train` workers writing to `out`."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train" in cmdline and str(out).encode() in cmdline and b"launch" not in cmdline:
            ids = [e.split(b"=", 1)[1] for e in environ if e.startswith(b"JAX_PROCESS_ID=")]
            if ids:
                found[int(ids[0])] = int(proc.name)
    return found


def _started(out, *overrides) -> subprocess.Popen:
    """`jaxpar launch` of 2 workers training for long, once both have logged 2 steps."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jaxpar.cli.main", "launch", "--processes", "2",
         "--cpu-devices-per-process", "4", "--", "train", "--config", "gpt-tiny",
         "parallel.data=8", "train.steps=500", "checkpoint.every=2", *overrides,
         "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    # three steps logged, and a checkpoint complete (saved asynchronously: its folder
    # appears, renamed into place, once it is whole)
    while not (
        (out / "metrics.jsonl").exists()
        and len(rows(out)) >= 3
        and any(p.name.isdigit() for p in (out / "checkpoints").glob("*"))
    ):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.2)
    return launcher


def test_sigterm_to_launch_saves_stops_every_worker_and_exits_0(tmp_path):
    launcher = _started(tmp_path)
    assert len(_workers(tmp_path)) == 2
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, out + err
    assert "SIGTERM sent to 2 processes" in out and "saved and exited" in out
    assert _workers(tmp_path) == {}  # none left behind
    last = rows(tmp_path)[-1]["step"]
    assert last < 500 and (tmp_path / "checkpoints" / str(last)).is_dir()


def test_a_dead_worker_is_named_with_its_signal_and_the_checkpoint(tmp_path):
    launcher = _started(tmp_path)
    os.kill(_workers(tmp_path)[1], signal.SIGKILL)
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + signal.SIGKILL, out + err
    said = err.splitlines()[0]
    assert said.startswith(
        "jaxpar launch: process 1 of 2 was killed by SIGKILL; stopped the other 1"
    )
    assert "resume from step" in said and str(tmp_path / "checkpoints") in said
    assert _workers(tmp_path) == {}


def _launcher(out, steps: int = 500) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jaxpar.cli.main", "launch", "--processes", "2",
         "--cpu-devices-per-process", "4", "--", "train", "--config", "gpt-tiny",
         "parallel.data=8", f"train.steps={steps}", "checkpoint.every=2", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _gone(pid: int) -> bool:
    """Exited, every thread of it (a zombie at most: its files closed), or never there.
    (A killed process's leader turns zombie while its other threads still exit, holding
    the files they share.)"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status and "\nThreads:\t1\n" in status


def _until(done, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("when", ["as the workers start", "in compile"])
def test_a_stop_before_the_first_step_ends_the_workers_at_once(tmp_path, when):
    """SIGTERM to the launcher before any step (JAX's preemption notifier used to take it,
    and the workers trained on): they exit at once, with nothing saved, and it says so."""
    launcher = _launcher(tmp_path)
    log = tmp_path / "process-0.log"
    if when == "as the workers start":  # spawned (their logs taken), not yet joined
        _until(log.exists, 60, "no worker started")
    else:  # the workers have joined: gloo is up, and the step is compiling
        _until(lambda: log.exists() and "distributed:" in log.read_text(), 120, "no join")
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGTERM, out + err
    assert "stopped before their first step, with nothing to save; run the same" in out
    assert "[Gloo]" not in out and "Traceback" not in out + err
    assert not list((tmp_path / "checkpoints").glob("[0-9]*")) and _workers(tmp_path) == {}


def test_workers_die_with_a_killed_launcher_and_a_relaunch_spares_live_logs(tmp_path):
    """kill -9 of the launcher after its first checkpoint: no worker is left after 10 s
    (they were reparented, and trained on); a launch onto logs a live worker still holds
    is refused in one line naming it, the log untouched."""
    launcher = _launcher(tmp_path)
    _until(lambda: list((tmp_path / "checkpoints").glob("[0-9]*")), 240, "no checkpoint")
    pids = list(_workers(tmp_path).values())
    assert len(pids) == 2
    launcher.kill()
    launcher.communicate()
    _until(lambda: all(map(_gone, pids)), 10, f"workers left: {_workers(tmp_path)}")

    from jaxpar.parallel import distributed

    (held,) = distributed._take_logs([tmp_path / "process-1.log"])  # as a live worker's
    held.write(f"{distributed.HEADER} 1 of 2, pid 4242\nstep 7\n")
    held.flush()
    again = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli.main", "launch", "--processes", "2", "--",
         "train", "--config", "gpt-tiny", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    held.close()
    assert again.returncode == 2, again.stdout + again.stderr
    assert again.stderr.startswith("jaxpar: error: ") and again.stderr.count("\n") == 1
    assert "process-1.log: a worker of an earlier launch" in again.stderr
    assert "(process 1 of 2, pid 4242)" in again.stderr
    assert (tmp_path / "process-1.log").read_text().endswith("step 7\n")
