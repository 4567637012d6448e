"""The text side of `jaxpar generate`: prompts in (text, JSONL, through the tokenizer's
chat template), completions out (streamed for one prompt, JSONL for a file), and the
speeds; and `jaxpar.generate`, the same from Python. The decoding is
jaxpar.generation.decoding's."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from jaxpar.data import chat
from jaxpar.errors import ConfigError
from jaxpar.generation import decoding

GREEDY = decoding.Sampling()


class Bytes:
    """A byte-level run's tokenizer (data.source=corpus or file: each byte is its id),
    with the part of `tokenizers.Tokenizer`'s API that generate uses. An id past the
    bytes (model.vocab may be larger; none is trained) reads as U+FFFD."""

    def get_vocab_size(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = False):
        return SimpleNamespace(ids=list(text.encode()))

    def decode(self, ids) -> str:
        raw = b"".join(bytes([i]) if i < 256 else "\ufffd".encode() for i in ids)
        return raw.decode(errors="replace")

    def token_to_id(self, token: str) -> None:
        return None  # no end-of-text: a completion runs to --max-new-tokens


@dataclass(frozen=True)
class Request:
    """What to ask, checked before jax starts."""

    texts: list[str]  # the prompts as the model reads them (chat template applied)
    rows: list[dict]  # each prompt as given (a JSONL line, or {"prompt": text})
    tokenizer: object  # a tokenizers.Tokenizer
    stop: set[int]  # ids that end a completion
    jsonl: bool  # write JSONL (--prompts), else text


def rows_of(args) -> list[dict]:
    """The command's --prompt / --prompts as rows, read and checked."""
    return [{"prompt": p} for p in args.prompt] if args.prompt else _lines(args.prompts)


def read(args, tokenizer: Path | None) -> Request:
    """The command's --prompt / --prompts and --chat through `tokenizer` (None: bytes),
    read and checked."""

    def where(n: int) -> str:
        return f"--prompts {args.prompts}:{n}" if args.prompts else f"--prompt {n}"

    return request(tokenizer, rows_of(args), args.chat, bool(args.prompts), where)


def request(tokenizer: Path | None, rows: list[dict], chat_: bool, jsonl: bool, where) -> Request:
    """Rows ({"prompt": text} or {"messages": [...]}) as the model reads them, with the
    tokenizer of folder `tokenizer` (and its chat template, with `chat_`); None: bytes."""
    if tokenizer is None and chat_:
        raise ConfigError(
            "--chat: a byte-level run has no chat template; drop --chat to continue the "
            "text as it is"
        )
    tok = Bytes() if tokenizer is None else chat.tokenizer(tokenizer)
    template = None if tokenizer is None else chat.Template(tokenizer)
    if chat_ and template.compiled is None:
        raise ConfigError(
            f"--chat: {tokenizer} has no chat template (tokenizer_config.json's "
            "`chat_template`); drop --chat to continue the text as it is"
        )
    texts = []
    for n, row in enumerate(rows, 1):
        if chat_:
            messages = row.get("messages") or [{"role": "user", "content": row.get("prompt")}]
            chat.check_row({"messages": messages}, where(n), "generate")
            texts.append(template.render(messages, generation_prompt=True))
        elif isinstance(row.get("prompt"), str):
            texts.append(row["prompt"])
        else:
            raise ConfigError(
                f"generate: {where(n)}: no string `prompt` (or `messages` with --chat)"
            )
    return Request(texts, rows, tok, chat.stop_ids(tok, chat_), jsonl)


def ids_for(request: Request, model, tokenizer: Path | None) -> list[list[int]]:
    """The prompts' ids, the tokenizer checked against the model's vocab."""
    vocab = request.tokenizer.get_vocab_size()
    if vocab > model.cfg.model.vocab:
        given = "bytes" if tokenizer is None else f"--tokenizer {tokenizer}"
        raise ConfigError(
            f"{given}: {vocab} ids, but the model has model.vocab="
            f"{model.cfg.model.vocab}; give the tokenizer it was trained with"
        )
    return [request.tokenizer.encode(t, add_special_tokens=False).ids for t in request.texts]


