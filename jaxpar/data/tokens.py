"""Batches that are a pure function of (seed, step): reproducible, independent of the mesh.

A batch is windows of seq_len + 1 ids drawn at random starts over the whole stream of a
split (any window can be drawn, the last included). Where a prepared folder has a
document index (`{split}.idx`, `jaxpar prepare-data`), `data.packing=documents` adds
each window's `segment_ids` and `positions` (jaxpar.nn.documents): a window is cut at every
document start it holds, so each piece is a sequence of its own, attending only to
itself, at positions from 0. A document longer than a window, or crossing its start, is
split the same way: the piece in the window starts at position 0 wherever it began (as
if it were a document of its own), so positions never reach seq_len, what learned
position tables hold, and a window's batch needs nothing outside it. Where the folder
has a loss mask (`{split}.mask`, `--format chat`), `train.loss_mask` adds the window's
`loss_mask`. Document starts are read from the index, never found by an end-of-text id
(which also occurs inside answers).

Sources: the embedded corpus (byte-level text of the `pydoc_data` topics that every
CPython carries, no download), a user's text file, synthetic sequences, or token ids on
disk of any size (`data.source=tokens`): memory-mapped, never read whole, each batch
reading only its own rows' windows (each process only its rows), through a memmap made
anew for each batch (as nanoGPT does, so that no page cache is pinned by a long-lived
map).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxpar.config.sections import ConfigError, Data, LossMask, Model, Order, Packing, Source, Train

BYTE_VOCAB = 256
# a batch's keys besides `tokens` (what they mean: jaxpar.nn.documents)
SEGMENT_IDS, POSITIONS, LOSS_MASK = "segment_ids", "positions", "loss_mask"


def corpus_bytes() -> bytes:
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")


META = "meta.json"  # beside train.bin and val.bin in a prepared folder
HELD_OUT = 0.1  # the tail of the corpus or a text file that training never reads (eval_loss)
EVAL_STREAM = 1 << 40  # synthetic eval batches draw from steps this far past any training
SCAN_ELEMENTS = 1 << 24  # ids checked per read when a file is scanned against the vocab


@dataclass(frozen=True)
class TokenFile:
    """Token ids on disk, opened as a memmap per batch."""

    path: Path
    dtype: np.dtype
    offset: int  # bytes before the first id (a .npy header)
    count: int  # ids

    def __len__(self) -> int:
        return self.count

    def open(self) -> np.ndarray:
        return np.memmap(
            self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.count,)
        )

    def __getitem__(self, index) -> np.ndarray:
        return self.open()[index]


def load_tokens(data: Data, train: Train, model: Model) -> np.ndarray | TokenFile | None:
    """The token stream (None for synthetic data), checked against the config."""
    if data.path and data.source not in (Source.FILE, Source.TOKENS):
        raise ConfigError(
            f"data.path={data.path!r} with data.source={data.source}: the path is read "
            "only with data.source=file or tokens; add data.source=file, or drop data.path"
        )
    if data.source is Source.SYNTHETIC:
        return None
    if data.source is Source.TOKENS:
        tokens = token_file(data, model.vocab)
    else:
        tokens = np.frombuffer(_text(data, model), dtype=np.uint8)
    if data.source is not Source.TOKENS:  # the tail is held out, whether or not evaluated
        tokens = tokens[: len(tokens) - held_out_bytes(len(tokens))]
    _check_length(tokens, data, train, "")
    return tokens


def byte_level(data: Data) -> bool:
    """Whether data.* reads text as bytes, each byte its id (the corpus, a text file)."""
    return data.source in (Source.CORPUS, Source.FILE)


def split_of(unit: int, every: int) -> str:
    """prepare-data's split of its `unit`-th unit: every `every`-th is held out ("val"),
    none where `every` is 0 (--val-fraction 0)."""
    return "val" if every and unit % every == every - 1 else "train"


def held_out_bytes(n: int) -> int:
    return int(n * HELD_OUT)


def load_eval_tokens(data: Data, train: Train, model: Model) -> np.ndarray | TokenFile | None:
    """The held-out tokens (None for synthetic data, whose eval batches are fresh draws):
    the corpus's or a text file's last tenth, a prepared folder's val.bin."""
    if data.source is Source.SYNTHETIC:
        return None
    if data.source is Source.TOKENS:
        if not Path(data.path).is_dir():
            raise ConfigError(
                f"train.eval_every={train.eval_every} with data.path={data.path}: a flat file "
                "of ids has no held-out split; give a folder from `jaxpar prepare-data` (its "
                "val.bin), or train.eval_every=0"
            )
        tokens = token_file(data, model.vocab, split="val")
        if not len(tokens):
            raise ConfigError(
                f"train.eval_every={train.eval_every} with data.path={data.path}: its val.bin "
                "is empty (prepared with --val-fraction 0, or from too few documents to hold "
                "one out); set train.eval_every=0, or prepare it with a larger --val-fraction"
            )
    else:
        text = np.frombuffer(_text(data, model), dtype=np.uint8)
        tokens = text[len(text) - held_out_bytes(len(text)) :]
    _check_length(tokens, data, train, " (its held-out part)")
    return tokens


