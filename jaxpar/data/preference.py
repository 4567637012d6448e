"""Preference pairs as token ids and loss masks, for `jaxpar prepare-data --format preference`.

A JSONL line holds one pair in one of TRL's two layouts: `{"prompt", "chosen",
"rejected"}` as text, or conversations, `{"chosen": [messages], "rejected": [messages]}`
(a `prompt` of messages optional: without one, the shared prompt is the turns both
conversations begin with, as TRL's `extract_prompt` finds it).

Each answer is tokenized as TRL's DPOTrainer does, so that the same pairs give the same
ids: text as `prompt`, then `prompt + answer + end-of-text` (the end-of-text text added
where the answer lacks it), each with the tokenizer's own special tokens; conversations
rendered by the chat template, the prompt with the generation prompt, the prompt with
the answer whole. The answer is what follows the longest prefix the prompt's ids share
with both sequences. A sequence (prompt + answer) longer than `max_length` ids loses its
end (TRL's `keep_start`); a prompt that leaves no room for an answer is refused (TRL
drops it silently).

A pair is written as two documents, chosen then rejected, each prompt + answer with a
loss mask over the answer: the pair is one row of a batch (jaxpar.data.tokens.pair_batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxpar.data import chat
from jaxpar.errors import ConfigError

FIELDS = ("chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    prompt: list[int]  # as trained: the ids both answers follow
    chosen: list[int]
    rejected: list[int]
    truncated: bool  # an answer lost its end to max_length

    def documents(self) -> list[chat.Example]:
        """The pair as two documents, prompt + answer each, the answer trained."""
        head = np.zeros(len(self.prompt), np.uint8)
        return [
            chat.Example(self.prompt + answer, np.r_[head, np.ones(len(answer), np.uint8)])
            for answer in (self.chosen, self.rejected)
        ]


def check_row(row, where: str) -> str:
    """The row's layout ('messages' or 'text'), or ConfigError naming file:line."""
    who = "prepare-data --format preference"
    if not isinstance(row, dict):
        raise ConfigError(f"{who}: {where}: a JSON object per line, not {type(row).__name__}")
    missing = [k for k in FIELDS if k not in row]
    if missing:
        raise ConfigError(
            f"{who}: {where}: no `{'` or `'.join(missing)}` (keys: {sorted(row)}); a pair is "
            '{"prompt": ..., "chosen": ..., "rejected": ...} as text, or {"chosen": [messages], '
            '"rejected": [messages]}'
        )
    kinds = {k: _kind(row[k]) for k in ("prompt", *FIELDS) if k in row}
    if len(set(kinds.values())) != 1 or None in kinds.values():
        said = ", ".join(f"{k} is {v or type(row[k]).__name__}" for k, v in kinds.items())
        raise ConfigError(
            f"{who}: {where}: {said}; give every field as text, or every one as a list of messages"
        )
    if "messages" in kinds.values():
        for k in kinds:
            chat.check_row({"messages": row[k]}, f"{where} ({k})", who)
    elif "prompt" not in row:
        raise ConfigError(
            f'{who}: {where}: text answers need their "prompt" (the shared prompt is found only '
            "in conversations, as the turns both begin with)"
        )
    return "messages" if "messages" in kinds.values() else "text"


def _kind(value) -> str | None:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value:
        return "messages"
    return None


def _split(row: dict) -> tuple:
    """(prompt, chosen, rejected) of a row, the prompt extracted where it is implicit."""
    if "prompt" in row:
        return row["prompt"], row["chosen"], row["rejected"]
    chosen, rejected = row["chosen"], row["rejected"]
    n = _common(chosen, rejected)
    return chosen[:n], chosen[n:], rejected[n:]


def _common(a: Sequence, b: Sequence) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def document(tok, template: chat.Template, prompt, answer, eos: str | None) -> list[int]:
    """The ids of a prompt and its answer, as TRL tokenizes an answer: text as `prompt +
    answer + end-of-text` (added where the answer lacks it) with the tokenizer's special
    tokens; conversations (lists of messages) rendered whole by the chat template."""
    if isinstance(prompt, str):
        ended = answer if answer.endswith(eos) else answer + eos
        return tok.encode(prompt + ended).ids
    return tok.encode(template.render(prompt + answer), add_special_tokens=False).ids


def pair(tok, template: chat.Template, row: dict, kind: str, eos: str | None, max_length: int,
         where: str) -> Pair:  # fmt: skip
    """The row's pair as TRL tokenizes it (the module's docstring); ConfigError for one
    whose answers are empty or whose prompt leaves no room for an answer."""
    who = "prepare-data --format preference"
    prompt, chosen, rejected = _split(row)
    if not chosen or not rejected:
        raise ConfigError(
            f"{who}: {where}: the chosen and rejected conversations do not differ after their "
            "shared turns, so there is no answer to prefer; give two different answers"
        )
    if kind == "text" and eos is None:
        raise ConfigError(
            f"{who}: --tokenizer has no end-of-text token (tokenizer_config.json's "
            "eos_token), which ends each answer as TRL's does; give a tokenizer that has one"
        )
    if kind == "text":
        head = tok.encode(prompt).ids
    else:
        asked = template.render(prompt, generation_prompt=True)
        head = tok.encode(asked, add_special_tokens=False).ids
    whole_c, whole_r = (document(tok, template, prompt, a, eos) for a in (chosen, rejected))
    n = min(_common(head, whole_c), _common(head, whole_r))
    if n >= max_length:
        raise ConfigError(
            f"{who}: {where}: the prompt is {n} tokens, leaving no room for an answer in "
            f"--max-length {max_length}; raise --max-length, or shorten or drop that line"
        )
    c, r = whole_c[n:max_length], whole_r[n:max_length]
    cut = len(whole_c) > max_length or len(whole_r) > max_length
    return Pair(head[:n], c, r, cut)
