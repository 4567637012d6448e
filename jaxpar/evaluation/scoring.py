"""Log-likelihoods of continuations on the sharded model, in length buckets.

Each request is its ids (context + continuation, left-truncated to the model's length
plus one, as lm-eval's Hugging Face backend cuts them): the ids but the last go in, the
ids but the first are the targets. Requests are sorted by length, longest first, and
each is put in the bucket of its length (a power of two, at least 16, at most the
model's length); a bucket's requests run `rows` at a time, left-padded to its length,
through the model's prefill (model.decode over an empty cache, as `jaxpar generate`
reads a prompt: every layout it decodes in, experts dropless as transformers routes
them). One program is compiled a bucket, however many requests it holds; it returns each
target's log-probability and whether it is the argmax, so only [rows, bucket] numbers
leave the devices.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

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
    """Scores (context ids, continuation ids) pairs with one decoding-layout model."""

    def __init__(self, m: decoding.Loaded, batch_size: int, max_length: int):
        self.m, self.max_length = m, max_length
        data = m.mesh.shape[DATA]
        self.rows_per_batch = math.ceil(batch_size / data) * data
        self.rows = NamedSharding(m.mesh, PartitionSpec(DATA))
        decoder = decoding.Decoder(m)

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
            return picked_BxS, jnp.argmax(logits_BxSxV, axis=-1) == targets_BxS

        self._score = jax.jit(score, out_shardings=(self.rows, self.rows))
        self.compiled: dict[int, Callable] = {}  # bucket -> its program
        self.tokens = 0  # input ids scored (padding not counted)
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
        `on_done(n)` after each batch of n requests."""
        ids = [self.inputs(c, x) for c, x in requests]
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out: list[Scored | None] = [None] * len(ids)
        by_bucket: dict[int, list[int]] = {}
        for i in order:
            by_bucket.setdefault(bucket_of(len(ids[i]) - 1, self.max_length), []).append(i)
        for bucket, members in by_bucket.items():
            for start in range(0, len(members), self.rows_per_batch):
                batch = members[start : start + self.rows_per_batch]
                answers = self._batch(bucket, batch, ids, requests)
                for i, (logprob, greedy) in zip(batch, answers, strict=True):
                    out[i] = Scored(logprob, greedy)
                if on_done:
                    on_done(len(batch))
        return out

    def _batch(self, bucket: int, batch: list[int], ids, requests):
        rows = self.rows_per_batch
        tokens = np.zeros((rows, bucket), np.int32)
        targets = np.zeros((rows, bucket), np.int32)
        pad = np.full(rows, bucket - 1, np.int32)  # padding rows: one id, never read
        for r, i in enumerate(batch):
            n = len(ids[i]) - 1
            tokens[r, bucket - n :], targets[r, bucket - n :] = ids[i][:-1], ids[i][1:]
            pad[r] = bucket - n
        positions = np.maximum(np.arange(bucket)[None] - pad[:, None], 0).astype(np.int32)
        program = self.program(bucket)
        start = time.perf_counter()
        put = lambda x: jax.device_put(x, self.rows)  # noqa: E731
        picked, greedy = program(self.m.params, put(tokens), put(positions), put(pad), put(targets))
        picked, greedy = np.asarray(picked), np.asarray(greedy)
        self.seconds += time.perf_counter() - start
        self.tokens += int(sum(bucket - pad[: len(batch)]))
        answers = []
        for r, i in enumerate(batch):
            k = len(requests[i][1])  # the continuation: the last k targets
            answers.append(
                (float(picked[r, bucket - k :].sum()), bool(greedy[r, bucket - k :].all()))
            )
        return answers
