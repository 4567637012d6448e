"""Log-likelihoods of continuations on the sharded model, in length buckets.

Each request is its ids (context + continuation, left-truncated to the model's length
plus one, as lm-eval's Hugging Face backend cuts them): the ids but the last go in, the
ids but the first are the targets. Requests are sorted by length, longest first, and
each is put in the bucket of its length (a power of two, at least 16, at most the
model's length); a bucket's requests run `rows` at a time, left-padded to its length,
through the model's prefill (model.decode over an empty cache, as `jaxpar generate`
reads a prompt: every layout it decodes in, experts dropless as transformers routes
them). One program is compiled a bucket, however many requests it holds; it returns each
target's log-probability and whether it is the argmax, and the last position's
log-probabilities whole, so only [rows, bucket + vocab] numbers leave the devices.
Requests whose ids differ in their last id alone (a multiple-choice question's one-id
choices) share one row, as lm-eval's hf backend shares their logits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.generation import decoding
from jaxpar.parallel.axes import DATA


@dataclass(frozen=True)
class Scored:
    """One request's answer, as lm-eval's loglikelihood takes it."""

    logprob: float  # the continuation's log-probability (a sum over its ids)
    greedy: bool  # whether every continuation id is the model's argmax there


def bucket_of(length: int, most: int) -> int:
    """The padded length of a request of `length` input ids: the next power of two (at
    least 16), at most `most`."""
    return min(decoding.bucket(length), most)


class Scorer:
    """Scores (context ids, continuation ids) pairs with a decoder's model (its cache
    layout too)."""

    def __init__(self, decoder: decoding.Decoder, batch_size: int, max_length: int):
        m = self.m = decoder.m
        self.max_length = max_length
        data = m.mesh.shape[DATA]
        self.rows_per_batch = math.ceil(batch_size / data) * data
        self.rows = decoder.rows

        def score(params, tokens_BxS, positions_BxS, pad_B, targets_BxS):
            shapes = decoder.cache_shapes(*tokens_BxS.shape)
            cache = jax.tree.map(
                lambda s: jax.lax.with_sharding_constraint(jnp.zeros(s.shape, s.dtype), s.sharding),
                shapes,
            )
            model = m.problem.module(decoding.restacked(params))
            logits_BxSxV, _ = model.decode(tokens_BxS, positions_BxS, cache, 0, pad_B)
            logits_BxSxV = logits_BxSxV.astype(jnp.float32)
            logp_BxSxV = jax.nn.log_softmax(logits_BxSxV, axis=-1)
            picked_BxS = jnp.take_along_axis(logp_BxSxV, targets_BxS[..., None], -1)[..., 0]
            greedy_BxS = jnp.argmax(logits_BxSxV, axis=-1) == targets_BxS
            # the last position whole: requests that differ in their last id alone share it
            return picked_BxS, greedy_BxS, logp_BxSxV[:, -1], jnp.argmax(logits_BxSxV[:, -1], -1)

        self._score = jax.jit(score, out_shardings=(self.rows,) * 4)
        self.compiled: dict[int, Callable] = {}  # bucket -> its program
        self.tokens = 0  # input ids scored (padding not counted)
        self.rows_scored = 0  # rows run (requests that share their ids share one)
        self.seconds = 0.0  # in the programs, compiles not counted
        self.compile_s = 0.0

    def program(self, bucket: int) -> Callable:
        """The scoring program of a bucket: compiled on first use, then kept."""
        if bucket not in self.compiled:
            start = time.perf_counter()
            ids = jax.ShapeDtypeStruct((self.rows_per_batch, bucket), jnp.int32, sharding=self.rows)
            pad = jax.ShapeDtypeStruct((self.rows_per_batch,), jnp.int32, sharding=self.rows)
            lowered = self._score.lower(self.m.params, ids, ids, pad, ids)
            self.compiled[bucket] = lowered.compile()
            self.compile_s += time.perf_counter() - start
        return self.compiled[bucket]

    def inputs(self, context: Sequence[int], continuation: Sequence[int]) -> list[int]:
        """The ids of a request as they are read: the last max_length + 1."""
        return [*context, *continuation][-(self.max_length + 1) :]

    def __call__(
        self,
        requests: Sequence[tuple[Sequence[int], Sequence[int]]],
        on_done: Callable[[int], None] | None = None,
    ) -> list[Scored]:
        """Each (context ids, continuation ids) request's Scored, in the order given;
        `on_done(n)` after each batch of n requests. Requests whose ids differ in the
        last alone (the choices of a multiple-choice question, one id each) share a row,
        as lm-eval's hf backend shares their logits."""
        ids = [self.inputs(c, x) for c, x in requests]
        rows: dict[tuple, list[int]] = {}  # the input ids -> the requests they score
        for i in sorted(range(len(ids)), key=lambda i: -len(ids[i])):
            rows.setdefault(tuple(ids[i][:-1]), []).append(i)
        by_bucket: dict[int, list[tuple]] = {}
        for row in rows:
            by_bucket.setdefault(bucket_of(len(row), self.max_length), []).append(row)
        out: list[Scored | None] = [None] * len(ids)
        for bucket, inputs in by_bucket.items():
            for start in range(0, len(inputs), self.rows_per_batch):
                batch = inputs[start : start + self.rows_per_batch]
                for row, scored in zip(
                    batch, self._batch(bucket, batch, rows, ids, requests), strict=True
                ):
                    for i, one in zip(rows[row], scored, strict=True):
                        out[i] = one
                if on_done:
                    on_done(sum(len(rows[row]) for row in batch))
        return out

    def _batch(self, bucket: int, batch: list[tuple], rows: dict, ids, requests):
        """Each row's requests' Scored: a row's targets are its first request's, and each
        request's own last id is read from the row's last position."""
        size = self.rows_per_batch
        tokens = np.zeros((size, bucket), np.int32)
        targets = np.zeros((size, bucket), np.int32)
        pad = np.full(size, bucket - 1, np.int32)  # padding rows: one id, never read
        for r, row in enumerate(batch):
            n, first = len(row), ids[rows[row][0]]
            tokens[r, bucket - n :], targets[r, bucket - n :] = row, first[1:]
            pad[r] = bucket - n
        positions = np.maximum(np.arange(bucket)[None] - pad[:, None], 0).astype(np.int32)
        program = self.program(bucket)
        start = time.perf_counter()
        put = lambda x: jax.device_put(x, self.rows)  # noqa: E731
        placed = (put(tokens), put(positions), put(pad), put(targets))
        picked, greedy, last, top = map(np.asarray, program(self.m.params, *placed))
        self.seconds += time.perf_counter() - start
        self.tokens += int(sum(bucket - pad[: len(batch)]))
        self.rows_scored += len(batch)
        answers = []
        for r, row in enumerate(batch):
            scored = []
            for i in rows[row]:
                k, t = len(requests[i][1]), ids[i][-1]  # the last k targets; the last id
                before = slice(bucket - k, bucket - 1)
                logprob = float(picked[r, before].sum() + last[r, t])
                scored.append(Scored(logprob, bool(greedy[r, before].all() and top[r] == t)))
            answers.append(scored)
        return answers
