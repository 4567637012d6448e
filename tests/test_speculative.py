"""`jaxpar generate --speculate mtp` (jaxpar.generation.speculative): greedy decoding
drafted by the first multi-token prediction module and verified by the model is plain
greedy decoding, token for token: Llama and DeepSeek-tiny, each with one module trained a
little on counting sequences (so that some drafts are accepted and some are not), 1 and
8 prompts, on one device and over tensor=2."""

import jax
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


@pytest.mark.parametrize("layout", ["parallel.data=1", "parallel.tensor=2"])
@pytest.mark.parametrize("preset", PRESETS)
def test_speculation_is_plain_greedy_decoding(preset, layout):
    """Identical ids for 1 and 8 prompts, 40 new tokens each; for one prompt, drafts
    accepted and rejected along the way (a batch advances by its rows' fewest accepted,
    which a little training leaves at none for 8 prompts)."""
    cfg = presets.load(preset, [*PRESETS[preset], "train.steps=20"])
    params = trained(preset, (*PRESETS[preset],), steps=20).params
    fill = lambda targets: {k: jax.device_put(params[k], t.sharding) for k, t in targets.items()}  # noqa: E731
    model = decoding.placed(cfg, fill, [layout], jax.devices()[:2], preset)
    decoder = decoding.Decoder(model)
    for n in (1, 8):
        asked = prompts(n)
        plain = decoding.generate(decoder, asked, 40, decoding.Sampling(), set())
        spec = speculative.generate(speculative.Speculator(decoder), asked, 40, set())
        assert spec.completions == plain.completions
        if n == 1:
            assert 0 < spec.accepted < spec.drafted, (spec.accepted, spec.drafted)