def _check_length(tokens, data: Data, train: Train, part: str) -> None:
    need = train.seq_len + 1  # one window: seq_len inputs and the target after them
    if len(tokens) < need:
        where = "the corpus" if data.source is Source.CORPUS else f"data.path={data.path}"
        unit = "tokens" if data.source is Source.TOKENS else "bytes"
        raise ConfigError(
            f"{where}{part} has {len(tokens)} {unit}, fewer than train.seq_len+1 = "
            f"{need}; use a longer text or a smaller train.seq_len"
        )


def _text(data: Data, model: Model) -> bytes:
    if model.vocab < BYTE_VOCAB:
        raise ConfigError(
            f"model.vocab={model.vocab}: byte-level text has {BYTE_VOCAB} "
            f"symbols; set model.vocab={BYTE_VOCAB} (or more), or "
            "data.source=synthetic"
        )
    if data.source is Source.CORPUS:
        return corpus_bytes()
    path = Path(data.path)
    if not data.path or not path.is_file():
        raise ConfigError(
            f"data.path={data.path!r}: no such file; give a text file with "
            "data.source=file, or use data.source=corpus"
        )
    return path.read_bytes()


def token_file(data: Data, vocab: int, split: str = "train") -> TokenFile:
    """data.path as token ids: a prepared folder's `split`.bin (its meta.json read), a
    .npy file, or a flat binary of data.dtype; every id checked below `vocab`."""
    path = Path(data.path)
    if not data.path or not path.exists():
        raise ConfigError(
            f"data.path={data.path!r}: no such file or folder; give the folder `jaxpar "
            "prepare-data` wrote, a flat binary of token ids, or a .npy file"
        )
    if path.is_dir():
        meta = meta_of(path)
        if meta["vocab_size"] > vocab:
            raise ConfigError(
                f"model.vocab={vocab}, but {path / META} says the tokenizer has "
                f"{meta['vocab_size']} ids; set model.vocab={meta['vocab_size']} (or more)"
            )
        return _flat(path / f"{split}.bin", meta["dtype"], vocab, scan=False)
    if path.suffix == ".npy":
        return _npy(path, vocab)
    return _flat(path, np.dtype(str(data.dtype)), vocab, scan=True)


def tokenizer_of(data: Data) -> str | None:
    """The tokenizer a prepared folder of data.path was made with (its meta.json says),
    or None."""
    folder = Path(data.path)
    if not data.path or not (folder / META).is_file():
        return None
    try:
        return json.loads((folder / META).read_text()).get("tokenizer")
    except (OSError, ValueError, AttributeError):
        return None


def meta_of(folder: Path) -> dict:
    try:
        meta = json.loads((folder / META).read_text())
        meta = {**meta, "vocab_size": int(meta["vocab_size"]), "dtype": np.dtype(meta["dtype"])}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"data.path={folder}: {META} missing or unreadable ({e}); give a folder that "
            "`jaxpar prepare-data` wrote"
        ) from None
    return meta