def generate(
    source: str,
    prompts: list,
    tokenizer,
    *,
    max_new_tokens: int = 64,
    sampling: decoding.Sampling = GREEDY,
    chat: bool = False,
    overrides: list[str] = (),
    step: int | None = None,
    devices=None,
) -> list[str]:
    """`jaxpar generate` from Python: the completions (texts) of `prompts` (texts, or
    with `chat` lists of messages too) by the model of `source` (a run directory or
    hf:DIR), through the tokenizer in folder `tokenizer`."""
    rows = [{"messages": p} if isinstance(p, list) else {"prompt": p} for p in prompts]
    req = request(Path(tokenizer), rows, chat, False, lambda n: f"prompt {n}")
    model = decoding.load(source, list(overrides), step, devices)
    ids = ids_for(req, model, Path(tokenizer))
    done = decoding.generate(decoding.Decoder(model), ids, max_new_tokens, sampling, req.stop)
    return [req.tokenizer.decode(c) for c in done.completions]


def answer(args, request: Request | None, sampling: decoding.Sampling, tokenizer_of) -> None:
    """The rest of `jaxpar generate` (`args`, checked), once jax has its devices: the
    model loaded and placed, the prompts' ids (`request`, or None: read now through the
    tokenizer `tokenizer_of(source, --tokenizer, model, command)` finds), the answers
    decoded (streamed where one prompt is given), written, and the summary line."""
    model = decoding.load(args.source, args.overrides, args.step)
    tokenizer = tokenizer_of(args.source, args.tokenizer, model, "generate")
    if request is None:
        request = read(args, tokenizer)
    sampling.check_vocab(model.cfg.model.vocab)
    ids = ids_for(request, model, tokenizer)
    decoding.check_lengths(model, ids, args.max_new_tokens)  # before anything is printed
    stream = Stream(request.tokenizer) if len(ids) == 1 and not request.jsonl else None
    if stream:  # the prompt as given (not the chat template around it), then the answer
        print(request.rows[0]["prompt"] + ("\n" if args.chat else ""), end="", flush=True)
    if args.speculate:
        from jaxpar.generation import speculative

        speculative.check(model, sampling)
        drafter = speculative.Speculator(decoding.Decoder(model), args.draft_tokens)
        done = speculative.generate(drafter, ids, args.max_new_tokens, request.stop, stream)
    else:
        done = decoding.generate(
            decoding.Decoder(model), ids, args.max_new_tokens, sampling, request.stop, stream
        )
    write(request, done.completions, streamed=stream is not None, chat=args.chat)
    bytes_ = decoding.cache_bytes_per_token(model, done.cache_slots)
    print(summary(done, dict(model.mesh.shape), bytes_, model.cache_dims), file=sys.stderr)


def _lines(path: Path) -> list[dict]:
    chat.input_file(path, "--prompts")
    rows = []
    for row, where, _ in chat.lines(path, "--prompts"):
        if row is not None and not isinstance(row, dict):
            raise ConfigError(f"--prompts {where}: a JSON object per line")
        rows += [] if row is None else [row]
    if not rows:
        raise ConfigError(f"--prompts {path}: no prompts in it")
    return rows


class Stream:
    """One prompt's completion printed as it is generated: the text of the ids so far,
    less what is already printed (a byte-level token may end mid-character)."""

    def __init__(self, tok):
        self.tok, self.ids, self.shown = tok, [], ""

    def __call__(self, row: int, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.shown) :])
            sys.stdout.flush()
            self.shown = text


def write(request: Request, completions: list[list[int]], streamed: bool, chat: bool) -> None:
    """The completions: JSONL rows for --prompts, else text: a prompt and its
    continuation, or with a chat template the question and the answer on its own line
    (after a stream, a newline)."""
    for row, ids in zip(request.rows, completions, strict=True):
        text = request.tokenizer.decode(ids)
        if request.jsonl:
            print(json.dumps({**row, "completion": text, "new_tokens": len(ids)}), flush=True)
        elif not streamed:
            print(f"{row['prompt']}{chr(10) if chat else ''}{text}", flush=True)
    if streamed:
        print(flush=True)


def summary(g, layout: dict, cache_bytes: int, dims) -> str:
    """Speeds and the layout, one line for stderr (`dims`: the CacheDims)."""
    per = lambda n, s: f"{n} tokens in {s:.2f} s ({n / max(s, 1e-9):,.0f} tokens/s)"  # noqa: E731
    drafts = (
        f"; drafts accepted {g.accepted}/{g.drafted} ({g.accepted / g.drafted:.0%})"
        if g.drafted
        else ""
    )
    return (
        f"prefill {per(g.prefill_tokens, g.prefill_s)}; decode {per(g.decode_tokens, g.decode_s)}; "
        f"compiled in {g.compile_s:.1f} s; data={layout['data']} x tensor={layout['tensor']}, "
        f"{g.rows} rows x {g.cache_slots} cache slots; cache {cache_bytes:,} bytes a token "
        f"({dims.formula()} x 4 bytes){drafts}"
    )
