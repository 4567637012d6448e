"""Writing to a disk that may fill: a full disk (or quota), wherever jaxpar writes, is one
line naming the folder, the bytes free and needed, and how to go on (DiskFull, exit
status 3); and what a reader takes for whole is written under a temporary name and
renamed when it is (`staged`), so a write cut short leaves nothing that looks whole."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from jaxpar.errors import Stopped

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# how TensorStore (under orbax) and the Rust writers say it: the OS's words, or its code
FULL_WORDS = ("No space left on device", "Disk quota exceeded", "os_error_code='28'")


class DiskFull(Stopped):
    """A write failed because its disk (or the user's quota) is full: exit status 3."""


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def is_full(e: BaseException | None) -> bool:
    """Whether `e`, or an error it was raised from, is a full disk or quota."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return True
        if any(words in str(e) for words in FULL_WORDS):
            return True
        e = e.__cause__ or e.__context__
    return False


def free_bytes(path: Path) -> int:
    """The bytes free to this user on the disk that holds `path` (or would)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def full(folder: Path, what: str, then: str, needed: int | None = None) -> DiskFull:
    """The one line for a full disk under `folder`, writing `what`."""
    need = f", {human_bytes(needed)} needed" if needed else ""
    return DiskFull(
        f"{folder}: the disk is full ({human_bytes(free_bytes(folder))} free{need}) while "
        f"writing {what}; {then}"
    )


def from_error(e: BaseException, then: str) -> DiskFull:
    """The one line for a full disk that `e` met, named by the file it was writing."""
    while e is not None and not (isinstance(e, OSError) and e.filename):
        e = e.__cause__ or e.__context__
    if e is None:  # (every jaxpar write names its file: see `named`)
        return DiskFull(f"the disk is full; {then}")
    path = Path(e.filename).absolute()
    return full(path.parent, path.name, then)


@contextlib.contextmanager
def writing(folder: Path, what: str, then: str, needed: int | None = None) -> Iterator[None]:
    """A full disk met in the block is raised as DiskFull's one line; other errors pass."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as e:
        if is_full(e):
            raise full(folder, what, then, needed) from None
        raise


@contextlib.contextmanager
def named(path: Path) -> Iterator[None]:
    """An OSError in the block names `path` (the OS names no file when a write fails)."""
    try:
        yield
    except OSError as e:
        if e.filename:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


def write_whole(path: Path, data: str | bytes) -> None:
    """`data` written to `path` whole, or not at all (under a temporary name, renamed)."""
    with named(path), staged(path) as part:
        if isinstance(data, bytes):
            part.write_bytes(data)
        else:
            part.write_text(data)


@contextlib.contextmanager
def staged(to: Path) -> Iterator[Path]:
    """A path beside `to` to write (a file, or a folder made by the caller), renamed to
    `to` when the block ends well and removed when it does not: a reader never sees it
    half-written, and an earlier `to` is replaced only once the new one is whole. A
    folder `to` that exists already gets the new files, each renamed into it; its other
    files stay."""
    to = Path(to)
    to.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(dir=to.parent, prefix=f".{to.name}.partial-"))
    part.rmdir()  # a free name: the block makes the file or the folder
    try:
        yield part
        if to.is_dir() and part.is_dir():
            for entry in sorted(part.iterdir()):
                os.replace(entry, to / entry.name)
        else:
            os.replace(part, to)
    finally:
        if part.is_dir():
            shutil.rmtree(part, ignore_errors=True)
        elif part.exists():
            part.unlink()
