"""jaxpar's model backend for EleutherAI's lm-evaluation-harness: `jaxpar eval`, and
`lm_eval --model jaxpar --model_args source=RUN` (registered as "jaxpar").

It answers lm-eval's three requests on the sharded model, as lm-eval's Hugging Face
backend (`hf`) answers them, so that the scores are the same:

- loglikelihood: a (context, continuation) pair, tokenized by lm-eval's own pair rule
  (TemplateLM: the context's trailing spaces moved to the continuation, the whole
  encoded and split after the context's ids; an empty context is the BOS id, or EOS);
  the ids cut from the left to the model's length + 1, and scored in length buckets
  (jaxpar.evaluation.scoring);
- loglikelihood_rolling: a text's log-likelihood over disjoint windows of the model's
  length (lm-eval's window rule, each window's first context the BOS/EOS id);
- generate_until: the context's ids cut from the left to the model's length less
  max_gen_toks, decoded through the KV cache (jaxpar.generation.decoding) greedily or
  as gen_kwargs sample, each row stopped at its first `until` string or the end of
  text; the text cut before the first stop string.

Text goes through jaxpar.evaluation.text (transformers' fast tokenizer's encoding with
`tokenizers` alone).
"""

from __future__ import annotations

import math
import sys

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from jaxpar.errors import ConfigError
from jaxpar.evaluation import BATCH_SIZE, MAX_GEN_TOKS
from jaxpar.evaluation.scoring import Scorer, bucket_of
from jaxpar.evaluation.text import Text
from jaxpar.generation import decoding


