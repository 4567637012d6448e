"""`jaxpar generate --speculate mtp`: greedy decoding with the model's first multi-token
prediction module (models/mtp.py) as the draft, and the model verifying its drafts in
one forward, so that the output is plain greedy decoding's, token for token.

Each iteration, at cache slot N with the newest token c not yet in the cache and K drafts
d_1..d_K: the model reads [c, d_1..d_K] at slots N..N+K (one forward) and gives its
greedy choice after each; the drafts are accepted up to the first that differs from the
model's choice, and the model's choice after the last accepted one is kept too: a + 1
new tokens, a the accepted drafts. Every row of a batch advances by the same count, the
fewest any row accepted (the cache's slot is the batch's), so that each row's tokens
are still its greedy ones. Then the module reads the same K + 1 slots, each the model's
normed hidden state there and the token after it (the new tokens, then anything: those
slots are read again before they count), and drafts the next token from slot N + a;
with K > 1 it drafts on from its own hidden state and draft, as vLLM reuses DeepSeek's
one module. The module's cache is a layer's, and a slot it wrote with a draft is written
again, with the tokens kept, before anything reads it.

Sliding windows are refused: a ring cache would lose the keys that a rejected draft's
slot overwrote. Sampling is refused: speculation here is greedy's.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.generation.decoding import (
    CPU_DECODE_OPTIONS,
    NEW_BUCKET,
    Completions,
    Decoder,
    Generated,
    Sampling,
    check_lengths,
    left_padded,
)

ITERATIONS = 8  # draft-and-verify iterations a dispatch (a device-side loop)


def check(m, sampling: Sampling) -> None:
    """Refuse a model or a sampling that speculation cannot decode exactly."""
    model = m.cfg.model
    if not getattr(model, "mtp_depth", 0):
        raise ConfigError(
            f"--speculate mtp: {m.source}'s model has no multi-token prediction module "
            "(model.mtp_depth=0) to draft with; train one with model.mtp_depth=1, or drop "
            "--speculate"
        )
    if model.sliding_window:
        raise ConfigError(
            f"--speculate mtp: model.sliding_window={model.sliding_window}: a windowed "
            "layer's cache is a ring, which a rejected draft would overwrite; drop "
            "--speculate for this model"
        )
    if sampling.temperature:
        raise ConfigError(
            f"--temperature {sampling.temperature:g} with --speculate mtp: speculation "
            "verifies the greedy choice; give --temperature 0, or drop --speculate"
        )


class Speculator:
    """The jitted prefill and draft-and-verify loop of one model, `drafts` drafts an
    iteration, compiled per (rows, P, M) and kept."""

    def __init__(self, decoder: Decoder, drafts: int = 1):
        self.decoder, self.m, self.k = decoder, decoder.m, drafts
        self.first = jax.jit(self._prefill, donate_argnums=(3, 4))
        self.loop = jax.jit(self._loop, donate_argnums=(3, 4))
        self.compiled: dict = {}

    def _prefill(self, params, tokens, positions, cache, mcache, pad):
        """The prompts into the model's cache and the module's: (the first new token,
        the first drafts, both caches)."""
        model = self.m.problem.module(params)
        x, cache = model.decode_states(tokens, positions, cache, 0, pad)
        h = model.norm(x)
        nxt = jnp.argmax(model.head_of(h[:, -1:]), -1)[:, 0].astype(jnp.int32)
        ahead = jnp.concatenate([tokens[:, 1:], nxt[:, None]], 1)
        out, logits, mcache = model.draft(h, ahead, positions, mcache, 0, pad)
        last = tokens.shape[1] - 1
        drafts, mcache = self._drafts(model, out[:, -1], logits[:, -1], last, pad, mcache)
        return nxt, drafts, cache, mcache

    def _drafts(self, model, out, logits, slot, pad, mcache):
        """K drafts: the first from the module's logits at `slot`, each next one from its
        own hidden state and draft at the next slot."""
        drafts = [jnp.argmax(logits, -1).astype(jnp.int32)]
        for j in range(1, self.k):
            at = slot + j
            positions = (at - pad)[:, None]
            out, logits, mcache = model.draft(
                out[:, None], drafts[-1][:, None], positions, mcache, at, pad
            )
            out, logits = out[:, 0], logits[:, 0]
            drafts.append(jnp.argmax(logits, -1).astype(jnp.int32))
        return jnp.stack(drafts, 1), mcache

    def _loop(self, params, nxt, drafts, cache, mcache, slot, pad, live):
        """ITERATIONS draft-and-verify iterations from `slot` (the newest token `nxt`
        not yet in the cache): each one's new tokens [B, K + 1] (the first a + 1 of a
        row kept) and its accepted count a."""
        model = self.m.problem.module(params)
        k = self.k
        columns = jnp.arange(k + 1)[None]

        def iteration(carry, _):
            nxt, drafts, cache, mcache, slot = carry
            tokens = jnp.concatenate([nxt[:, None], drafts], 1)
            positions = slot + columns - pad[:, None]
            x, cache = model.decode_states(tokens, positions, cache, slot, pad)
            h = model.norm(x)
            chosen = jnp.argmax(model.head_of(h), -1).astype(jnp.int32)  # [B, K + 1]
            agree = jnp.cumprod(drafts == chosen[:, :k], 1).sum(1)
            accepted = jnp.min(jnp.where(live, agree, k))
            # the tokens kept: the accepted drafts (each the model's choice), then its
            # choice after them; the module reads them as the tokens one ahead
            kept = chosen
            out, logits, mcache = model.draft(h, kept, positions, mcache, slot, pad)
            take = lambda x: jax.lax.dynamic_index_in_dim(x, accepted, 1, keepdims=False)  # noqa: E731
            after = slot + accepted
            drafts, mcache = self._drafts(model, take(out), take(logits), after, pad, mcache)
            return (take(chosen), drafts, cache, mcache, after + 1), (kept, accepted)

        start = (nxt, drafts, cache, mcache, slot)
        (nxt, drafts, cache, mcache, slot), (kept, accepted) = jax.lax.scan(
            iteration, start, None, length=ITERATIONS
        )
        return kept, accepted, nxt, drafts, cache, mcache

    def programs(self, rows: int, p_slots: int, slots: int):
        at = (rows, p_slots, slots)
        if at not in self.compiled:
            d = self.decoder
            ids = jax.ShapeDtypeStruct((rows, p_slots), jnp.int32, sharding=d.rows)
            per_row = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=d.rows)
            live = jax.ShapeDtypeStruct((rows,), bool, sharding=d.rows)
            row_drafts = jax.ShapeDtypeStruct((rows, self.k), jnp.int32, sharding=d.rows)
            cache, mcache = d.cache_shapes(rows, slots), d.cache_shapes(rows, slots)[0]
            options = CPU_DECODE_OPTIONS if self.m.mesh.devices.flat[0].platform == "cpu" else {}
            params = self.m.params
            self.compiled[at] = (
                self.first.lower(params, ids, ids, cache, mcache, per_row).compile(options),
                self.loop.lower(
                    params, per_row, row_drafts, cache, mcache, p_slots, per_row, live
                ).compile(options),  # fmt: skip
            )
        return self.compiled[at]


def generate(
    speculator: Speculator, prompts: list[list[int]], max_new: int, stop: set[int], on_token=None
) -> Generated:
    """decoding.generate's greedy continuations, drafted and verified (the module's
    docstring); Generated.drafted and .accepted count the batch's drafts."""
    d, m, k = speculator.decoder, speculator.m, speculator.k
    check_lengths(m, prompts, max_new)
    data = m.mesh.shape["data"]
    rows = math.ceil(len(prompts) / data) * data
    tokens, pad, positions = left_padded(prompts, rows)
    p_slots = tokens.shape[1]
    overshoot = ITERATIONS * (k + 1) + k + 1  # a dispatch's slots past the last kept token
    m_slots = p_slots + math.ceil((max_new + overshoot) / NEW_BUCKET) * NEW_BUCKET
    put = lambda x: jax.device_put(x, d.rows)  # noqa: E731
    start = time.perf_counter()
    cache, mcache = d.empty(rows, m_slots), d.empty(rows, m_slots)[0]
    prefill, loop = speculator.programs(rows, p_slots, m_slots)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    pad_d = put(pad)
    nxt, drafts, cache, mcache = prefill(
        m.params, put(tokens), put(positions), cache, mcache, pad_d
    )
    ids = np.asarray(nxt)[:, None]
    prefill_s = time.perf_counter() - start
    live = put(np.arange(rows) < len(prompts))
    got = Completions(len(prompts), max_new, stop, on_token)
    start, slot, iterations, accepted_total = time.perf_counter(), p_slots, 0, 0
    while not got.take(ids):
        kept, accepted, nxt, drafts, cache, mcache = loop(
            m.params, nxt, drafts, cache, mcache, slot, pad_d, live
        )
        kept, accepted = np.asarray(kept), np.asarray(accepted)
        ids = np.concatenate([kept[j][:, : a + 1] for j, a in enumerate(accepted)], 1)
        slot += int(accepted.sum()) + ITERATIONS
        iterations += ITERATIONS
        accepted_total += int(accepted.sum())
    decode_s = time.perf_counter() - start
    return Generated(
        completions=got.ids,
        prefill_tokens=sum(len(p) for p in prompts),
        prefill_s=prefill_s,
        decode_tokens=sum(max(len(c) - 1, 0) for c in got.ids),
        decode_s=decode_s,
        decode_steps=iterations,
        compile_s=compile_s,
        rows=rows,
        prompt_slots=p_slots,
        cache_slots=m_slots,
        drafted=iterations * k,
        accepted=accepted_total,
    )
