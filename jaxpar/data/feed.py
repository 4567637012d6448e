"""Batches fed in epochs without replacement, from one source or a weighted mixture of
sources with phases: still a pure function of (seed, step), each process building only
its own rows.

A source's split is cut into windows of seq_len + 1 ids, window w starting at id
w * seq_len (the last id of one is the first of the next, as a target); what is left
past the last whole window is never read. A source's k-th draw (0 the first ever) is
in epoch k // n of its n windows, at that epoch's place k % n (jaxpar.data.order): an
epoch visits every window once, in an order of (seed, source, epoch) alone.

The rows of a run are drawn in blocks of BLOCK (1,000): within each block every source
draws round(weight x BLOCK) windows (largest remainders where the products are not
whole), in an order shuffled by (seed, the segment's first step, the block). A
segment is a stretch of steps with the same weights: the run's start, each phase's
from_step, and a resume whose mixture changed. It starts each source at the draws made
before it, so a phase switches at exactly its step and a source that runs out starts
its next epoch where it is. The last block of a segment is cut short where the next
begins. A row is a window of one source only; a batch's rows mix the sources."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from jaxpar.config.sections import Data, Train
from jaxpar.config.sections import Source as DataSource
from jaxpar.data import mixture, order
from jaxpar.data.tokens import Marks, TokenFile, load_marks, token_file, windows_at
from jaxpar.errors import ConfigError

BLOCK = 1000


@dataclass(frozen=True)
class Source:
    name: str
    tokens: np.ndarray | TokenFile
    marks: Marks

    def windows(self, seq_len: int) -> int:
        return (len(self.tokens) - 1) // seq_len

    @property
    def stream(self) -> int:  # its permutations' key: its name's, stable across runs
        return zlib.crc32(self.name.encode())


@dataclass(frozen=True)
class Segment:
    step: int  # its first
    weights: dict[str, float]
    drawn: dict[str, int]  # each source's draws before it

    def counts(self, names: list[str]) -> np.ndarray:
        """Each source's windows in a block: round(weight x BLOCK) by largest remainders."""
        exact = np.array([self.weights.get(n, 0.0) for n in names]) * BLOCK
        counts = np.floor(exact).astype(np.int64)
        short = BLOCK - counts.sum()
        counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
        return counts


