"""The run directory (--out / out_dir): checked before anything starts, never mixed
between two runs, and set aside on --restart. Needs no jax: the command line checks it
before jax starts."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from jaxpar.errors import ConfigError

METRICS, SUMMARY, LOSS_PLOT, HLO = "metrics.jsonl", "summary.json", "loss.png", "step.hlo.txt"
TENSORBOARD, PROFILE = "tensorboard", "profile"  # folders: event files; jax.profiler traces
# what a run writes, besides checkpoints
RUN_FILES = (METRICS, SUMMARY, LOSS_PLOT, HLO, TENSORBOARD, PROFILE)
LOCK = ".lock"  # held by the process writing the run (its pid inside)


def check_writable(path: Path, flag: str = "--out") -> None:
    """`path` is, or can be made, a directory we can write in: found out by making (and
    removing) a folder in it or in its nearest existing parent."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path}: is a file, not a directory; give a directory")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(
            f"{flag} {path}: {parent} is a file, so no directory can be made under it; "
            "give another path"
        )
    try:
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".jaxpar-probe-"))
    except OSError as e:
        raise ConfigError(
            f"{flag} {path}: cannot write in {parent} ({e.strerror}); give a directory "
            "you can write to"
        ) from None


def check_file_target(path: Path, flag: str) -> None:
    """`path` is a file we can write: not a directory, under a folder that is, or can
    be made, writable (made when the command writes it)."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file name in it")
    check_writable(path.parent, f"{flag} {path}: its folder")


def refuse_another_run(out_dir: Path | None, *ckpt_dirs: Path | None) -> None:
    """A run directory holding another run's files, from a run that kept no checkpoints
    in any of `ckpt_dirs` (its tiers), is not overwritten (one that did is resumed, from
    step 0 if none had completed)."""
    found = [name for name in RUN_FILES if out_dir and (out_dir / name).exists()]
    if found and not any(f and holds_more_than_its_lock(f) for f in ckpt_dirs):
        raise ConfigError(
            f"--out {out_dir}: holds a run ({', '.join(found)}) with no checkpoint to "
            "resume from; use --restart to set it aside, or another --out"
        )


def holds_more_than_its_lock(folder: Path) -> bool:
    return folder.is_dir() and bool(set(os.listdir(folder)) - {LOCK})


def set_aside(out_dir: Path | None, *ckpt_dirs: Path | None) -> list[str]:
    """--restart: move an earlier run's files and checkpoints (each tier's folder) into
    dated folders; what was moved, and where to."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    if out_dir and out_dir.is_dir():
        aside = out_dir / f"set-aside-{stamp}"
        for name in (*RUN_FILES, "checkpoints"):
            if (out_dir / name).exists():
                aside.mkdir(exist_ok=True)
                os.replace(out_dir / name, aside / name)
                moved.append(str(aside / name))
    for ckpt_dir in ckpt_dirs:
        if ckpt_dir and holds_more_than_its_lock(ckpt_dir):
            aside = ckpt_dir.with_name(f"{ckpt_dir.name}-set-aside-{stamp}")
            os.replace(ckpt_dir, aside)
            moved.append(str(aside))
    return moved


def lock(out_dir: Path, flag: str = "--out") -> IO:
    """Take the run directory (or the checkpoint directory, `flag` checkpoint.dir) for
    this process, or ConfigError naming the process that holds it. The lock is the
    kernel's (flock), so it goes with the process that held it: a run killed by any
    signal leaves nothing that blocks its resume. Keep the returned file open while the
    run writes; closing it lets the directory go."""
    out_dir.mkdir(parents=True, exist_ok=True)
    held = open(out_dir / LOCK, "a+")  # noqa: SIM115 (held open for the run)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.seek(0)
        holder = held.read().strip() or "another process"
        held.close()
        named = f"{flag} {out_dir}" if flag.startswith("--") else f"{flag}={out_dir}"
        raise ConfigError(
            f"{named}: another jaxpar run (process {holder}) is writing there; wait for it "
            f"to end, stop it, or give another {flag}"
        ) from None
    held.seek(0)
    held.truncate()
    held.write(f"{os.getpid()}\n")
    held.flush()
    return held


@contextlib.contextmanager
def writing(out_dir: Path, flag: str = "--out") -> Iterator[None]:
    """The run directory (or checkpoint directory) held (`lock`) while the run writes; a
    directory this made for a run that failed before writing anything is removed again
    (a refused run leaves nothing behind)."""
    made = not out_dir.exists()
    held = lock(out_dir, flag)
    try:
        yield
    except BaseException:
        if made and {p.name for p in out_dir.iterdir()} <= {LOCK}:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    finally:
        held.close()