@register_model("jaxpar")
class JaxparLM(TemplateLM):
    """lm-eval's model on a jaxpar model: a run directory or hf:DIR (`source`), with
    its tokenizer folder (`tokenizer`; default: hf:DIR's own folder, or the one the
    run's data was prepared with), laid out as `jaxpar generate` lays it out (data x
    tensor; parallel.data / parallel.tensor override, as model_args)."""

    def __init__(
        self,
        source: str | None = None,
        tokenizer: str | None = None,
        batch_size: int | str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = MAX_GEN_TOKS,
        step: int | None = None,
        cpu_devices: int | None = None,
        loaded: decoding.Loaded | None = None,
        text: Text | None = None,
        progress: bool = True,
        **kwargs,
    ):
        super().__init__()
        overrides = [f"{k}={v}" for k, v in kwargs.items() if "." in k]
        unknown = sorted(
            k for k in kwargs if "." not in k and k not in ("device", "max_batch_size")
        )
        if unknown:
            raise ConfigError(
                f"--model_args {unknown[0]}: jaxpar takes source, tokenizer, max_length, "
                "max_gen_toks, step, cpu_devices and KEY=VALUE config overrides"
            )
        if loaded is None:
            from jaxpar.evaluation import sources

            if cpu_devices is not None:
                from jaxpar.parallel.mesh import use_cpu_devices

                use_cpu_devices(int(cpu_devices))
            loaded, text = sources.load(source, tokenizer, overrides, step)
        self.m, self.text = loaded, text
        self.text.check(loaded.cfg.model.vocab)
        self._max_length = int(max_length or loaded.positions)
        self._max_gen_toks = int(max_gen_toks)
        if not 1 < self._max_length <= loaded.positions or self._max_gen_toks < 1:
            raise ConfigError(
                f"--model_args max_length={self._max_length}, max_gen_toks={self._max_gen_toks}:"
                f" give a length of 2 to the model's {loaded.positions} positions, and 1 or "
                "more new tokens"
            )
        auto = batch_size is None or str(batch_size).startswith("auto")  # lm-eval's auto: ours
        size = BATCH_SIZE if auto else int(batch_size)
        self.decoder = decoding.Decoder(loaded)
        self.scorer = Scorer(self.decoder, size, self._max_length)
        self.rows = self.scorer.rows_per_batch
        self.progress = progress
        self.generated = 0  # new ids kept
        self.generate_s = 0.0
        self.generate_buckets: set = set()

    # -- what lm-eval asks of a model ----------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.text.eos

    @property
    def prefix_token_id(self) -> int:
        return self.text.eos if self.text.bos is None else self.text.bos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.text.folder).replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kw
    ):
        special = add_special_tokens
        if special is None:  # a text that starts with the BOS text has it already
            bos = None if self.text.bos is None else self.text.decode([self.text.bos], False)
            special = not (bos and string.startswith(bos))
        ids = self.text.encode(string, special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.text.decode(tokens, skip_special_tokens)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.text.template.source if chat_template else None

    def check_chat_template(self) -> None:
        if self.text.template.compiled is None:
            raise ConfigError(
                f"--apply-chat-template: {self.text.folder} has no chat template "
                "(tokenizer_config.json's `chat_template`); drop the flag"
            )

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        """The conversation through the tokenizer's chat template (--apply_chat_template)."""
        self.check_chat_template()
        # without a generation prompt lm-eval prefills the assistant's turn: it goes on
        return self.text.template.render(
            chat_history, add_generation_prompt, continued=not add_generation_prompt
        )

    def get_model_info(self) -> dict:
        """What lm-eval's results JSON records of the model."""
        shapes = self.m.problem.shapes.values()
        return {
            "model_source": self.m.source,
            "model_num_parameters": int(sum(math.prod(s.shape) for s in shapes)),
            "model_dtype": "float32",
            "layout": {k: v for k, v in self.m.mesh.shape.items() if k in ("data", "tensor")},
        }

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=True)  # jaxpar's bar, not two

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        pairs = [(context, continuation) for _, context, continuation in requests]
        for context, continuation in pairs:
            if not context or not continuation or len(continuation) > self.max_length:
                raise ConfigError(
                    f"eval: a request of {len(context)} context and {len(continuation)} "
                    f"continuation ids; lm-eval gives 1 or more of each, the continuation at "
                    f"most the model's {self.max_length}"
                )
        with self._bar(len(pairs), "loglikelihood") as bar:
            before = (self.scorer.tokens, self.scorer.seconds)

            def done(n: int) -> None:
                bar.update(n)
                tokens = self.scorer.tokens - before[0]
                seconds = self.scorer.seconds - before[1]
                bar.set_postfix_str(f"{tokens / max(seconds, 1e-9):,.0f} tok/s")

            scored = self.scorer(pairs, done)
        return [(s.logprob, s.greedy) for s in scored]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for n, (string,) in enumerate(r.args for r in requests):
            ids = self.tok_encode(string)
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(ids, self.prefix_token_id, self.max_length, 1),
            ):
                windows.append((None, context, continuation))
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(
            owners, self._loglikelihood_tokens(windows, disable_tqdm), strict=True
        ):
            totals[n] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for n, r in enumerate(requests):
            groups.setdefault(repr(sorted(r.args[1].items())), []).append(n)
        out: list[str | None] = [None] * len(requests)
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        with self._bar(len(requests), "generate_until") as bar:
            for members in groups.values():
                kwargs = normalize_gen_kwargs(requests[members[0]].args[1], self._max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                new = int(kwargs.pop("max_gen_toks"))
                sampling = _sampling(kwargs)
                keep = self.max_length - new
                if keep <= 0:
                    raise ConfigError(
                        f"eval: max_gen_toks={new} leaves no room for a context in the model's "
                        f"{self.max_length} positions; give fewer new tokens"
                    )
                contexts = {
                    n: self.tok_encode(requests[n].args[0], left_truncate_len=keep) for n in members
                }
                members.sort(key=lambda n: -len(contexts[n]))
                for start in range(0, len(members), self.rows):
                    batch = members[start : start + self.rows]
                    texts = self._generate([contexts[n] for n in batch], new, sampling, until)
                    for n, text in zip(batch, texts, strict=True):
                        out[n] = postprocess_generated_text(text, until, None)
                    bar.update(len(batch))
                    bar.set_postfix_str(
                        f"{self.generated / max(self.generate_s, 1e-9):,.0f} new tok/s"
                    )
        return out

    # -- jaxpar's side -----------------------------------------------------------------------

    def _generate(
        self, prompts: list[list[int]], new: int, sampling, until: list[str]
    ) -> list[str]:
        stops = [s for s in until if s]

        def finished(row: int, ids: list[int]) -> bool:
            text = self.text.decode(ids)
            return any(s in text for s in stops)

        done = decoding.generate(
            self.decoder,
            prompts,
            new,
            sampling,
            {self.eot_token_id},
            rows=self.rows,
            finished=finished,
        )
        self.generated += sum(len(c) for c in done.completions)
        self.generate_s += done.prefill_s + done.decode_s
        self.generate_buckets.add((done.rows, done.prompt_slots, done.cache_slots))
        return [self.text.decode(c) for c in done.completions]

    def _bar(self, total: int, what: str):
        """A bar over requests (lm-eval's own, per batch of windows or of tokenizing, off)."""
        return tqdm(
            total=total,
            desc=what,
            unit="req",
            disable=not self.progress,
            file=sys.stderr,
            dynamic_ncols=True,
        )

    def buckets(self, requests) -> set[int]:
        """The length buckets of (context ids, continuation ids) requests."""
        return {bucket_of(len(self.scorer.inputs(c, x)) - 1, self.max_length) for c, x in requests}

    def speeds(self) -> dict:
        """What scoring and generating took: tokens, seconds, tokens/s, compiles."""
        s = self.scorer
        return {
            "scored_tokens": s.tokens,
            "score_s": round(s.seconds, 3),
            "score_tokens_per_s": round(s.tokens / s.seconds, 1) if s.seconds else 0.0,
            "score_buckets": len(s.compiled),
            "score_compile_s": round(s.compile_s, 3),
            "generated_tokens": self.generated,
            "generate_s": round(self.generate_s, 3),
            "generate_tokens_per_s": round(self.generated / self.generate_s, 1)
            if self.generate_s
            else 0.0,
            "generate_buckets": len(self.generate_buckets),
        }


def _sampling(kwargs: dict) -> decoding.Sampling:
    """gen_kwargs' sampling as jaxpar's: greedy unless do_sample with a temperature."""
    if not kwargs.get("do_sample") or not kwargs.get("temperature"):
        return decoding.Sampling()
    return decoding.Sampling(
        float(kwargs["temperature"]),
        int(kwargs.get("top_k") or 0),
        float(kwargs.get("top_p") or 1.0),
        int(kwargs.get("seed") or 0),
    )
