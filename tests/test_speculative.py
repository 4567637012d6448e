"""`jaxpar generate --speculate mtp` (jaxpar.generation.speculative): greedy decoding
drafted by the first multi-token prediction module and verified by the model is plain
greedy decoding, token for token: Llama and DeepSeek-tiny, each with one module trained a
little on counting sequences (so that some drafts are accepted and some are not), 1 and
8 prompts, on one device and over tensor=2. The drafts are the module's: for one prompt,
the drafts accepted are those that the module's guesses over the whole sequence, read in
one forward, predict."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import trained

from jaxpar.config import presets
from jaxpar.generation import decoding, speculative

pytestmark = pytest.mark.slow  # trains, and decodes

TRAIN = ("model.mtp_depth=1", "model.capacity_factor=0", "data.source=synthetic",
         "train.lr=1e-2", "train.batch_size=8", "parallel.data=1")  # fmt: skip
PRESETS = {"llama-tiny": TRAIN[:1] + TRAIN[2:], "deepseek-tiny": TRAIN}


def prompts(n: int) -> list[list[int]]:
    """Prompts of 3 to 10 ids counting by one, as the modules trained on."""
    starts = np.random.default_rng(1).integers(1, 200, n)
    return [[int(a + i) for i in range(3 + j)] for j, a in enumerate(starts)]


def module_guesses(decoder, seq: list[int]) -> np.ndarray:
    """The first module's greedy guess at seq[i + 2] from each position i, the whole
    sequence read in one forward through fresh caches: the model's normed hidden state
    at i and the token at i + 1."""
    m, slots = decoder.m, -(-len(seq) // 16) * 16
    tokens = np.zeros((1, slots), np.int32)
    tokens[0, : len(seq)] = seq
    positions, pad = np.arange(slots, dtype=np.int32)[None], np.zeros(1, np.int32)

    def guesses(params, cache, mcache):
        model = m.problem.module(params)
        x, _ = model.decode_states(tokens, positions, cache, 0, pad)
        ahead = jnp.roll(tokens, -1, 1)
        _, logits, _ = model.draft(model.norm(x), ahead, positions, mcache, 0, pad)
        return jnp.argmax(logits[0], -1)

    caches = decoder.empty(1, slots), decoder.empty(1, slots)[0]
    return np.asarray(jax.jit(guesses)(m.params, *caches))


def accepted_in(guess: np.ndarray, seq: list[int], start: int, iterations: int) -> int:
    """The drafts (one an iteration) that greedy decoding of `seq` accepts in
    `iterations` iterations from slot `start`: at slot j (seq[j] the newest token), the
    draft is the guess from j - 1; kept, the next slot is j + 2, else j + 1."""
    j, hits = start, 0
    for _ in range(iterations):
        hit = int(guess[j - 1] == seq[j + 1])
        hits, j = hits + hit, j + 1 + hit
    return hits


@pytest.mark.parametrize("layout", ["parallel.data=1", "parallel.tensor=2"])
@pytest.mark.parametrize("preset", PRESETS)
def test_speculation_is_plain_greedy_decoding(preset, layout):
    """Identical ids for 8 prompts, 40 new tokens each, and for 1 prompt, 16; for that
    one, the drafts accepted are the module's hits, some and not all (a batch advances
    by its rows' fewest accepted, which a little training leaves at none for 8)."""
    cfg = presets.load(preset, [*PRESETS[preset], "train.steps=20"])
    params = trained(preset, (*PRESETS[preset],), steps=20).params
    fill = lambda targets: {k: jax.device_put(params[k], t.sharding) for k, t in targets.items()}  # noqa: E731
    model = decoding.placed(cfg, fill, [layout], jax.devices()[:2], preset)
    decoder = decoding.Decoder(model)
    drafter = speculative.Speculator(decoder)
    runs = {}
    for n, new in ((8, 40), (1, 16)):
        asked = prompts(n)
        plain = decoding.generate(decoder, asked, 40, decoding.Sampling(), set())
        runs[n] = asked[0], plain, speculative.generate(drafter, asked, new, set())
        assert runs[n][2].completions == [c[:new] for c in plain.completions]
    prompt, plain, spec = runs[1]
    # 16 new tokens take at most 16 iterations, which read at most 32 tokens ahead
    seq = prompt + plain.completions[0]
    hits = accepted_in(module_guesses(decoder, seq), seq, len(prompt), spec.decode_steps)
    assert spec.accepted == hits and 0 < hits < spec.drafted, (hits, spec.accepted, spec.drafted)