def _flat(path: Path, dtype: np.dtype, vocab: int, scan: bool) -> TokenFile:
    if not path.is_file():
        raise ConfigError(f"data.path: {path}: no such file")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(
            f"data.path={path}: {size} bytes is not a whole number of {dtype.name} ids "
            f"({dtype.itemsize} bytes each); set data.dtype to the dtype it was written in"
        )
    tokens = TokenFile(path, dtype, 0, size // dtype.itemsize)
    if scan:
        _check_ids(tokens, vocab)
    return tokens


def _npy(path: Path, vocab: int) -> TokenFile:
    try:
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.path={path}: not a .npy file numpy can map ({e})") from None
    if array.ndim != 1 or array.dtype.kind not in "ui":
        raise ConfigError(
            f"data.path={path}: a {array.dtype} array of shape {list(array.shape)}; give a "
            "flat (1-d) array of integer token ids"
        )
    tokens = TokenFile(path, array.dtype, array.offset, array.shape[0])
    _check_ids(tokens, vocab)
    return tokens


def _check_ids(tokens: TokenFile, vocab: int) -> None:
    """Every id below `vocab`, read in chunks through a buffer (neither held whole nor
    mapped: the pages of a scan would count against the process's memory)."""
    with tokens.path.open("rb") as f:
        f.seek(tokens.offset)
        for start in range(0, tokens.count, SCAN_ELEMENTS):
            chunk = np.fromfile(f, tokens.dtype, min(SCAN_ELEMENTS, tokens.count - start))
            bad = np.flatnonzero(chunk >= vocab)
            if bad.size:
                at = start + int(bad[0])
                raise ConfigError(
                    f"data.path={tokens.path}: token id {int(chunk[bad[0]])} at offset {at} "
                    f"is not below model.vocab={vocab}; raise model.vocab, or check data.dtype"
                )


# {split}.idx and {split}.mask beside {split}.bin, described in meta.json under these keys
INDEX, MASK = "idx", "mask"
INDEX_META, MASK_META = "index", "loss_mask"
PAIRS_META = "pairs"  # a preference folder's pair counts (jaxpar.data.pairs)
INDEX_DTYPE, MASK_DTYPE = np.dtype("<i8"), np.dtype(np.uint8)


@dataclass(frozen=True)
class Marks:
    """What a prepared folder says of its ids besides the ids, as the config asks."""

    starts: TokenFile | np.ndarray | None = None  # each document's first id (packing=documents)
    mask: TokenFile | None = None  # 1 per trained id (train.loss_mask)


def uses(data: Data, train: Train) -> tuple[bool, bool]:
    """(pack documents, mask the loss): data.packing and train.loss_mask resolved
    against what the data has; ConfigError where one asks for what it lacks."""
    folder = Path(data.path) if data.source is Source.TOKENS else None
    meta = meta_of(folder) if folder is not None and folder.is_dir() else {}
    where = f"data.path={data.path}" if data.path else f"data.source={data.source}"
    fix = "prepare it with `jaxpar prepare-data` (which writes {})"
    if data.packing is Packing.DOCUMENTS and INDEX_META not in meta:
        raise ConfigError(
            f"data.packing=documents: {where} has no document index; "
            + fix.format("train.idx for text, JSONL and Parquet")
            + ", or use data.packing=stream"
        )
    if train.loss_mask is LossMask.TRUE and MASK_META not in meta:
        raise ConfigError(
            f"train.loss_mask=true: {where} has no loss mask; "
            + fix.format("train.mask with --format chat")
            + ", or use train.loss_mask=false"
        )
    packing = data.packing is Packing.DOCUMENTS or (
        data.packing is Packing.AUTO and INDEX_META in meta
    )
    masked = train.loss_mask is LossMask.TRUE or (
        train.loss_mask is LossMask.AUTO and MASK_META in meta
    )
    return packing, masked


def load_marks(data: Data, train: Train, tokens, split: str = "train") -> Marks:
    """The document starts and loss mask of `split` that the config uses, checked
    against its ids."""
    packing, masked = uses(data, train)
    folder = Path(data.path)
    starts = index_file(folder / f"{split}.{INDEX}", len(tokens)) if packing else None
    mask = mask_file(folder / f"{split}.{MASK}", len(tokens)) if masked else None
    return Marks(starts, mask)


def index_file(path: Path, count: int) -> TokenFile:
    """The document index, checked a chunk at a time through a buffer (ascending offsets
    from 0, each below `count`)."""
    if not path.is_file():
        raise ConfigError(f"data.path: {path}: no such file; prepare the folder again")
    size = path.stat().st_size
    bad = size % INDEX_DTYPE.itemsize or not size
    last = -1
    with path.open("rb") as f:
        while not bad and (chunk := np.fromfile(f, INDEX_DTYPE, SCAN_ELEMENTS)).size:
            bad = (last < 0 and chunk[0] != 0) or (np.diff(chunk, prepend=last) <= 0).any()
            last = int(chunk[-1])
    if bad:
        raise ConfigError(
            f"data.path: {path} is not a document index (ascending int64 offsets from 0); "
            "prepare the folder again"
        )
    if last >= count:
        raise ConfigError(
            f"data.path: {path} starts a document at id {last}, but its ids number {count}; "
            "the index and the ids disagree: prepare the folder again"
        )
    return TokenFile(path, INDEX_DTYPE, 0, size // INDEX_DTYPE.itemsize)


def mask_file(path: Path, count: int) -> TokenFile:
    if not path.is_file():
        raise ConfigError(f"data.path: {path}: no such file; prepare the folder again")
    marks = path.stat().st_size // MASK_DTYPE.itemsize
    if marks != count:
        raise ConfigError(
            f"data.path: {path} holds {marks} loss-mask entries for {count} ids; they must "
            "be one per id: prepare the folder again"
        )
    return TokenFile(path, MASK_DTYPE, 0, count)


def describe(data: Data, train: Train, what: str | None = None) -> str:
    """The data source in words, for the start-up summary (`what`: the source's own, a
    mixture's, in place of data.source's)."""
    if what is None:
        what = {
            Source.CORPUS: "corpus: the pydoc topics CPython ships, as bytes",
            Source.FILE: f"file: {data.path}, as bytes",
            Source.SYNTHETIC: "synthetic: counting sequences with a random start and stride",
            Source.TOKENS: f"tokens: {data.path}, memory-mapped",
        }[data.source]
        if data.source is not Source.SYNTHETIC:
            how = "in epochs" if data.order is Order.EPOCHS else "windows drawn with replacement"
            what += f", {how}"
    packing, masked = uses(data, train)
    if packing:
        what += "; documents packed, each attending to itself"
    if masked:
        what += "; trained on the loss mask's targets only"
    return f"{what}; {train.batch_size} x {train.seq_len} tokens a step"


def batch_at(
    tokens: np.ndarray | TokenFile | None,
    *,
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    vocab: int,
    rows: slice = slice(None),
    marks: Marks = Marks(),
) -> dict[str, np.ndarray]:
    """Global batch `step`, or its `rows` only (each process builds its own):
    {"tokens": int32 [rows, seq_len + 1]}, and with `marks` the windows' segment ids,
    positions and loss mask (the module's docstring). The random draws are the global
    batch's whichever rows are built, so the rows are the same as in the whole batch."""
    rng = np.random.default_rng([seed, step])
    if tokens is None:
        # Each row counts up from a random start by a random stride: learnable, not trivial.
        start = rng.integers(0, vocab, size=(batch_size, 1))[rows]
        stride = rng.integers(1, 4, size=(batch_size, 1))[rows]
        out = (start + stride * np.arange(seq_len + 1)) % vocab
    else:
        # every window of seq_len + 1 ids, the last one included
        starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)[rows]
        return windows_at(tokens, starts, seq_len, marks)
    return {"tokens": out.astype(np.int32)}


def windows_at(tokens, starts: np.ndarray, seq_len: int, marks: Marks = Marks()) -> dict:
    """The windows of seq_len + 1 ids at `starts`, with their marks."""
    at = starts[:, None] + np.arange(seq_len + 1)
    ids = tokens.open() if isinstance(tokens, TokenFile) else tokens
    return {"tokens": ids[at].astype(np.int32), **_marked(marks, starts, at)}


def _marked(marks: Marks, starts: np.ndarray, at: np.ndarray) -> dict[str, np.ndarray]:
    """The windows' segment ids, positions and loss mask, as `marks` has them."""
    out = {}
    if marks.starts is not None:
        index = marks.starts.open() if isinstance(marks.starts, TokenFile) else marks.starts
        # the document of each id (searched with the index's own dtype: no copy of it)
        document = np.searchsorted(index, at.astype(INDEX_DTYPE), side="right") - 1
        first = np.maximum(index[document], starts[:, None])  # its piece's first id
        out[SEGMENT_IDS] = (document - document[:, :1]).astype(np.int32)
        out[POSITIONS] = (at - first).astype(np.int32)
    if marks.mask is not None:
        out[LOSS_MASK] = marks.mask.open()[at].astype(np.int32)
    return out
