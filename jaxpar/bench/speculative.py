"""`jaxpar bench --only speculative`: greedy decoding drafted by a trained multi-token
prediction module (jaxpar.generation.speculative) against plain greedy decoding, side by
side on one device (the CPU's, or the first accelerator's): deepseek-tiny with one
module, trained TRAIN_STEPS steps on the synthetic counting sequences, decoding counting
prompts of its kind (KEY=VALUE overrides resize it: a model large enough to read its
weights from memory is where verifying K + 1 tokens comes nearly free). The tokens are
checked equal; the speed-up is the decode loops' tokens/s over plain's, each the best of
ROUNDS alternated rounds, with the share of drafts the model accepted."""

from __future__ import annotations

import jax
import numpy as np

from jaxpar.bench import measure
from jaxpar.cost.report import table

PRESET = "deepseek-tiny"
TRAIN = ("model.mtp_depth=1", "model.capacity_factor=0", "data.source=synthetic",
         "train.lr=1e-2", "parallel.data=1")  # fmt: skip
TRAIN_STEPS = 100
NEW = 128
CASES = ((1, 1), (1, 2), (8, 1))  # (prompts, drafts a step)
ROUNDS = 3


def trained(overrides: tuple[str, ...] = ()):
    """deepseek-tiny with one prediction module (resized by the overrides), trained, placed
    on one device."""
    import jaxpar
    from jaxpar import recipe
    from jaxpar.config import presets
    from jaxpar.generation import decoding

    cfg = presets.load(PRESET, [*TRAIN, *overrides, f"train.steps={TRAIN_STEPS}"])
    s = recipe.setup(cfg, jax.devices()[:1])
    result = jaxpar.train(s.problem, cfg, s.batches, mesh=s.mesh, quiet=True)
    params = jax.device_get(result.params)
    fill = lambda targets: {k: jax.device_put(params[k], t.sharding) for k, t in targets.items()}  # noqa: E731
    return decoding.placed(cfg, fill, ["parallel.data=1"], jax.devices()[:1], "bench"), result


def counting(n: int) -> list[list[int]]:
    """n prompts of 8 ids counting from a start by a stride, as the model trained on."""
    rng = np.random.default_rng(0)
    return [[int(a + b * i) % 256 for i in range(8)] for a, b in rng.integers(1, 6, (n, 2))]


def run(base, steps: int, tables: dict, out=None) -> dict:
    from jaxpar.generation import decoding, speculative

    model, result = trained(base.overrides)
    decoder = decoding.Decoder(model)
    results, rows = {}, []
    for prompts, k in CASES:
        asked = counting(prompts)
        drafter = speculative.Speculator(decoder, k)
        plain_rate = spec_rate = 0.0
        for _ in range(ROUNDS):
            plain = decoding.generate(decoder, asked, NEW, decoding.Sampling(), set())
            spec = speculative.generate(drafter, asked, NEW, set())
            assert spec.completions == plain.completions, "speculation changed the tokens"
            plain_rate = max(plain_rate, plain.decode_tokens / plain.decode_s)
            spec_rate = max(spec_rate, spec.decode_tokens / spec.decode_s)
        name = f"{prompts} x {NEW}, {k} draft{'s' * (k > 1)}"
        r = results[name] = {
            "plain_tokens_per_s": plain_rate,
            "speculative_tokens_per_s": spec_rate,
            "speedup": spec_rate / plain_rate,
            "accepted": spec.accepted / spec.drafted,
        }
        rows.append([name, f"{plain_rate:,.0f}", f"{spec_rate:,.0f}", f"{r['speedup']:.2f}x",
                     f"{r['accepted']:.0%}"])  # fmt: skip
    device = jax.devices()[0]
    where = "CPU" if device.platform == "cpu" else device.device_kind
    title = (
        f"jaxpar generate --speculate mtp, {' '.join([PRESET, *base.overrides])} with one "
        f"module trained {TRAIN_STEPS} "
        f"steps on counting sequences (mtp_loss {result.rows[-1]['mtp_loss']:.2f}), one {where} "
        f"device, counting prompts, greedy; best of {ROUNDS} alternated rounds, the tokens "
        "checked equal"
    )
    header = ["prompts x new", "plain tok/s", "speculative tok/s", "speed-up", "accepted"]
    measure.show(tables, "speculative", title, table(rows, header))
    return {"speculative": results}