class Feed:
    """(step, rows=slice(None)) -> the batch at `step`; see the module's docstring."""

    def __init__(self, sources, phases, *, seed: int, batch_size: int, seq_len: int, fixed=()):
        """`phases` (jaxpar.data.mixture.Phase) after the segments `fixed` (a resume's,
        recorded: their phases are history, kept as they were)."""
        self.sources, self.phases = list(sources), list(phases)
        self.names = [s.name for s in self.sources]
        self.seed, self.batch_size, self.seq_len = seed, batch_size, seq_len
        self.sizes = np.array([s.windows(seq_len) for s in self.sources])
        self.segments = [Segment(0, self.phases[0].weights, {}), *fixed]
        for phase in self.phases[1:]:
            if phase.from_step > self.segments[-1].step:  # drawn: as the segments so far say
                self.segments.append(
                    Segment(phase.from_step, phase.weights, self.drawn(phase.from_step))
                )

    def resumed(self, step: int, record: dict | None) -> tuple[Feed, list[str]]:
        """This feed from a checkpoint at `step` that recorded `record` (its position):
        the same where nothing changed; else a segment from `step` on that starts each
        source at its recorded draws, and what changed, in words."""
        if not record:
            return self, []
        fixed = [Segment(**s) for s in record["segments"]]
        kept = Feed(self.sources, self.phases, **self._sizes(), fixed=fixed)
        weights = [p for p in self.phases if p.from_step <= step][-1].weights  # the file's
        changes = _changes(record, {**kept.position(step), "weights": weights})
        if not changes:
            return kept, []
        drawn = {n: record["drawn"].get(n, 0) for n in self.names}
        fixed.append(Segment(step, weights, drawn))
        return Feed(self.sources, self.phases, **self._sizes(), fixed=fixed), changes

    def _sizes(self) -> dict:
        return {"seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len}

    def __call__(self, step: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        which, draws = self.draws(step, rows)
        starts = np.empty(which.shape, np.int64)
        for i, source in enumerate(self.sources):
            at = which == i
            if at.any():
                got = order.windows(draws[at], self.sizes[i], self.seed, source.stream)
                starts[at] = got * self.seq_len
        parts = [
            windows_at(s.tokens, starts[which == i], self.seq_len, s.marks)
            for i, s in enumerate(self.sources)
        ]
        return {
            key: _interleave(which, [p[key] for p in parts], len(self.sources)) for key in parts[0]
        }

    def draws(self, step: int, rows: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """(each row's source, its draw count in that source) at `step`."""
        segment = self._segment(step)
        first = (step - segment.step) * self.batch_size
        index = np.arange(first, first + self.batch_size)[rows]
        blocks = index // BLOCK
        which = np.empty(index.shape, np.int64)
        rank = np.empty(index.shape, np.int64)
        counts = segment.counts(self.names)
        for block in np.unique(blocks):
            at = blocks == block
            labels, ranks = self._block(segment, int(block), counts)
            which[at], rank[at] = labels[index[at] % BLOCK], ranks[index[at] % BLOCK]
        before = np.array([segment.drawn.get(n, 0) for n in self.names])
        return which, before[which] + blocks * counts[which] + rank

    def _segment(self, step: int) -> Segment:
        return [s for s in self.segments if s.step <= step][-1]

    def _block(self, segment: Segment, block: int, counts: np.ndarray):
        """The sources of a block's rows in order, and each row's rank among its source's."""
        if len(counts) == 1:  # one source: its rows in order (the shuffle's result too)
            return np.zeros(BLOCK, np.int64), np.arange(BLOCK)
        labels = np.repeat(np.arange(len(counts)), counts)
        rng = np.random.default_rng([self.seed, 1 << 20, segment.step, block])
        labels = rng.permutation(labels)
        ranks = np.empty(BLOCK, np.int64)
        for i in range(len(counts)):
            ranks[labels == i] = np.arange(counts[i])
        return labels, ranks

    def drawn(self, step: int) -> dict[str, int]:
        """Each source's draws before `step`."""
        segment = self._segment(step)
        rows = (step - segment.step) * self.batch_size
        counts = segment.counts(self.names)
        out = np.array([segment.drawn.get(n, 0) for n in self.names]) + rows // BLOCK * counts
        if rows % BLOCK:
            labels, _ = self._block(segment, rows // BLOCK, counts)
            out += np.bincount(labels[: rows % BLOCK], minlength=len(counts))
        return dict(zip(self.names, out.tolist(), strict=True))

    def position(self, step: int) -> dict:
        """Where the data stands after `step` steps: what a checkpoint records, and the
        figures of a metrics row (tokens fed; each source's epochs, fractional)."""
        drawn = self.drawn(step)
        epochs = {n: drawn[n] / int(size) for n, size in zip(self.names, self.sizes, strict=True)}
        return {
            "step": step,
            "tokens": sum(drawn.values()) * self.seq_len,
            "drawn": drawn,
            "epochs": epochs,
            "weights": self._segment(step).weights,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "segments": [vars(s) for s in self.segments if 0 < s.step <= step],
        }


def one(name: str, tokens, marks: Marks, train: Train) -> Feed:
    """A feed of one source, in epochs."""
    return Feed([Source(name, tokens, marks)], [mixture.Phase(0, {name: 1.0})], **_kw(train))


def mixed(data: Data, train: Train, vocab: int, split: str) -> Feed:
    """The feed of data.mixture's `split`s ("val": at the file's first weights, its phases
    left out, so that a held-out score is of the same windows all run; its feeds of each
    source alone in `.alone`)."""
    if data.path or data.source in (DataSource.FILE, DataSource.SYNTHETIC):
        given = f"data.path={data.path}" if data.path else f"data.source={data.source}"
        raise ConfigError(
            f"data.mixture={data.mixture} with {given}: a mixture names its prepared folders "
            f"itself; drop {given.split('=')[0]}"
        )
    mix = mixture.read(data.mixture)
    sources = [_source(data, train, vocab, name, path, split) for name, path in mix.paths.items()]
    if split == "train":
        return Feed(sources, mix.phases, **_kw(train))
    feed = Feed(sources, mix.phases[:1], **_kw(train))
    feed.alone = {s.name: one(s.name, s.tokens, s.marks, train) for s in sources}
    return feed


def _source(data: Data, train: Train, vocab: int, name: str, path: Path, split: str) -> Source:
    folder = replace(data, source=DataSource.TOKENS, path=str(path), mixture="")
    tokens = token_file(folder, vocab, split)
    if len(tokens) < train.seq_len + 1:
        raise ConfigError(
            f"data.mixture={data.mixture}: source {name!r} has {len(tokens)} ids in its "
            f"{split}.bin, fewer than train.seq_len+1 = {train.seq_len + 1}; prepare more "
            "text for it (or a larger --val-fraction), or drop it"
            + (", or set train.eval_every=0" if split == "val" else "")
        )
    return Source(name, tokens, load_marks(folder, train, tokens, split))


def _kw(train: Train) -> dict:
    return {"seed": train.seed, "batch_size": train.batch_size, "seq_len": train.seq_len}


def _changes(record: dict, now: dict) -> list[str]:
    """What differs between a recorded position and this feed's at the same step."""
    out = []
    for key in ("batch_size", "seq_len"):
        if record[key] != now[key]:
            out.append(f"train.{key} {record[key]} -> {now[key]}")
    names = list(dict.fromkeys([*record["weights"], *now["weights"]]))
    moved = [
        f"{n} {record['weights'].get(n, 0):g} -> {now['weights'].get(n, 0):g}"
        for n in names
        if record["weights"].get(n, 0) != now["weights"].get(n, 0)
    ]
    if moved:
        out.append("weights " + ", ".join(moved))
    if not out and record["drawn"] != now["drawn"]:
        out.append("the phases before this step")
    return out


def _interleave(which: np.ndarray, parts: list[np.ndarray], n: int) -> np.ndarray:
    """Rows back in their order: row r from parts[which[r]], in turn."""
    first = next(p for p in parts if len(p))
    out = np.empty((len(which), *first.shape[1:]), first.dtype)
    for i in range(n):
        out[which == i] = parts[i]
    return out
