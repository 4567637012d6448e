"""What `jaxpar eval` scores: a run directory's checkpoint or hf:DIR, placed as `jaxpar
generate` places it, and its tokenizer folder."""

from __future__ import annotations

from pathlib import Path

from jaxpar import hf
from jaxpar.data import tokens
from jaxpar.errors import ConfigError
from jaxpar.evaluation.text import Text
from jaxpar.generation import decoding


def check(source: str, command: str = "eval") -> None:
    """The source's folder, before jax starts (for `command`: eval or generate)."""
    wanted = "give a run directory that `jaxpar train` wrote"
    if source.startswith(hf.SCHEME):
        hf.directory_of(source)
    elif not Path(source).is_dir():
        raise ConfigError(f"{command}: {source}: no such folder; {wanted}, or hf:DIR")
    elif not (Path(source) / "checkpoints").is_dir():
        raise ConfigError(
            f"{command}: {source}: no checkpoints there; {wanted} (with checkpoint.final, the "
            "default), or hf:DIR"
        )


def results_folder(source: str) -> Path:
    """Where the results go unless --out says: the run directory's eval/, or hf:DIR's."""
    folder = hf.directory_of(source) if source.startswith(hf.SCHEME) else Path(source)
    return folder / "eval"


def tokenizer_of(
    source: str, given: str | Path | None, loaded: decoding.Loaded, command: str = "eval"
) -> Path | None:
    """The tokenizer folder: the one given, else hf:DIR's own folder, else the one the
    run's data.path was prepared with (its meta.json says); for generate, None where the
    run was trained on bytes (data.source=corpus or file)."""
    if given:
        return Path(given)
    if source.startswith(hf.SCHEME):
        return hf.directory_of(source)
    recorded = tokens.tokenizer_of(loaded.cfg.data)
    if recorded is None and command == "generate" and tokens.byte_level(loaded.cfg.data):
        return None
    if recorded is None:
        raise ConfigError(
            f"{command}: {source} was not trained on data prepared with a tokenizer "
            f"(data.path={loaded.cfg.data.path or 'none'}); give --tokenizer DIR, the "
            "tokenizer of its ids"
        )
    return Path(recorded)


def load(source: str, tokenizer, overrides: list[str], step: int | None = None, devices=None):
    """(the model of `source` on a decoding layout, its Text)."""
    check(source)
    if tokenizer:  # read before the model is
        text = Text(Path(tokenizer))
    loaded = decoding.load(source, list(overrides), step, devices, command="eval")
    if not tokenizer:
        text = Text(tokenizer_of(source, None, loaded))
    return loaded, text
