"""Documents in columnar files, a `text` column of strings, read a record batch at a
time with pyarrow: Parquet files, and Hugging Face `datasets` folders as
`Dataset.save_to_disk` writes them (state.json naming the folder's Arrow files, IPC
streams, in their order). A `DatasetDict`'s folder (dataset_dict.json) holds one such
folder per split: one of them is given."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from jaxpar.errors import ConfigError

STATE = "state.json"  # a saved Dataset's list of its Arrow files
SPLITS = "dataset_dict.json"  # a saved DatasetDict's list of its splits


def is_dataset(path: Path) -> bool:
    """`path` is a folder `datasets` saved (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / STATE).is_file() or (path / SPLITS).is_file())


def _pyarrow():
    try:
        import pyarrow as pa
    except ImportError:
        raise ConfigError(
            "prepare-data: reading Parquet or a datasets folder needs pyarrow; "
            "pip install 'jaxpar[parquet]'"
        ) from None
    return pa


def arrow_files(folder: Path) -> list[Path]:
    """A saved Dataset's Arrow files in their order, or ConfigError saying what is wrong."""
    if (folder / SPLITS).is_file() and not (folder / STATE).is_file():
        splits = _json(folder / SPLITS).get("splits") or []
        first = f"{folder / splits[0]}" if splits else f"{folder}/SPLIT"
        raise ConfigError(
            f"prepare-data: {folder}: a DatasetDict (splits {', '.join(splits) or 'none'}); "
            f"give one split's folder, e.g. {first}"
        )
    files = [folder / f.get("filename", "") for f in _json(folder / STATE).get("_data_files", [])]
    if not files:
        raise ConfigError(f"prepare-data: {folder}/{STATE}: names no Arrow file (_data_files)")
    if missing := [f.name for f in files if not f.is_file()]:
        raise ConfigError(
            f"prepare-data: {folder}: {STATE} names {', '.join(missing)}, not in the folder "
            "(an incomplete copy?); copy the whole folder save_to_disk wrote"
        )
    return files


def _json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"prepare-data: {path}: not the JSON datasets writes ({e})") from None
    if not isinstance(out, dict):
        raise ConfigError(f"prepare-data: {path}: not the JSON datasets writes (no object)")
    return out


def size(path: Path) -> int:
    """The bytes a file or a saved Dataset's Arrow files hold."""
    return (
        sum(f.stat().st_size for f in arrow_files(path)) if path.is_dir() else path.stat().st_size
    )


def check(path: Path) -> None:
    """A Parquet file or a saved Dataset that pyarrow opens, with a string `text` column."""
    pa = _pyarrow()
    for where, schema in _schemas(path, pa):
        if "text" not in schema.names:
            raise ConfigError(
                f"prepare-data: {where}: no `text` column (it has "
                f"{', '.join(schema.names) or 'none'}); documents are read from a column "
                "named text"
            )
        kind = schema.field("text").type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ConfigError(f"prepare-data: {where}: its `text` column holds {kind}, not strings")


def _schemas(path: Path, pa):
    import pyarrow.parquet as pq

    files = arrow_files(path) if path.is_dir() else [path]
    for f in files:
        try:
            if path.is_dir():
                with pa.ipc.open_stream(pa.memory_map(str(f))) as stream:
                    yield f, stream.schema
            else:
                yield f, pq.ParquetFile(f).schema_arrow
        except (pa.ArrowException, OSError) as e:
            kind = "an Arrow stream" if path.is_dir() else "a Parquet file"
            raise ConfigError(f"prepare-data: {f}: not {kind} pyarrow reads ({e})") from None


def texts(path: Path) -> Iterator[str]:
    """The `text` of each row of a Parquet file or a saved Dataset, in order."""
    pa = _pyarrow()
    if not path.is_dir():
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(columns=["text"]):
            yield from (text or "" for text in batch.column(0).to_pylist())
        return
    for f in arrow_files(path):
        with pa.ipc.open_stream(pa.memory_map(str(f))) as stream:
            for batch in stream:
                yield from (text or "" for text in batch.column("text").to_pylist())
