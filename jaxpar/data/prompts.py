"""Prompts for GRPO (`jaxpar prepare-data FILE.jsonl --format prompts`), and the prompts of
each rollout, a pure function of (seed, rollout).

A line is `{"prompt": text}` (continued as it is), `{"prompt": [messages]}` or
`{"messages": [messages]}` (rendered with the tokenizer's chat template and its
generation prompt, as TRL renders a conversational prompt). Every other key of the line
(for example `answer`) is kept and handed to the reward functions. A split's prompts are
`{split}.prompts.jsonl` in the folder, a line each: `ids` (the prompt as the model reads
it), `prompt` (as given: text or messages) and `fields`; meta.json's `prompts` holds the
counts, the longest prompt's ids, and the ids that end a completion (the tokenizer's end
of text; for conversations its end-of-turn token too).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from jaxpar.config.sections import Data, Source
from jaxpar.data import chat
from jaxpar.data import tokens as data
from jaxpar.errors import ConfigError

META = "prompts"  # meta.json's key
FILE = "{split}.prompts.jsonl"


def kind_of(row, where: str) -> str:
    """'text' or 'messages', or ConfigError naming file:line."""
    if not isinstance(row, dict):
        raise ConfigError(
            f"prepare-data: {where}: a JSON object per line, not {type(row).__name__}"
        )
    value = row.get("messages", row.get("prompt"))
    if isinstance(value, str) and "messages" not in row:
        if not value:
            raise ConfigError(f"prepare-data: {where}: an empty `prompt`; give it some text")
        return "text"
    if isinstance(value, list):
        chat.check_row({"messages": value}, where)
        return "messages"
    raise ConfigError(
        f"prepare-data --format prompts: {where}: no string `prompt`, nor a list of "
        f"`messages` (or `prompt` as messages) (keys: {sorted(row)})"
    )


def rows(inputs: list[Path], tokenizer: Path):
    """(each line's prompt record or None for a blank line, its bytes), every line checked."""
    tok, template = chat.tokenizer(tokenizer), chat.Template(tokenizer)
    for path in inputs:
        for row, where, size in chat.lines(path, "prepare-data"):
            if row is None:
                yield None, size
                continue
            kind = kind_of(row, where)
            asked = row.get("messages", row.get("prompt"))
            if kind == "messages":
                if template.compiled is None:
                    raise ConfigError(
                        f"prepare-data --format prompts: {where}: a conversation, but the "
                        "tokenizer has no chat template (tokenizer_config.json's "
                        "`chat_template`); give a tokenizer that has one, or a text `prompt`"
                    )
                text = template.render(asked, generation_prompt=True)
            else:
                text = asked
            fields = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
            ids = tok.encode(text, add_special_tokens=False).ids
            yield {"ids": ids, "prompt": asked, "fields": fields}, size


def write(inputs: list[Path], tokenizer: Path, out: Path, every: int, bar) -> dict:
    """Every prompt into out/{split}.prompts.jsonl; meta.json's `prompts` record."""
    counts, longest, chats = {"train": 0, "val": 0}, 0, 0
    with contextlib.ExitStack() as opened:  # each closed, though one fails to flush
        files = {s: opened.enter_context((out / FILE.format(split=s)).open("w")) for s in counts}
        for one, size in rows(inputs, tokenizer):
            bar.update(size)
            if one is None:
                continue
            split = data.split_of(sum(counts.values()), every)
            files[split].write(json.dumps(one) + "\n")
            counts[split] += 1
            longest = max(longest, len(one["ids"]))
            chats += not isinstance(one["prompt"], str)
    stop = sorted(chat.stop_ids(chat.tokenizer(tokenizer), bool(chats)))
    return {"documents": sum(counts.values()), META: _record(counts, longest, stop)}


def _record(counts: dict, longest: int, stop: list[int]) -> dict:
    return {
        "prompts": counts,
        "longest_prompt": longest,
        "stop_ids": stop,
        "holds": "one JSON object per prompt in {split}.prompts.jsonl: its ids, the prompt as "
        "given, and the line's other fields",
    }


def of_ids(out: Path, ids: list[list[int]], vocab: int) -> None:
    """A prompt folder of prompts given as ids alone, all to train on (no tokenizer: the
    bench's)."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / FILE.format(split="train")).open("w") as f:
        for one in ids:
            f.write(json.dumps({"ids": one, "prompt": " ".join(map(str, one)), "fields": {}}))
            f.write("\n")
    (out / FILE.format(split="val")).write_text("")
    record = _record({"train": len(ids), "val": 0}, max(map(len, ids)), [])
    meta = {"vocab_size": vocab, "dtype": "uint16", "format": "prompts", META: record}
    (out / data.META).write_text(json.dumps(meta, indent=2))


@dataclass(frozen=True)
class Prompts:
    """One split's prompts, read whole (a prompt set is small beside its completions)."""

    ids: list[list[int]]
    asked: list  # each as given: text or messages
    fields: list[dict]
    stop: set[int]

    def __len__(self) -> int:
        return len(self.ids)


def meta_of(data_: Data) -> dict | None:
    """A prompt folder's meta.json `prompts` record, or None for other data."""
    folder = Path(data_.path)
    if data_.source is not Source.TOKENS or not folder.is_dir():
        return None
    return data.meta_of(folder).get(META)


def load(data_: Data, vocab: int, split: str = "train") -> Prompts:
    """The prompts of `split`; ConfigError where data.path holds none."""
    meta = meta_of(data_)
    if meta is None:
        missing = data_.path and not Path(data_.path).is_dir()
        raise ConfigError(
            f"train.objective=grpo: data.path={data_.path or '(none)'} (data.source="
            f"{data_.source}) "
            + ("is no folder: no such path" if missing else "holds no prompts")
            + "; prepare them with `jaxpar prepare-data "
            "FILE.jsonl --format prompts --tokenizer DIR --out DIR`, and give "
            "data.source=tokens data.path=THAT_FOLDER"
        )
    path = Path(data_.path) / FILE.format(split=split)

    def refused(where: str, e: Exception) -> ConfigError:
        return ConfigError(
            f"data.path={data_.path}: {where} is not what prepare-data --format prompts "
            f"writes ({type(e).__name__}); prepare the prompts again"
        )

    def row(number: int, text: str) -> tuple:
        try:
            line = json.loads(text)
            return [int(i) for i in line["ids"]], line["prompt"], line["fields"]
        except (ValueError, KeyError, TypeError) as e:
            raise refused(f"{path.name}:{number}", e) from None

    try:
        texts = path.read_text().splitlines()
    except (OSError, ValueError) as e:
        raise refused(path.name, e) from None
    rows = [row(number, text) for number, text in enumerate(texts, 1) if text.strip()]
    ids, asked, fields = ([r[k] for r in rows] for k in range(3))
    if not ids:
        raise ConfigError(
            f"data.path={data_.path}: its {split} split holds no prompt; prepare more prompts"
            + (", or a larger --val-fraction, or train.eval_every=0" if split == "val" else "")
        )
    top = max(max(p, default=0) for p in ids)
    if top >= vocab:
        raise ConfigError(
            f"data.path={data_.path}: a prompt holds id {top}, but model.vocab={vocab}; "
            "prepare the prompts with the model's tokenizer"
        )
    return Prompts(ids, asked, fields, set(meta.get("stop_ids", [])))
