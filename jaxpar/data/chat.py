"""Conversations as token ids and a loss mask, for `jaxpar prepare-data --format chat`.

A JSONL line is either `{"messages": [{"role": ..., "content": ...}, ...]}`, rendered by
the tokenizer's own chat template (its `tokenizer_config.json`), or `{"prompt": ...,
"completion": ...}`, the two encoded one after the other with the end-of-text id after
the completion. The mask marks what is trained on: each assistant turn's tokens, with
the end-of-turn text the template writes after it (e.g. `<|im_end|>`, `<|eot_id|>`), or
the completion and its end-of-text id; never the system and user turns, nor the
template's text between turns.

The template is rendered with jinja2 directly, as transformers' `apply_chat_template`
renders it (a sandboxed environment, trim_blocks and lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, the tokenizer's special tokens as variables):
transformers is not needed to prepare data, and it would not say where each turn lies
in the text unless the template marks them. Assistant turn i lies between the rendering
of the turns before it with the generation prompt and the rendering of the turns up to
it: a template must render a conversation's first turns as a prefix of the whole, which
the common ones (ChatML, Llama 3, Mistral, Gemma) do; one that does not is refused.
Tokens are marked by their character offsets in the rendered text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from jaxpar.config.options import shown
from jaxpar.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
TRAINED = "assistant"
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")  # chat templates


def stop_ids(tok, conversations: bool) -> set[int]:
    """The ids that end a completion: the tokenizer's end of text, and for conversations
    its chat template's end of turn."""
    ends = END_OF_TEXT + (END_OF_TURN if conversations else ())
    return {tok.token_to_id(t) for t in ends if tok.token_to_id(t) is not None}


def end_of_text(tok, template: Template) -> str | None:
    """The token that ends a document, one rule for pretraining text, preference answers
    and eval requests: tokenizer_config.json's eos_token where the vocabulary holds it
    (the token transformers' tokenizer calls its eos), else the first of END_OF_TEXT it
    holds; None: neither."""
    named = template.tokens.get("eos_token")
    if isinstance(named, str) and tok.token_to_id(named) is not None:
        return named
    return next((t for t in END_OF_TEXT if tok.token_to_id(t) is not None), None)


@dataclass(frozen=True)
class Example:
    ids: list[int]
    mask: np.ndarray  # uint8, 1 per trained id


class Template:
    """A tokenizer's chat template, compiled once."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.source, self.tokens = _read(folder)
        self.compiled = None if self.source is None else _compile(self.source)

    def render(
        self, messages: list[dict], generation_prompt: bool = False, continued: bool = False
    ) -> str:
        """The conversation as the template writes it; ConfigError where the template
        raises (its own raise_exception, or an error in it), naming the conversation.
        `continued`: the text ends inside the last message, for the model to go on with
        it (transformers' continue_final_message: what the template writes after the
        message's content, its end of turn, cut)."""
        from jinja2 import TemplateError

        if continued:
            last = {**messages[-1], "content": str(messages[-1].get("content")) + _MARK}
            messages = [*messages[:-1], last]
        try:
            text = self.compiled.render(
                messages=messages, add_generation_prompt=generation_prompt, **self.tokens
            )
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            first = messages[0].get("content", "") if messages else ""
            raise ConfigError(
                f"--tokenizer {self.folder}: its chat template raised on the conversation "
                f"beginning {str(first)[:40]!r} ({type(e).__name__}: {e}); fix the "
                "template (tokenizer_config.json's `chat_template`), or the conversation"
            ) from None
        if not continued:
            return text
        at = text.rfind(_MARK.strip())
        if at < 0:
            raise ConfigError(
                f"--tokenizer {self.folder}: its chat template drops part of the last "
                "message, so the text cannot end inside it"
            )
        # a template that trims the message's trailing spaces trimmed the mark's too
        return text[:at] if text[at : at + len(_MARK)] == _MARK else text[:at].rstrip()


_MARK = "JAXPAR_CONTINUES_HERE "  # where a continued last message ends, in its render


def tokenizer(folder: Path):
    """The `tokenizers.Tokenizer` in `folder`/tokenizer.json, or ConfigError naming what
    is wrong with the file."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"--tokenizer {folder}: no tokenizer.json there; give the folder of a Hugging "
            "Face tokenizer (tokenizer.save() or save_pretrained writes it)"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust parser's errors, as one line
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"--tokenizer {folder}: tokenizer.json is not a tokenizer `tokenizers` reads "
            f"({reason[:200]}); give the folder save_pretrained wrote"
        ) from None


def settings(folder: Path) -> dict:
    """`folder`/tokenizer_config.json's settings ({} where there is none)."""
    path = folder / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"--tokenizer {folder}: tokenizer_config.json unreadable ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"--tokenizer {folder}: tokenizer_config.json holds a JSON "
            f"{type(config).__name__}, not an object of settings; give the file "
            "save_pretrained wrote"
        )
    return config


