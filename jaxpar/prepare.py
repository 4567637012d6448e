"""`jaxpar prepare-data`: text, JSONL (a `text` field per line) or Parquet (a `text`
column) files -> token ids on disk: `train.bin` and `val.bin` (flat uint16, or uint32
for a vocabulary over 65536 ids) and a small `meta.json` (vocab size, dtype, token
counts, the tokenizer), what `data.source=tokens data.path=DIR` trains on.

The tokenizer is a local Hugging Face `tokenizers` one (`tokenizer.json`); its batched
encoder runs on all cores. Documents are separated by the tokenizer's end-of-text token
where it has one. Every `1 / val_fraction`-th unit goes to val.bin, never trained on: a
JSONL line, a Parquet row, or a paragraph of a text file (a text file is one document;
its paragraphs are the units, so that one long file still has a held-out split). Inputs
are streamed: a text file a paragraph at a time, JSONL a line at a time, Parquet a
record batch at a time; the output is written as it is encoded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxpar.errors import ConfigError

END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
BATCH = 256  # units encoded at once


def check(inputs: list[Path], tokenizer: Path, out: Path, val_fraction: float) -> None:
    """Every path and number, before anything is read."""
    for path in inputs:
        if not path.is_file():
            raise ConfigError(f"prepare-data: {path}: no such file")
    if not (tokenizer / "tokenizer.json").is_file():
        raise ConfigError(
            f"--tokenizer {tokenizer}: no tokenizer.json there; give the folder of a "
            "Hugging Face tokenizer (tokenizer.save() or save_pretrained writes it)"
        )
    if not 0 < val_fraction <= 0.5:
        raise ConfigError(f"--val-fraction {val_fraction}: give a share > 0 and <= 0.5")
    if any(p.suffix == ".parquet" for p in inputs):
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise ConfigError(
                "prepare-data: reading Parquet needs pyarrow; pip install 'jaxpar[parquet]'"
            ) from None
    if (out / "train.bin").exists():
        raise ConfigError(f"--out {out}: holds a prepared dataset already; give another --out")


def _pieces(path: Path) -> Iterator[tuple[str, bool]]:
    """(text, ends a document) of one input file."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield _text_of(json.loads(line), path, number), True
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(columns=["text"]):
            for text in batch.column(0).to_pylist():
                yield text or "", True
    else:  # a text file is one document, held out or trained on by its paragraphs
        with path.open(encoding="utf-8", errors="replace") as f:
            piece: list[str] = []
            for line in f:
                piece.append(line)
                if not line.strip() and len(piece) > 1:
                    yield "".join(piece), False
                    piece = []
            yield "".join(piece), True


def _text_of(row, path: Path, number: int) -> str:
    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
        raise ConfigError(f"prepare-data: {path}:{number}: no string field `text`")
    return row["text"]


def prepare(inputs: list[Path], tokenizer: Path, out: Path, val_fraction: float = 0.005) -> dict:
    """Tokenize `inputs` into `out`; returns what meta.json holds."""
    from tokenizers import Tokenizer

    check(inputs, tokenizer, out, val_fraction)
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    eos = next((tok.token_to_id(t) for t in END_OF_TEXT if tok.token_to_id(t) is not None), None)
    every = max(1, round(1 / val_fraction))
    out.mkdir(parents=True, exist_ok=True)
    counts = {"train": 0, "val": 0}
    documents = units = 0
    total = sum(p.stat().st_size for p in inputs)
    with (
        (out / "train.bin").open("wb") as train,
        (out / "val.bin").open("wb") as val,
        tqdm(total=total, unit="B", unit_scale=True, desc="prepare-data") as bar,
    ):
        pending: list[tuple[str, bool, str]] = []

        def flush() -> None:
            encoded = tok.encode_batch([text for text, _, _ in pending], add_special_tokens=False)
            for (text, ends, split), enc in zip(pending, encoded, strict=True):
                ids = enc.ids + ([eos] if ends and eos is not None else [])
                np.asarray(ids, dtype).tofile(train if split == "train" else val)
                counts[split] += len(ids)
                bar.update(len(text.encode("utf-8", errors="replace")))
            pending.clear()

        for path in inputs:
            for text, ends in _pieces(path):
                split = "val" if units % every == every - 1 else "train"
                pending.append((text, ends, split))
                documents, units = documents + ends, units + 1
                if len(pending) >= BATCH:
                    flush()
        flush()
    meta = {
        "vocab_size": vocab,
        "dtype": dtype.name,
        "train_tokens": counts["train"],
        "val_tokens": counts["val"],
        "documents": documents,
        "end_of_text_id": eos,
        "tokenizer": str(tokenizer.absolute()),
        "inputs": [str(p) for p in inputs],
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta
