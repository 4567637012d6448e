"""Batches that are a pure function of (seed, step): reproducible, independent of the mesh.

Sources: the embedded corpus (byte-level text of the `pydoc_data` topics that every
CPython carries, no download), a user's text file, or synthetic sequences.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxpar.config import ConfigError, Data, Model, Source, Train

BYTE_VOCAB = 256


def corpus_bytes() -> bytes:
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")


def load_tokens(data: Data, train: Train, model: Model) -> np.ndarray | None:
    """The token stream (None for synthetic data), checked against the config."""
    if data.path and data.source is not Source.FILE:
        raise ConfigError(
            f"data.path={data.path!r} with data.source={data.source}: the path is read "
            "only with data.source=file; add data.source=file, or drop data.path"
        )
    if data.source is Source.SYNTHETIC:
        return None
    if model.vocab < BYTE_VOCAB:
        raise ConfigError(
            f"model.vocab={model.vocab}: byte-level text has {BYTE_VOCAB} "
            f"symbols; set model.vocab={BYTE_VOCAB} (or more), or "
            "data.source=synthetic"
        )
    if data.source is Source.FILE:
        path = Path(data.path)
        if not data.path or not path.is_file():
            raise ConfigError(
                f"data.path={data.path!r}: no such file; give a text file with "
                "data.source=file, or use data.source=corpus"
            )
        raw = path.read_bytes()
    else:
        raw = corpus_bytes()
    tokens = np.frombuffer(raw, dtype=np.uint8)
    need = train.seq_len + 2
    if len(tokens) < need:
        where = f"data.path={data.path}" if data.source is Source.FILE else "the corpus"
        raise ConfigError(
            f"{where} has {len(tokens)} bytes, fewer than train.seq_len+2 = "
            f"{need}; use a longer text or a smaller train.seq_len"
        )
    return tokens


def describe(data: Data, train: Train) -> str:
    """The data source in words, for the start-up summary."""
    what = {
        "corpus": "corpus: the pydoc topics CPython ships, as bytes",
        "file": f"file: {data.path}, as bytes",
        "synthetic": "synthetic: counting sequences with a random start and stride",
    }[data.source]
    return f"{what}; {train.batch_size} x {train.seq_len} tokens a step"


def batch_at(
    tokens: np.ndarray | None,
    *,
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    vocab: int,
    rows: slice = slice(None),
) -> dict[str, np.ndarray]:
    """Global batch `step`, or its `rows` only (each process builds its own):
    {"tokens": int32 [rows, seq_len + 1]}. The random draws are the global batch's
    whichever rows are built, so the rows are the same as in the whole batch."""
    rng = np.random.default_rng([seed, step])
    if tokens is None:
        # Each row counts up from a random start by a random stride: learnable, not trivial.
        start = rng.integers(0, vocab, size=(batch_size, 1))[rows]
        stride = rng.integers(1, 4, size=(batch_size, 1))[rows]
        out = (start + stride * np.arange(seq_len + 1)) % vocab
    else:
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)[rows]
        out = tokens[starts[:, None] + np.arange(seq_len + 1)]
    return {"tokens": out.astype(np.int32)}
