"""`jaxpar bench --only grpo`: one GRPO step's time split into its rollout's generation
and reshard and its update, for two training layouts of llama-tiny on the same devices
(the rollouts in the generation layout `jaxpar generate` would choose), with the
reshard's bytes per device against their minimum.

The prompts are random ids (no tokenizer), the reward the share of even ids in a
completion: a reward that varies, so that the update is a real one."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from jaxpar.bench import measure
from jaxpar.cost.report import human_bytes, table

LAYOUTS = {
    "data=8": ("parallel.data=8",),
    "data=4 x tensor=2, ZeRO-3": ("parallel.data=4", "parallel.tensor=2", "parallel.zero=3"),
}
PROMPTS, GROUP, NEW, STEPS = 8, 4, 32, 4  # a step: 8 prompts x 4 completions of 32 ids


def even_ids(prompts, completions, **fields) -> list[float]:
    """The share of even ids in each completion (written as its ids)."""
    out = []
    for c in completions:
        ids = [int(i) for i in c.split()]
        out.append(sum(i % 2 == 0 for i in ids) / max(len(ids), 1))
    return out


def grpo_steps(tables: dict) -> dict:
    import jax

    from jaxpar.config import presets
    from jaxpar.data import prompts
    from jaxpar.recipe import setup
    from jaxpar.training.trainer import train

    rng = np.random.default_rng(0)
    results, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "prompts"
        prompts.of_ids(folder, [rng.integers(1, 256, 16).tolist() for _ in range(64)], 256)
        for name, overrides in LAYOUTS.items():
            # fmt: off
            cfg = presets.load("llama-tiny", [
                "data.source=tokens", f"data.path={folder}", "train.objective=grpo",
                f"grpo.reward={__name__}:even_ids", f"grpo.group={GROUP}",
                f"grpo.max_new_tokens={NEW}", f"train.batch_size={PROMPTS * GROUP}",
                "train.seq_len=64", f"train.steps={STEPS}", "train.log_every=1", *overrides])
            # fmt: on
            s = setup(cfg, jax.devices())
            out = Path(tmp) / name.replace(" ", "")
            run = train(s.problem, cfg, s.batches, mesh=s.mesh, out_dir=out, quiet=True,
                        hooks=s.hooks)  # fmt: skip
            later = run.rows[1:]  # the first step's compiles apart
            r = results[name] = {
                k: float(np.median([row[k] for row in later]))
                for k in ("generate_s", "reshard_s", "update_s", "generate_tokens_per_s")
            }
            reshard = s.batches.summary()["grpo"]["reshard"]
            r.update(
                reshard_bytes=reshard["wire_bytes_per_device"],
                reshard_minimum=reshard["minimum_bytes_per_device"],
                generate_layout=s.batches.summary()["grpo"]["generate_layout"],
            )
            ratio = (
                f"{r['reshard_bytes'] / r['reshard_minimum']:.3f}" if r["reshard_minimum"] else "-"
            )
            rows.append([
                name, f"{r['generate_s'] * 1e3:.0f}", f"{r['reshard_s'] * 1e3:.1f}",
                f"{r['update_s'] * 1e3:.0f}", f"{r['generate_tokens_per_s']:,.0f}",
                human_bytes(r["reshard_bytes"]), ratio,
            ])  # fmt: skip
    title = (
        f"GRPO, llama-tiny, a step: {PROMPTS} prompts x {GROUP} completions of up to {NEW} "
        f"ids, rolled out in data=4 x tensor=2 on the same {jax.device_count()} devices "
        f"(the median of steps 2-{STEPS})"
    )
    header = ["training layout", "generate ms", "reshard ms", "update ms", "generate tok/s",
              "reshard / device", "/ minimum"]  # fmt: skip
    measure.show(tables, "grpo", title, table(rows, header))
    return results


def run(base, steps: int, tables: dict, out=None) -> dict:
    return {"grpo": grpo_steps(tables)}
