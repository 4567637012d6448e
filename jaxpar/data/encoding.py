"""Encoding documents on many cores into the same ids, in the same order, at any count
(`jaxpar prepare-data --workers N`). N worker processes each encode whole chunks of
documents, one document at a time on one core; the chunks' ids are taken back in the
order the chunks were sent, and at most 2N chunks are in flight, so memory stays flat
however long the input. One worker encodes in this process."""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

_WORKER: dict = {}  # a worker process's tokenizer and dtype (set by `_start`)


def cores() -> int:
    """The cores this process may run on (`--workers`' default)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _start(tokenizer: str, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core a worker: N workers, N cores
    from tokenizers import Tokenizer

    _WORKER.update(tok=Tokenizer.from_file(tokenizer), dtype=np.dtype(dtype))


def _encode(texts: list[str], tok, dtype: np.dtype) -> list[np.ndarray]:
    return [np.asarray(tok.encode(t, add_special_tokens=False).ids, dtype) for t in texts]


def _encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    return _encode(texts, _WORKER["tok"], _WORKER["dtype"])


class Encoder:
    """`map` over chunks of (text, ...) tuples -> (the chunk, each text's ids), in order.
    `tok`: the tokenizer loaded from `path` (tokenizer.json), which one worker uses."""

    def __init__(self, tok, path: Path, dtype: np.dtype, workers: int):
        self.tok, self.path, self.dtype, self.workers = tok, path, dtype, workers
        self.pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> Encoder:
        if self.workers > 1:  # spawned: the parent's tokenizer threads are not forked
            self.pool = ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start,
                initargs=(str(self.path), self.dtype.name),
            )
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def map(self, chunks: Iterable[list[tuple]]) -> Iterator[tuple[list[tuple], list]]:
        if self.pool is None:
            for chunk in chunks:
                yield chunk, _encode([c[0] for c in chunk], self.tok, self.dtype)
            return
        pending: deque = deque()
        for chunk in chunks:
            pending.append((chunk, self.pool.submit(_encode_in_worker, [c[0] for c in chunk])))
            if len(pending) >= 2 * self.workers:
                chunk, done = pending.popleft()
                yield chunk, done.result()
        while pending:
            chunk, done = pending.popleft()
            yield chunk, done.result()