def _read(folder: Path) -> tuple[str | None, dict]:
    config = settings(folder)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if template is not None and not isinstance(template, str):
        raise ConfigError(
            f"--tokenizer {folder}: tokenizer_config.json's chat_template is a JSON "
            f"{type(template).__name__}, not a Jinja template (a string, or a list of "
            "{name, template} with one named default)"
        )
    tokens = {}
    for name in SPECIAL:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if value is not None and not isinstance(value, str):
            raise ConfigError(
                f"--tokenizer {folder}: tokenizer_config.json's {name} is "
                f"{shown(value)}, not a token's text"
            )
        tokens[name] = value
    return template, tokens


def _compile(source: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ConfigError(f"--tokenizer: its chat template does not compile ({e})") from None


def check_file(path: Path, template: Template) -> None:
    """Every line of `path` a conversation this template can render, or ConfigError
    naming the line: checked before anything is written."""
    for row, where, _ in lines(path, "prepare-data"):
        if row is not None and check_row(row, where) == "messages" and template.compiled is None:
            raise ConfigError(
                f"prepare-data: {where}: a conversation of `messages`, but the tokenizer "
                "has no chat template (tokenizer_config.json's `chat_template`); give a "
                'tokenizer that has one, or write the lines as {"prompt": ..., '
                '"completion": ...}'
            )


def input_file(path: Path, who: str) -> None:
    """`path` is a file: else ConfigError, prefixed `who`, saying what is there instead."""
    if path.is_dir():
        raise ConfigError(f"{who}: {path}: a folder, not a file; give the file in it")
    if not path.is_file():
        raise ConfigError(f"{who}: {path}: no such file")


def text_lines(path: Path, who: str, what: str) -> Iterator[tuple[str, str, int]]:
    """(the line, where it is as file:line, its bytes) for each line of a UTF-8 text
    file; ConfigError, prefixed `who` (the command or the flag that named the file), at
    the first byte that is not UTF-8 (`what`: what the file should be, for the fix)."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}:{number}"
            try:
                yield raw.decode("utf-8"), where, len(raw)
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"{who}: {where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                    f"{e.start + 1}); {what}"
                ) from None


def lines(path: Path, who: str) -> Iterator[tuple[object, str, int]]:
    """(the JSON of a line or None for a blank one, where it is as file:line, its bytes)
    for each line of a JSONL file; ConfigError, prefixed `who`, for a line that is not
    UTF-8 text or not JSON."""
    for line, where, size in text_lines(path, who, "a JSONL file is one JSON object per line"):
        if not line.strip():
            yield None, where, size
            continue
        try:
            yield json.loads(line), where, size
        except ValueError as e:
            raise ConfigError(f"{who}: {where}: not JSON ({e})") from None


def check_row(row, where: str, who: str = "prepare-data") -> str:
    """The row's kind ('messages' or 'prompt'), or ConfigError naming file:line (prefixed
    `who`)."""
    if not isinstance(row, dict):
        raise ConfigError(f"{who}: {where}: a JSON object per line, not {type(row).__name__}")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"{who}: {where}: `messages` must be a non-empty list")
        for n, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise ConfigError(
                    f"{who}: {where}: message {n} needs a string `content` and a `role`"
                )
            if m.get("role") not in ROLES:
                raise ConfigError(
                    f"{who}: {where}: message {n} has role {m.get('role')!r}; "
                    f"roles are {', '.join(ROLES)}"
                )
        return "messages"
    if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        return "prompt"
    raise ConfigError(
        f"{who}: {where}: no `messages` list, nor string `prompt` and `completion` "
        f"fields (keys: {sorted(row)})"
    )


def example(tok, template: Template, row: dict, kind: str, eos: int | None, where: str):
    """The row's ids and mask (a row check_file passed); None for a conversation with no
    assistant turn."""
    if kind == "prompt":
        prompt = tok.encode(row["prompt"], add_special_tokens=False).ids
        completion = tok.encode(row["completion"], add_special_tokens=False).ids
        completion += [] if eos is None else [eos]
        mask = np.r_[np.zeros(len(prompt), np.uint8), np.ones(len(completion), np.uint8)]
        return Example(prompt + completion, mask)
    messages = row["messages"]
    turns = [i for i, m in enumerate(messages) if m["role"] == TRAINED]
    if not turns:
        return None
    text = template.render(messages)
    spans = [_span(template, messages, i, text, where) for i in turns]
    encoding = tok.encode(text, add_special_tokens=False)
    offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
    mask = np.zeros(len(encoding.ids), np.uint8)
    for start, end in spans:
        mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return Example(list(encoding.ids), mask)


def _span(template: Template, messages: list[dict], i: int, text: str, where: str):
    """[start, end) of assistant turn i in the rendered conversation `text`: its content
    and the template's end of turn, without the whitespace after them."""
    before = template.render(messages[:i], generation_prompt=True)
    through = template.render(messages[: i + 1])
    if not (through.startswith(before) and text.startswith(through)):
        raise ConfigError(
            f"prepare-data: {where}: the chat template does not render the first turns of a "
            f"conversation as the start of the whole (at assistant turn {i}), so its answers "
            "cannot be located; use a template that does (ChatML, Llama 3, Mistral do)"
        )
    return len(before), len(through.rstrip())
