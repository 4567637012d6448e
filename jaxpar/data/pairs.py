"""Batches of preference pairs (a `jaxpar prepare-data --format preference` folder), a pure
function of (seed, step) like every batch (jaxpar.data.tokens).

A pair is one row: its chosen document (prompt + answer), then its rejected one, then
padding, each a segment of its own (0, 1, 2) with positions from 0, so the two answers
never attend to each other, and the loss mask marks the answers' ids. Rows are the unit
every layout moves (over data, into micro-batches and pipeline stages, and context splits
a row's tokens), so a pair is never split from itself. Each epoch visits every pair once,
in an order drawn from (seed, epoch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxpar.config.sections import Data, Source, Train
from jaxpar.data import tokens
from jaxpar.errors import ConfigError

CHOSEN, REJECTED, PADDING = 0, 1, 2  # the segments of a row
PAD_ID = 0
# a batch's precomputed reference log-probabilities, [rows, 2] (chosen, rejected)
REFERENCE = "reference_logps"


@dataclass(frozen=True)
class Pairs:
    """One split's pairs on disk."""

    ids: tokens.TokenFile
    starts: tokens.TokenFile  # 2 documents a pair: chosen, rejected
    mask: tokens.TokenFile

    def __len__(self) -> int:
        return len(self.starts) // 2

    def bounds(self, index: np.ndarray) -> np.ndarray:
        """[n, 3] the first id of each pair's chosen and rejected answers, and its end."""
        starts = self.starts.open()
        ends = np.r_[starts[1:], len(self.ids)] if len(starts) else starts
        return np.stack([starts[2 * index], starts[2 * index + 1], ends[2 * index + 1]], -1)


def pad_id(path: str) -> int | None:
    """The id a prepared preference folder's tokenizer pads with (folders prepared before
    `pad_id` was recorded: its end of text, which TRL falls back to)."""
    meta = tokens.meta_of(Path(path))
    return meta.get("pad_id", meta.get("end_of_text_id"))


def meta_of(data: Data) -> dict | None:
    """A preference folder's pair counts (meta.json's `pairs`), or None for other data."""
    folder = Path(data.path)
    if data.source is not Source.TOKENS or not folder.is_dir():
        return None
    meta = tokens.meta_of(folder).get(tokens.PAIRS_META)
    if meta is not None and not _counts(meta):
        raise ConfigError(
            f"data.path={data.path}: {tokens.META}'s `{tokens.PAIRS_META}` is not what "
            "prepare-data --format preference writes; prepare the pairs again"
        )
    return meta


def _counts(meta) -> bool:
    """Whether a folder's pair counts are whole numbers >= 0 where prepare-data puts them."""
    try:
        counts = [meta["pairs"][s] for s in ("train", "val")]
        counts += [meta[k] for k in ("longest_pair", "max_length", "truncated")]
    except (KeyError, TypeError):
        return False
    return all(isinstance(n, int) and n >= 0 for n in counts)


def load(data: Data, train: Train, vocab: int, split: str = "train") -> Pairs:
    """The pairs of `split`, checked to fit a row of train.seq_len + 1 ids."""
    meta = meta_of(data)
    if meta is None:
        raise ConfigError(
            f"train.objective={train.objective}: data.path={data.path or '(none)'} "
            f"(data.source={data.source}) holds no preference pairs; prepare them with `jaxpar "
            "prepare-data FILE.jsonl --format preference`, and give data.source=tokens "
            "data.path=THAT_FOLDER"
        )
    if meta["longest_pair"] > train.seq_len + 1:
        raise ConfigError(
            f"train.seq_len={train.seq_len}: the longest pair of data.path={data.path} is "
            f"{meta['longest_pair']} ids (both answers, each with its prompt), and a pair is one "
            f"row of train.seq_len + 1 ids; set train.seq_len={meta['longest_pair'] - 1} or "
            "more, or prepare the pairs with a smaller --max-length"
        )
    if not meta["pairs"][split]:
        raise ConfigError(
            f"data.path={data.path}: its {split} split holds no pair; prepare more pairs, or a "
            "larger --val-fraction" + (", or train.eval_every=0" if split == "val" else "")
        )
    ids = tokens.token_file(data, vocab, split)
    folder = Path(data.path)
    starts = tokens.index_file(folder / f"{split}.{tokens.INDEX}", len(ids))
    return Pairs(ids, starts, tokens.mask_file(folder / f"{split}.{tokens.MASK}", len(ids)))


def indices(n: int, *, seed: int, step: int, batch_size: int) -> np.ndarray:
    """The pairs of batch `step`: positions step * B ... of a walk through epochs, each a
    permutation of the n pairs drawn from (seed, epoch)."""
    at = step * batch_size + np.arange(batch_size)
    epochs, offsets = np.divmod(at, n)
    out = np.empty(batch_size, np.int64)
    for epoch in np.unique(epochs):
        order = np.random.default_rng([seed, int(epoch), 0x9A1]).permutation(n)
        out[epochs == epoch] = order[offsets[epochs == epoch]]
    return out


def batch_at(pairs: Pairs, *, seed: int, step: int, batch_size: int, seq_len: int,
             rows: slice = slice(None), reference: np.ndarray | None = None) -> dict:  # fmt: skip
    """Global batch `step` of pairs (or its `rows`), one pair a row (the module's
    docstring); with `reference` ([pairs, 2] precomputed log-probabilities), each row's."""
    index = indices(len(pairs), seed=seed, step=step, batch_size=batch_size)[rows]
    out = rows_of(pairs, index, seq_len)
    if reference is not None:
        out[REFERENCE] = reference[index]
    return out


def rows_of(pairs: Pairs, index: np.ndarray, seq_len: int) -> dict:
    """The pairs `index` as rows of seq_len + 1 ids."""
    n, width = len(index), seq_len + 1
    out = {
        "tokens": np.full((n, width), PAD_ID, np.int32),
        tokens.SEGMENT_IDS: np.full((n, width), PADDING, np.int32),
        tokens.POSITIONS: np.zeros((n, width), np.int32),
        tokens.LOSS_MASK: np.zeros((n, width), np.int32),
    }
    ids, mask = pairs.ids.open(), pairs.mask.open()
    for row, (first, middle, end) in enumerate(pairs.bounds(index)):
        length = end - first
        out["tokens"][row, :length] = ids[first:end]
        out[tokens.LOSS_MASK][row, :length] = mask[first:end]
        out[tokens.SEGMENT_IDS][row, : middle - first] = CHOSEN
        out[tokens.SEGMENT_IDS][row, middle - first : length] = REJECTED
        out[tokens.POSITIONS][row, :length] = np.r_[
            np.arange(middle - first), np.arange(end - middle)
        ]
    return out
