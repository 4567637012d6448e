"""Many processes: joining them with jax.distributed, and a launcher for one machine.

`initialize` takes the coordinator, the number of processes and this one's id from its
arguments, else from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, else
leaves them to JAX's own cluster detection (SLURM, Open MPI, Kubernetes). Before JAX's
coordination service (which aborts the process when one never arrives) it holds a
rendezvous of its own on the coordinator's host, port + 1, bounded by `timeout_s`: a
process that never arrives gives an error naming how many did and which ids are missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from jaxpar.errors import HUNG, ConfigError, RendezvousError

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
LAUNCHER = "JAXPAR_LAUNCHER_PID"  # set by `jaxpar launch` for its workers


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    timeout_s: float = 300.0,
) -> None:
    """Join this process to the others of the job (call before anything touches jax's
    devices). With one process, or outside a cluster, it does nothing."""
    import jax

    coordinator = coordinator or os.environ.get(ENV[0])
    if num_processes is None and os.environ.get(ENV[1]):
        num_processes = int(os.environ[ENV[1]])
    if process_id is None and os.environ.get(ENV[2]):
        process_id = int(os.environ[ENV[2]])
    if jax.config.jax_platforms == "cpu" or not _accelerator():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator and num_processes and num_processes > 1:
        if process_id is None:
            raise ConfigError("--process-id: needed with --coordinator and --num-processes")
        rendezvous(coordinator, num_processes, process_id, timeout_s)
    elif not (coordinator or _in_cluster()):
        return
    # A stop that arrives while JAX joins would reach JAX's preemption notifier, which
    # installs itself there and only logs it: the worker would train on. Held back until
    # the default action is back (_stoppable), it then ends the worker at once.
    main = threading.current_thread() is threading.main_thread()
    if main:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        jax.distributed.initialize(
            coordinator, num_processes, process_id, initialization_timeout=int(timeout_s) + 30
        )
        _stoppable()
    finally:
        if main:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if jax.process_index() == 0:
        print(
            f"jaxpar distributed: {jax.process_count()} processes, "
            f"{jax.local_device_count()} local and {jax.device_count()} global devices",
            flush=True,
        )


def _stoppable() -> None:
    """A worker stops as a lone process does. JAX's preemption notifier takes SIGTERM (and
    only logs it), so a worker told to stop before its first step trained on: SIGTERM
    kills it again until the training loop takes the signal to stop after a step and
    save (jaxpar.training.trainer._Stops). And a worker of `jaxpar launch` dies with its
    launcher, whatever killed it: reparented, it would train on. It dies as the launcher
    did, at once (workers stopping on their own would each stop at their own step and
    wait on the others' collectives); the newest whole checkpoint is where to resume."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if os.environ.get(LAUNCHER):  # no traceback of a forwarded Ctrl-C mid-compile
            signal.signal(signal.SIGINT, signal.SIG_DFL)
    if launcher := os.environ.get(LAUNCHER):
        threading.Thread(target=_watch_launcher, args=(int(launcher),), daemon=True).start()


def _watch_launcher(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(0.5)
    print(f"jaxpar: the launcher (process {launcher}) is gone: exiting with it", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _accelerator() -> bool:
    from jaxpar.parallel.mesh import accelerator_installed

    return accelerator_installed()


def _in_cluster() -> bool:
    return any(k in os.environ for k in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"))


def rendezvous(coordinator: str, n: int, me: int, timeout_s: float) -> None:
    """Every process reports to process 0 (on the coordinator's host, port + 1) within
    timeout_s; then process 0 answers all of them. Raises ConfigError naming the missing."""
    host, port = coordinator.rsplit(":", 1)
    address = (host, int(port) + 1)
    deadline = time.monotonic() + timeout_s
    if me == 0:
        with socket.create_server(address, reuse_port=False) as server:
            server.settimeout(0.2)
            peers: dict[int, socket.socket] = {}
            while len(peers) < n - 1 and time.monotonic() < deadline:
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                conn.settimeout(5)
                peers[int(conn.recv(16).decode())] = conn
            missing = sorted(set(range(1, n)) - set(peers))
            for conn in peers.values():
                conn.sendall(b"go" if not missing else b"no")
                conn.close()
        if missing:
            raise RendezvousError(
                f"distributed: {len(peers) + 1} of {n} processes arrived within "
                f"distributed.timeout_s={timeout_s:g}; missing process ids {missing}. Start "
                "them all (same --coordinator and --num-processes), or raise the timeout"
            )
        return
    while True:
        try:
            with socket.create_connection(address, timeout=2) as conn:
                conn.sendall(str(me).encode())
                conn.settimeout(max(deadline - time.monotonic(), 0) + 10)
                if conn.recv(2) == b"go":
                    return
                break
        except OSError:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    raise RendezvousError(
        f"distributed: process {me} of {n}: the others did not all arrive at {coordinator} "
        f"within distributed.timeout_s={timeout_s:g} (see process 0's message)"
    )


def free_port() -> int:
    """A port free now on localhost, whose successor (the rendezvous) is free too: drawn
    below the kernel's range of ephemeral ports, which its outgoing connections (gloo's
    many, other jobs') take from, so that none takes it before the job binds it."""
    low, _ = _ephemeral_ports()
    while True:
        # (a kernel whose ephemeral range starts low leaves no room below it: any port)
        port = random.randrange(low - 12_000, low - 1) if low > 13_024 else _any_port()
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue


def _any_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


GRACE_S = 60  # after a stop is forwarded, the least time the workers get to save and exit


def _how(code: int) -> str:
    """An exit status in words: `exited with status 1`, `was killed by SIGKILL`."""
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _status(code: int) -> int:
    """A child's Popen return code as a shell reports it (a signal: 128 + its number)."""
    return 128 - code if code < 0 else code


def newest_step(*ckpt_dirs: Path | None) -> int | None:
    """The newest complete checkpoint's step in the folders (a run's tiers); orbax renames
    a step's folder into place once it is whole: a partial one is never counted."""
    return _newest(ckpt_dirs)[0]


def _newest(ckpt_dirs) -> tuple[int | None, Path | None]:
    """(the newest complete step in the folders, the folder holding it)."""
    found = [
        (int(p.name), folder)
        for folder in ckpt_dirs
        for p in (folder.iterdir() if folder and folder.is_dir() else ())
        if p.name.isdigit()
    ]
    return max(found, key=lambda f: f[0], default=(None, None))


def latest_checkpoint(ckpt_dir: Path | None, none: str = "") -> str:
    """Where a stopped job resumes from, in words (the newest complete step's folder);
    `none`: the words where there is no checkpoint."""
    return _resume(ckpt_dir, none=none)


def _resume(*ckpt_dirs: Path | None, none: str = "") -> str:
    """latest_checkpoint over a run's tiers: the newest step of any."""
    step, folder = _newest(ckpt_dirs)
    if step is None:
        return none or "no checkpoint to resume from (set checkpoint.every to keep them)"
    return f"resume from step {step} in {folder} by running the same command again"


def check_launch(
    processes: int, most: int, max_restarts: int, min_processes: int, argv: list[str]
) -> None:
    """`jaxpar launch`'s numbers (`most` local processes at most) and the command it runs
    (a jaxpar command or a script), checked before any process starts."""
    if not 1 <= processes <= most:
        raise ConfigError(f"--processes {processes}: give 1 to {most} local processes")
    if not 0 <= max_restarts <= 1000:
        raise ConfigError(f"--max-restarts {max_restarts}: give 0 to 1000 restarts")
    if not 1 <= min_processes <= processes:
        raise ConfigError(
            f"--min-processes {min_processes}: give 1 to --processes ({processes}), the "
            "fewest processes a restart may run on"
        )
    if not argv:
        raise ConfigError(
            "launch: no command to run; e.g. jaxpar launch --processes 2 -- train --config gpt-tiny"
        )
    first = argv[0]
    if first.endswith(".py") and not Path(first).is_file():
        raise ConfigError(f"launch: {first}: no such script")
    if not first.endswith(".py") and first not in ("train", "bench", "inspect"):
        raise ConfigError(
            f"launch: {first!r} is neither a jaxpar command (train, bench, inspect) nor a "
            "Python script (SCRIPT.py)"
        )


def launch(
    processes: int,
    cpu_devices: int,
    argv: list[str],
    log_dir: Path,
    ckpt_dir: Path | None = None,
    restarts=None,
    local_dir: Path | None = None,
) -> int:
    """Run ARGV as `processes` local processes of one job, `cpu_devices` simulated devices
    each: a `jaxpar` command (`train ...`) or a Python script (`script.py ...`), told
    where and who they are by JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    JAX_PROCESS_ID. `ckpt_dir` and `local_dir` are the run's checkpoint tiers (named
    in what it says). Every process's output goes to log_dir/process-<i>.log, process 0's
    is also streamed here.

    SIGTERM or SIGINT to the launcher goes to every worker, once: they finish the step in
    flight, save and exit; the launcher waits for them and returns their status (0).
    The first worker to fail stops the others; the launcher names it, how it ended, its
    last lines and the checkpoint to resume from, and returns its status. With
    `restarts` (jaxpar.training.elastic.Restarts), it restarts instead on the processes
    left, in the layout that fits them, up to restarts.most times: a worker killed by a
    signal (not gloo's abort of a casualty) or found stopped is taken as lost with its
    host and not restarted; one that exited with an error is."""
    log_dir.mkdir(parents=True, exist_ok=True)
    job = _Job(cpu_devices, log_dir, (ckpt_dir, local_dir))
    # (from before the first worker: a stop while they start reaches every one started)
    previous = {sig: signal.signal(sig, job.forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _attempts(job, processes, argv, restarts)
    finally:
        for p in job.procs:
            if p.poll() is None:
                p.kill()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _attempts(job: _Job, processes: int, argv: list[str], restarts) -> int:
    """The job, restarted after each death while `restarts` allows; its exit status."""
    done: list[_Restart] = []
    startup, began = None, time.monotonic()
    while True:
        progress = _Progress(job.log_dir / "metrics.jsonl", newest_step(*job.tiers) or 0)
        ended = job.run(processes, argv, progress)
        if done and done[-1].recovered_at is None:
            done[-1].recovered_at = progress.first_at
        if startup is None and progress.first_at is not None:
            startup = progress.first_at - began
        if isinstance(ended, _Death):
            ended.before = [r.cause for r in done]
            again = _restart(job, ended, processes, argv, restarts, len(done))
        if not isinstance(ended, _Death) or again is None:
            if done:
                print(f"jaxpar launch: restarts\n{restarts.table(done, startup)}", flush=True)
            return ended if isinstance(ended, int) else ended.report(job.tiers)
        processes, argv, restart = again
        done.append(restart)


def _restart(job: _Job, death: _Death, processes: int, argv, restarts, done: int):
    """(processes, argv, the restart) after `death`, its summary printed; None where
    the launch gives up (no restarts, none left, too few processes, an input error)."""
    if restarts is None:
        return None
    if death.code == 2:  # bad input: a restart would repeat it
        death.gave_up = "not restarted: bad input (exit 2) would fail again"
        return None
    if done >= restarts.most:
        death.gave_up = f"giving up after {done} restart(s) (--max-restarts {restarts.most})"
        return None
    try:
        shrunk, argv = restarts.next(processes, processes - len(death.lost), argv)
    except ConfigError as e:
        death.gave_up = f"not restarted: {e}"
        return None
    _keep_logs(job.log_dir, processes, done + 1)
    step, folder = _newest(job.tiers)
    resumed = "the start" if step is None else f"step {step}"
    cause = death.cause()
    restart = _Restart(cause, processes, shrunk.processes, shrunk.layout, resumed, death.at)
    print(
        f"\njaxpar launch: restart {done + 1} of at most {restarts.most}: {cause}\n"
        f"  layout   {shrunk.said}\n"
        f"  rule     data and replica shrink first; tensor, pipeline, context and expert are "
        f"kept; the batch is kept by accumulation\n"
        f"  resume   from {resumed} in {folder or job.tiers[0]}",
        flush=True,
    )
    return shrunk.processes, argv, restart


@dataclass
class _Restart:
    cause: str  # which worker died, how, in which step
    before: int
    processes: int
    layout: str
    resumed: str  # the step it resumed from
    died_at: float  # time.monotonic() when the launcher saw the death
    recovered_at: float | None = None  # the first step after it


def _keep_logs(log_dir: Path, processes: int, restart: int) -> None:
    """The workers' logs before restart `restart`, kept as process-<i>.log.<restart>."""
    for i in range(processes):
        log = log_dir / f"process-{i}.log"
        if log.exists():
            os.replace(log, log_dir / f"process-{i}.log.{restart}")


class _Job:
    """The workers of one attempt, and the stop the launcher forwards to them."""

    def __init__(self, cpu_devices: int, log_dir: Path, tiers: tuple):
        self.cpu_devices, self.log_dir = cpu_devices, log_dir
        self.tiers = tuple(t for t in tiers if t) or (None,)  # the run's checkpoint folders
        self.procs: list[subprocess.Popen] = []
        self.stopping: list[int] = []
        self.told: set[int] = set()  # the workers the stop was sent to

    def tell(self) -> None:
        for p in self.procs:
            if p.pid not in self.told and p.poll() is None:
                self.told.add(p.pid)
                p.send_signal(self.stopping[0])

    def forward(self, signum, frame) -> None:
        if not self.stopping:
            self.stopping.append(signum)
            self.tell()

    def run(self, processes: int, argv: list[str], progress: _Progress):
        """Spawn and watch one attempt: its status, or the _Death that ended it."""
        coordinator = f"127.0.0.1:{free_port()}"
        # -P: never the working directory's `jaxpar` (a checkout's root holds one)
        command = (
            [sys.executable, *argv]
            if argv[0].endswith(".py")
            else [sys.executable, "-P", "-m", "jaxpar.cli.main", *argv]
        )
        paths = [self.log_dir / f"process-{i}.log" for i in range(processes)]
        self.procs = []
        for i, log in enumerate(_take_logs(paths)):
            with log:  # the worker holds it (and its lock) from here
                if not self.stopping:
                    self.procs.append(
                        _spawn(command, log, i, processes, coordinator, self.cpu_devices)
                    )
        if self.stopping:  # a stop that came while a worker was spawned, before it was listed
            self.tell()
        return _watch(self.procs, paths, self.stopping, self.tiers, progress)


def _spawn(command, log, i: int, processes: int, coordinator: str, cpu_devices: int):
    """Worker i, in a session of its own (a Ctrl-C at the terminal reaches the launcher
    alone, which forwards it once: a second would make the workers exit unsaved), writing
    `log` after its header line."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": str(cpu_devices),
        ENV[0]: coordinator,
        ENV[1]: str(processes),
        ENV[2]: str(i),
        LAUNCHER: str(os.getpid()),
        **_this_jaxpar(),
    }
    proc = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    log.write(f"{HEADER} {i} of {processes}, pid {proc.pid}\n")
    return proc


HEADER = "jaxpar launch: process"  # each log's first line: which worker writes it


def _take_logs(paths: list[Path]) -> list:
    """Each worker's log, opened for it and locked (flock, which the worker inherits and
    holds while it lives), then emptied: never a log that a live worker of an earlier
    launch still writes (its launcher killed), which is refused naming that worker."""
    taken = []
    for path in paths:
        log = path.open("a+")  # noqa: SIM115 (handed to the worker)
        try:
            fcntl.flock(log, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.seek(0)
            holder = log.readline().strip().removeprefix(HEADER).strip() or "a process"
            for f in [*taken, log]:
                f.close()
            raise ConfigError(
                f"{path}: a worker of an earlier launch still writes it (process {holder}); "
                "stop it (or wait for it to end), then launch again"
            ) from None
        log.truncate(0)
        taken.append(log)
    return taken


def _this_jaxpar() -> dict:
    """The environment that makes a worker import the `jaxpar` this launcher runs: its
    folder first on PYTHONPATH, unless it is where the interpreter finds packages anyway
    (an install's site-packages, which must not go before the standard library)."""
    import site

    import jaxpar

    root = str(Path(jaxpar.__file__).resolve().parent.parent)
    sites = {str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if root in sites:
        return {}
    return {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


class _Echo:
    """Process 0's log, streamed to this console as it grows: whole lines, without the
    log's first line (which worker writes it), gloo's connection chatter, nor a
    traceback (a failure's cause is reported from its own log; process 0's traceback is
    most often a peer's death, met in a collective)."""

    NOISE = (HEADER, "[Gloo]")
    TRACEBACK = "Traceback (most recent call last):"

    def __init__(self, path: Path):
        self.file, self.partial, self.in_traceback = path.open(), "", False

    def pump(self) -> None:
        *lines, self.partial = (self.partial + self.file.read()).split("\n")
        kept = [line + "\n" for line in lines if self._shown(line)]
        sys.stdout.write("".join(kept))
        sys.stdout.flush()

    def _shown(self, line: str) -> bool:
        if line.startswith(self.TRACEBACK):
            self.in_traceback = True
        elif self.in_traceback and line and not line[0].isspace():
            self.in_traceback = False  # its last line: the exception
            return False
        return not (self.in_traceback or line.startswith(self.NOISE))

    def close(self) -> None:
        self.pump()
        if self._shown(self.partial):
            sys.stdout.write(self.partial)
        self.file.close()


class _Progress:
    """The time the first step after `after` (the step an attempt resumes from) is
    logged in metrics.jsonl: a row for a later step, written after the attempt began
    (a resume first drops the rows past its checkpoint)."""

    def __init__(self, path: Path, after: int):
        self.path, self.after, self.began = path, after, time.time()
        self.first_at: float | None = None
        self.last_step = after  # the newest step logged
        self.seen = 0.0  # the file's time of change when last read

    def poll(self) -> None:
        try:
            changed = self.path.stat().st_mtime
            if changed == self.seen:
                return
            self.seen = changed
            with self.path.open("rb") as f:  # its last row, from its end
                f.seek(max(f.seek(0, os.SEEK_END) - 65536, 0))
                last = f.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
            step = int(json.loads(last)["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        self.last_step = step
        if self.first_at is None and step > self.after and changed >= self.began:
            self.first_at = time.monotonic()


def _watch(procs, paths: list[Path], stopping: list[int], tiers, progress: _Progress):
    echo = _Echo(paths[0])
    try:
        while True:
            echo.pump()
            progress.poll()
            codes = [p.poll() for p in procs]
            if stopping:
                grace = grace_s(tiers, paths[0].parent / "metrics.jsonl")
                return _wait_stopped(procs, echo, signal.Signals(stopping[0]), tiers, grace)
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                return _failed(procs, paths, codes, failed, progress.last_step)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    finally:
        echo.close()


def _failed(procs, paths: list[Path], codes: list, failed: list[int], step: int) -> _Death:
    """The first worker to fail, and the lost ones, with the others stopped."""
    # the cause, not a casualty: a worker whose peer died aborts in gloo (SIGABRT), and may
    # be seen dead in the same poll as the one that died
    lost = _lost(codes, [p.pid for p in procs])
    i = min(failed, key=lambda i: (i not in lost, codes[i] == -signal.SIGABRT))
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.kill()
    for p in running:
        p.wait()
    lines = paths[i].read_text().splitlines()
    tail = list(deque((line for line in lines if not line.startswith(_Echo.NOISE)), 12))
    return _Death(i, len(procs), codes[i], lost, step + 1, len(running), paths[i], tail)


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): it makes no progress."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def _lost(codes: list, pids: list[int]) -> list[int]:
    """The workers taken as lost with their hosts: killed by a signal other than gloo's
    abort of a worker whose peer died, or stopped."""
    return [
        i
        for i, (code, pid) in enumerate(zip(codes, pids, strict=True))
        if (code is not None and code < 0 and code != -signal.SIGABRT)
        or (code is None and _stopped(pid))
    ]


@dataclass
class _Death:
    """A worker's failure, which ended an attempt."""

    process: int
    processes: int
    code: int
    lost: list[int]  # the workers taken as lost with their hosts
    step: int  # the step in flight
    stopped: int  # the other workers the launcher stopped
    log: Path
    tail: list[str]
    at: float = field(default_factory=time.monotonic)
    before: list[str] = field(default_factory=list)  # the causes of earlier restarts
    gave_up: str = ""

    def cause(self) -> str:
        hung = [j for j in self.lost if j != self.process]
        if self.code == HUNG and hung:
            return (
                f"process {hung[0]} of {self.processes} was stopped (no progress): process "
                f"{self.process} found step {self.step} hung"
            )
        return f"process {self.process} of {self.processes} {_how(self.code)} in step {self.step}"

    def report(self, tiers: tuple) -> int:
        """Printed as the launch's end: one line naming it (and the deaths before it)."""
        head = f"jaxpar launch: process {self.process} of {self.processes} {_how(self.code)}"
        if self.before:
            head = f"jaxpar launch: {self.gave_up}: {'; then '.join([*self.before, self.cause()])}"
        elif self.gave_up:
            head += f" ({self.gave_up})"
        print(
            f"{head}; stopped the other {self.stopped}; {_resume(*tiers)}. Its "
            f"log is {self.log}; its last lines:",
            *self.tail,
            sep="\n",
            file=sys.stderr,
        )
        return _status(self.code)


def grace_s(tiers: tuple, metrics: Path) -> float:
    """How long workers get, after a forwarded stop, to finish the step in flight, save
    and exit: GRACE_S more than three times the longest step (metrics.jsonl) and the
    longest save (orbax's timestamps in each checkpoint of the run's tiers) measured so
    far."""
    saves = [0.0]
    for found in (f for t in tiers if t for f in t.glob("[0-9]*/_CHECKPOINT_METADATA")):
        if not found.parent.name.isdigit():  # a save still writing: no commit time yet
            continue
        with contextlib.suppress(OSError, ValueError, KeyError):
            told = json.loads(found.read_text())
            saves.append((told["commit_timestamp_nsecs"] - told["init_timestamp_nsecs"]) / 1e9)
    steps = [0.0]
    with contextlib.suppress(OSError):
        for line in metrics.read_text().splitlines():
            with contextlib.suppress(ValueError, AttributeError):
                steps.append(float(json.loads(line).get("step_time_s") or 0))
    return GRACE_S + 3 * (max(steps) + max(saves))


def _wait_stopped(procs, echo: _Echo, sig: signal.Signals, tiers, grace: float) -> int:
    """After a forwarded stop: the workers' exit, within `grace` s (then they are killed).
    Workers that had not begun training die of the signal itself, saving nothing."""
    print(
        f"\njaxpar launch: {sig.name} sent to {len(procs)} processes; waiting up to "
        f"{grace:.0f} s for them to save"
    )
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        echo.pump()
        time.sleep(0.1)
    codes = [p.poll() for p in procs]
    if all(c == -sig for c in codes):
        print(
            f"jaxpar launch: the {len(procs)} processes stopped before their first step, "
            f"with nothing to save; "
            + _resume(*tiers, none="run the same command again to start the run")
        )
        return _status(-sig)
    bad = [(i, c) for i, c in enumerate(codes) if c != 0]
    if not bad:
        print(f"jaxpar launch: all {len(procs)} processes saved and exited; "
              f"{_resume(*tiers)}")  # fmt: skip
        return 0
    i, code = bad[0]
    how = f"did not exit within {grace:.0f} s" if code is None else _how(code)
    print(f"jaxpar launch: after {sig.name}, process {i} {how}", file=sys.stderr)
    return 1 if code is None else _status(code)
