"""`jaxpar prepare-data`: text, JSONL (a `text` field per line), Parquet (a `text`
column) files or Hugging Face `datasets` folders (save_to_disk's; jaxpar.data.columnar)
-> token ids on disk: `train.bin` and `val.bin` (flat uint16, or uint32
for a vocabulary over 65536 ids), `train.idx` and `val.idx` (the document index: each
document's first id, as int64 offsets), and a small `meta.json` (vocab size, dtype,
token counts, the tokenizer, the index's format), what `data.source=tokens
data.path=DIR` trains on. `--format chat` reads JSONL conversations instead
(jaxpar.data.chat) and writes `train.mask` and `val.mask` beside them too: one uint8 per id,
1 where it is trained on (the answers). `--format preference` reads JSONL preference pairs
(jaxpar.data.preference) and writes each as two documents, chosen then rejected, with
their masks: `data.path` of a `train.objective=dpo` run. `--format prompts` keeps JSONL
prompts, tokenized, with their other fields (jaxpar.data.prompts): `data.path` of a
`train.objective=grpo` run.

The tokenizer is a local Hugging Face `tokenizers` one (`tokenizer.json`). Text is
encoded by `workers` processes (jaxpar.data.encoding), into the same bytes at any count.
A text document ends with the tokenizer's end-of-text token where it has one (for the
model to learn where documents end); where documents start is the index's to say.
Every `1 / val_fraction`-th unit goes to val.bin, never trained on (0:
none; val.bin is then empty, and a run that evaluates says so): a
JSONL line, a Parquet row, a conversation, or a paragraph of a text file (a text file is
one document; its paragraphs are the units, so that one long file still has a held-out
split, and its paragraphs in each split form one document there). Inputs are streamed: a
text file a paragraph at a time, JSONL a line at a time, Parquet a record batch at a
time (a datasets folder likewise); the output is written as it is encoded.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxpar import disk
from jaxpar.data import chat, columnar, encoding, preference, prompts
from jaxpar.data import tokens as data
from jaxpar.errors import ConfigError

BATCH = 256  # units encoded at once
# the held-out share of documents by --format: a chat set is smaller, and its held-out
# loss counts only the answers' tokens
VAL_FRACTION = {"text": 0.005, "chat": 0.05, "preference": 0.05, "prompts": 0.05}
MAX_LENGTH = 1024  # --format preference: ids of prompt + answer at most (TRL's max_length)
MAX_IDS = 1 << 20  # the longest --max-length (train.seq_len's bound)
MAX_WORKERS = 1024  # --workers' bound: a process each


def expand(inputs: list[Path]) -> list[Path]:
    """INPUTs with their globs (a quoted `data/*.jsonl`, `shards/**/*.parquet`) expanded,
    sorted, in the order given: the files prepared, and their order in the output."""
    out = []
    for path in inputs:
        if path.exists() or not glob.has_magic(str(path)):
            out.append(path)
            continue
        matched = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
        if not matched:
            raise ConfigError(f"prepare-data: {path} matches no file; check the pattern")
        out.extend(p for p in matched if p.is_file())
    return out


def check(
    inputs: list[Path],
    tokenizer: Path,
    out: Path,
    val_fraction: float | None,
    fmt: str = "text",
    max_length: int = MAX_LENGTH,
    workers: int | None = None,
) -> None:
    """Every path and number, before anything is read (val_fraction None: the format's
    VAL_FRACTION; workers None: the machine's cores); nothing to check where the same
    request was prepared already."""
    _check_workers(workers, fmt)
    if prepared(inputs, tokenizer, out, val_fraction, fmt, max_length) is not None:
        return
    val_fraction = VAL_FRACTION[fmt] if val_fraction is None else val_fraction
    for path in inputs:
        if not columnar.is_dataset(path):
            chat.input_file(path, "prepare-data")
        if fmt != "text" and path.suffix != ".jsonl":
            raise ConfigError(
                f"prepare-data --format {fmt}: {path}: {fmt} lines are read from .jsonl "
                "files (one JSON object per line)"
            )
    if not 2 <= max_length <= MAX_IDS:
        raise ConfigError(
            f"--max-length {max_length}: a sequence holds a prompt and an answer; give 2 to "
            f"{MAX_IDS} ids (TRL's default is 1024)"
        )
    chat.tokenizer(tokenizer)  # read whole: a file that is not one is named now
    if not 0 <= val_fraction <= 0.5:
        raise ConfigError(
            f"--val-fraction {val_fraction}: give a share from 0 (hold nothing out) to 0.5"
        )
    for path in (p for p in inputs if p.suffix == ".parquet" or p.is_dir()):
        columnar.check(path)
    if (out / data.META).exists():
        raise ConfigError(
            f"--out {out}: holds a dataset prepared from other inputs, tokenizer or flags; "
            "give another --out (the same command again finds its own dataset there)"
        )
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(
            f"--out {out}: is not empty, and holds no complete dataset (no {data.META}: an "
            "incomplete one, or other files); remove it, or give another --out"
        )
    if fmt == "chat":  # every line, before anything is written
        template = chat.Template(tokenizer)
        for path in inputs:
            chat.check_file(path, template)
    if fmt == "prompts" and not sum(one is not None for one, _ in prompts.rows(inputs, tokenizer)):
        raise ConfigError(
            f"prepare-data: {', '.join(map(str, inputs))}: no prompt in it (empty, or blank "
            "lines only); nothing to ask"
        )
    # every line, before anything is written
    if fmt == "preference" and not sum(
        one is not None for one, _ in _pair_rows(inputs, tokenizer, max_length)
    ):
        raise ConfigError(
            f"prepare-data: {', '.join(map(str, inputs))}: no pair in it (empty, or blank "
            "lines only); nothing to train on"
        )


def _pair_rows(inputs: list[Path], tokenizer: Path, max_length: int):
    """(each line's pair or None for a blank line, its bytes), a line at a time; every
    line a pair the tokenizer can render, else ConfigError naming it. The tokenizer's
    end-of-text text ends each text answer, as TRL's does."""
    tok, template = chat.tokenizer(tokenizer), chat.Template(tokenizer)
    eos = chat.end_of_text(tok, template)
    for path in inputs:
        for row, where, size in chat.lines(path, "prepare-data"):
            if row is None:
                yield None, size
                continue
            kind = preference.check_row(row, where)
            if kind == "messages" and template.compiled is None:
                raise ConfigError(
                    f"prepare-data --format preference: {where}: conversations, but the "
                    "tokenizer has no chat template (tokenizer_config.json's `chat_template`); "
                    "give a tokenizer that has one, or write the pair as text"
                )
            yield preference.pair(tok, template, row, kind, eos, max_length, where), size


def _pad_id(tok, template: chat.Template, eos: int | None) -> int | None:
    """The id transformers pads with (tokenizer_config.json's pad_token where the
    vocabulary holds it, else the end of text, as TRL's trainers pad): where a reward
    model's ...ForSequenceClassification reads an answer's score, its last other id."""
    named = template.tokens.get("pad_token")
    pad = tok.token_to_id(named) if isinstance(named, str) else None
    return eos if pad is None else pad


def _check_workers(workers: int | None, fmt: str) -> None:
    if workers is not None and not 1 <= workers <= MAX_WORKERS:
        raise ConfigError(
            f"--workers {workers}: give 1 to {MAX_WORKERS} processes (default: this "
            f"machine's {encoding.cores()} cores)"
        )
    if workers is not None and workers > 1 and fmt != "text":
        raise ConfigError(
            f"--workers {workers}: --format {fmt} is encoded in one process (a chat template "
            "renders one line at a time); drop --workers, or give --workers 1"
        )


def _pieces(path: Path) -> Iterator[tuple[str, bool]]:
    """(text, ends a document) of one input file."""
    if path.suffix == ".jsonl":
        for row, where, _ in chat.lines(path, "prepare-data"):
            if row is not None:
                yield _text_of(row, where), True
    elif path.suffix == ".parquet" or path.is_dir():
        yield from ((text, True) for text in columnar.texts(path))
    else:  # a text file is one document, held out or trained on by its paragraphs
        piece: list[str] = []
        fix = "convert it to UTF-8 first (e.g. iconv -t utf-8), or give text, not a binary file"
        for line, _, _ in chat.text_lines(path, "prepare-data", fix):
            piece.append(line)
            if not line.strip() and len(piece) > 1:
                yield "".join(piece), False
                piece = []
        yield "".join(piece), True


def _text_of(row, where: str) -> str:
    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
        kinds = {"messages": "chat", "chosen": "preference", "prompt": "prompts"}
        held = [k for k in kinds if isinstance(row, dict) and k in row]
        hint = f"; a row with `{held[0]}` is --format {kinds[held[0]]}" if held else ""
        raise ConfigError(f"prepare-data: {where}: no string field `text`{hint}")
    return row["text"]


class _Split:
    """One split's files, written as documents arrive."""

    def __init__(self, out: Path, name: str, dtype: np.dtype, masked: bool):
        self.ids = (out / f"{name}.bin").open("wb")
        self.index = (out / f"{name}.{data.INDEX}").open("wb")
        self.mask = (out / f"{name}.{data.MASK}").open("wb") if masked else None
        self.dtype, self.count, self.trained, self.open_document = dtype, 0, 0, False

    def write(self, ids: list[int], ends: bool, mask: np.ndarray | None = None) -> None:
        """Ids of one piece; `ends`: the piece ends its document. (Written as bytes
        through the file: numpy's tofile drops the OS's errno when a disk is full.)"""
        if not self.open_document:
            self.index.write(np.asarray([self.count], data.INDEX_DTYPE).tobytes())
        self.ids.write(np.asarray(ids, self.dtype).tobytes())
        if self.mask is not None:
            self.mask.write(mask.astype(data.MASK_DTYPE).tobytes())
            self.trained += int(mask.sum())
        self.count += len(ids)
        self.open_document = not ends

    def close(self) -> None:
        with contextlib.ExitStack() as files:  # each closed, though one fails to flush
            for f in (self.ids, self.index, self.mask):
                if f is not None:
                    files.callback(f.close)


def prepare(
    inputs: list[Path],
    tokenizer: Path,
    out: Path,
    val_fraction: float | None = None,
    fmt: str = "text",
    max_length: int = MAX_LENGTH,
    workers: int | None = None,
) -> dict:
    """Tokenize `inputs` into `out`; returns what meta.json holds. `fmt`: text (text,
    JSONL `text`, Parquet or datasets folder documents, encoded by `workers` processes,
    None: the machine's cores), chat (JSONL conversations, with a loss mask) or
    preference (JSONL pairs, each answer's sequence at most `max_length` ids);
    `val_fraction` None: the format's VAL_FRACTION. The same request again finds its
    dataset there and returns its meta (a walk-through run twice)."""
    if (done := prepared(inputs, tokenizer, out, val_fraction, fmt, max_length)) is not None:
        return done
    check(inputs, tokenizer, out, val_fraction, fmt, max_length, workers)
    # written whole into a folder beside --out, renamed into place once complete: a
    # refused or killed run leaves no --out that blocks its retry (the next one clears
    # the partial folder)
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    then = "free space (or give another --out), then run the same command again"
    try:
        with disk.writing(out.parent.absolute(), f"the dataset for --out {out}", then):
            workers = encoding.cores() if workers is None else workers
            meta = _prepare(inputs, tokenizer, partial, val_fraction, fmt, max_length, workers)
        os.replace(partial, out)  # over an empty --out, if one was made
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return meta


def _request(inputs, tokenizer: Path, val_fraction, fmt: str, max_length: int) -> dict:
    """What makes a dataset: meta.json's record of it, compared by `prepared`."""
    return {
        "inputs": [str(p) for p in inputs],
        "input_bytes": [_bytes(p) for p in inputs],
        "tokenizer": str(tokenizer.absolute()),
        "format": fmt,
        "val_fraction": VAL_FRACTION[fmt] if val_fraction is None else val_fraction,
        "max_length": max_length,
    }


def _bytes(path: Path) -> int | None:
    if columnar.is_dataset(path):
        return columnar.size(path)
    return path.stat().st_size if path.is_file() else None


def prepared(inputs, tokenizer: Path, out: Path, val_fraction, fmt: str, max_length: int):
    """The meta of the dataset in `out` if it was prepared by this same request (the same
    inputs, of the same sizes, tokenizer and flags), else None."""
    try:
        meta = json.loads((out / data.META).read_text())
    except (OSError, ValueError):
        return None
    asked = _request(inputs, tokenizer, val_fraction, fmt, max_length)
    return meta if all(meta.get(k) == v for k, v in asked.items()) else None


def _prepare(
    inputs: list[Path],
    tokenizer: Path,
    out: Path,
    val_fraction: float | None,
    fmt: str,
    max_length: int,
    workers: int,
) -> dict:
    val_fraction = VAL_FRACTION[fmt] if val_fraction is None else val_fraction
    tok = chat.tokenizer(tokenizer)
    vocab = tok.get_vocab_size()
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    template = chat.Template(tokenizer)
    eos = chat.end_of_text(tok, template)
    eos = None if eos is None else tok.token_to_id(eos)
    every = max(1, round(1 / val_fraction)) if val_fraction else 0
    masked = fmt not in ("text", "prompts")
    names = () if fmt == "prompts" else ("train", "val")
    splits = {name: _Split(out, name, dtype, masked) for name in names}
    total = sum(_bytes(p) for p in inputs)
    try:
        # (disable=None: no bar where the output is not a terminal, as in a log or a pipe)
        with tqdm(
            total=total, unit="B", unit_scale=True, desc="prepare-data", leave=False, disable=None
        ) as bar:
            if fmt == "prompts":
                counts = prompts.write(inputs, tokenizer, out, every, bar)
            elif fmt == "preference":
                counts = _pairs(inputs, tokenizer, every, splits, bar, max_length)
            elif fmt == "chat":
                counts = _chat(inputs, tok, tokenizer, eos, every, splits, bar)
            else:
                with encoding.Encoder(tok, tokenizer / "tokenizer.json", dtype, workers) as enc:
                    counts = _text(inputs, enc, eos, every, splits, bar)
    finally:
        with contextlib.ExitStack() as each:
            for split in splits.values():
                each.callback(split.close)
    meta = {
        "vocab_size": vocab,
        "dtype": dtype.name,
        "train_tokens": splits["train"].count if splits else 0,
        "val_tokens": splits["val"].count if splits else 0,
        **counts,
        "end_of_text_id": eos,
        "pad_id": _pad_id(tok, template, eos),
        **_request(inputs, tokenizer, val_fraction, fmt, max_length),
    }
    if splits:
        meta[data.INDEX_META] = {
            "files": f"{{split}}.{data.INDEX}",
            "dtype": data.INDEX_DTYPE.name,
            "holds": "the offset in {split}.bin of each document's first id, ascending from 0",
        }
    if masked:
        meta[data.MASK_META] = {
            "files": f"{{split}}.{data.MASK}",
            "dtype": data.MASK_DTYPE.name,
            "holds": "one per id of {split}.bin: 1 where it is trained on (an answer), else 0",
            "trained_tokens": {name: split.trained for name, split in splits.items()},
        }
    (out / data.META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _text(inputs, encoder: encoding.Encoder, eos, every: int, splits: dict, bar) -> dict:
    """Documents of text, JSONL, Parquet files and datasets folders, encoded BATCH units
    at a time by `encoder`'s workers, written in order."""
    seen = {"documents": 0, "written": 0}

    def units():
        pieces = (piece for path in inputs for piece in _pieces(path))
        for n, (text, ends) in enumerate(pieces):
            seen["documents"] += ends
            seen["written"] += bool(text.strip())
            yield text, ends, data.split_of(n, every)

    unit = units()
    chunks = iter(lambda: list(itertools.islice(unit, BATCH)), [])
    for chunk, encoded in encoder.map(chunks):
        for (text, ends, split), ids in zip(chunk, encoded, strict=True):
            splits[split].write(
                np.append(ids, ids.dtype.type(eos)) if ends and eos is not None else ids, ends
            )
            bar.update(len(text.encode("utf-8", errors="replace")))
    if not seen["written"]:
        raise ConfigError(
            f"prepare-data: {', '.join(map(str, inputs))}: no text in it (empty, or blank "
            "lines only); nothing to train on"
        )
    return {"documents": seen["documents"]}


def _chat(inputs, tok, tokenizer: Path, eos, every: int, splits: dict, bar) -> dict:
    """Conversations (or prompt/completion pairs) of JSONL files, a line at a time."""
    template = chat.Template(tokenizer)
    documents = skipped = 0
    for path in inputs:
        for row, where, size in chat.lines(path, "prepare-data"):
            bar.update(size)
            if row is None:
                continue
            kind = chat.check_row(row, where)
            one = chat.example(tok, template, row, kind, eos, where)
            if one is None:
                skipped += 1
                continue
            split = data.split_of(documents, every)
            splits[split].write(one.ids, True, one.mask)
            documents += 1
    if not documents:
        raise ConfigError(
            f"prepare-data: {', '.join(map(str, inputs))}: no conversation with an assistant "
            "turn; nothing to train on"
        )
    return {"documents": documents, "skipped_without_answer": skipped}


def _pairs(inputs, tokenizer: Path, every: int, splits: dict, bar, max_length) -> dict:
    """Preference pairs of JSONL files, a line at a time: two documents each."""
    pairs, truncated, longest = {"train": 0, "val": 0}, 0, 0
    for one, size in _pair_rows(inputs, tokenizer, max_length):
        bar.update(size)
        if one is None:
            continue
        split = data.split_of(sum(pairs.values()), every)
        for document in one.documents():
            splits[split].write(document.ids, True, document.mask)
        pairs[split] += 1
        truncated += one.truncated
        longest = max(longest, sum(len(d.ids) for d in one.documents()))
    return {
        "documents": 2 * sum(pairs.values()),
        data.PAIRS_META: {
            "pairs": pairs,
            "max_length": max_length,
            "truncated": truncated,
            "longest_pair": longest,
            "holds": "documents 2i and 2i + 1 of each split are pair i's chosen and rejected "
            "answers, each prompt + answer (the answer masked)",
        },
    }


def said(meta: dict, out, wrote: str) -> str:
    """What `jaxpar prepare-data` says of a folder it `wrote` (or found prepared): its
    counts, and for prompts and pairs what to train them with."""
    if asked := meta.get("prompts"):
        return (
            f"{wrote} {out}: {asked['prompts']['train']:,} training and "
            f"{asked['prompts']['val']:,} held-out prompts (the longest "
            f"{asked['longest_prompt']:,} ids): train with train.objective=grpo"
        )
    trained = meta.get("loss_mask", {}).get("trained_tokens", {}).get("train")
    lines = [
        f"{wrote} {out}: {meta['train_tokens']:,} training and {meta['val_tokens']:,} "
        f"held-out tokens ({meta['dtype']}, vocab {meta['vocab_size']:,}) from "
        f"{meta['documents']:,} documents"
        + ("" if trained is None else f"; {trained:,} training tokens are answers")
    ]
    if meta.get("skipped_without_answer"):
        lines.append(
            f"skipped {meta['skipped_without_answer']:,} conversation(s) with no assistant "
            "turn: nothing in them to train on"
        )
    if pairs := meta.get("pairs"):
        lines.append(
            f"{pairs['pairs']['train']:,} training and {pairs['pairs']['val']:,} held-out "
            f"pairs; {pairs['truncated']:,} truncated to --max-length {pairs['max_length']}; "
            f"the longest pair is {pairs['longest_pair']:,} ids: train with train.seq_len >= "
            f"{pairs['longest_pair'] - 1} ({pairs['longest_pair']:,} for train.objective=reward)"
        )
    return "\n".join(lines)
