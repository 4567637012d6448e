"""`jaxpar bench --only grpo`: one GRPO step's time split into its rollout's generation
and reshard and its update, for two training layouts of llama-tiny on the same devices
(the rollouts in the generation layout `jaxpar generate` would choose), with the
reshard's bytes per device against their minimum.

The prompts are random ids (no tokenizer), the reward the share of even ids in a
completion: a reward that varies, so that the update is a real one."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxpar.bench import measure
from jaxpar.cost.report import human_bytes, table
from jaxpar.training.hooks import Hook

LAYOUTS = {
    "data=8": ("parallel.data=8",),
    "data=4 x tensor=2, ZeRO-3": ("parallel.data=4", "parallel.tensor=2", "parallel.zero=3"),
}
PROMPTS, GROUP, NEW, STEPS = 8, 4, 32, 4  # a step: 8 prompts x 4 completions of 32 ids
APART_STEPS = 8


def even_ids(prompts, completions, **fields) -> list[float]:
    """The share of even ids in each completion (written as its ids)."""
    out = []
    for c in completions:
        ids = [int(i) for i in c.split()]
        out.append(sum(i % 2 == 0 for i in ids) / max(len(ids), 1))
    return out


def _prompts(folder: Path, vocab: int) -> Path:
    """64 prompts of 16 random ids below `vocab`, prepared in `folder`."""
    from jaxpar.data import prompts

    rng = np.random.default_rng(0)
    prompts.of_ids(folder, [rng.integers(1, vocab, 16).tolist() for _ in range(64)], vocab)
    return folder


def _config(folder: Path, steps: int, overrides):
    """llama-tiny trained by GRPO on `folder`'s prompts, a step's rollouts as the module's
    docstring says."""
    from jaxpar.config import presets

    # fmt: off
    return presets.load("llama-tiny", [
        "data.source=tokens", f"data.path={folder}", "train.objective=grpo",
        f"grpo.reward={__name__}:even_ids", f"grpo.group={GROUP}",
        f"grpo.max_new_tokens={NEW}", f"train.batch_size={PROMPTS * GROUP}",
        "train.seq_len=64", f"train.steps={steps}", "train.log_every=1", *overrides])
    # fmt: on


def grpo_steps(tables: dict) -> dict:
    import jax

    from jaxpar.recipe import setup
    from jaxpar.training.trainer import train

    results, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        folder = _prompts(Path(tmp) / "prompts", 256)
        for name, overrides in LAYOUTS.items():
            cfg = _config(folder, STEPS, overrides)
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


# the fine-tuning walk-through's Llama (scripts/make_tiny_llama.py) in shape
WALK_THROUGH = ("model.embed=128", "model.kv_heads=4", "model.mlp=256", "model.vocab=512")
APART = {  # the same 8 devices, the same rollouts a step
    "together: rollouts then the step, data=8": ("parallel.data=8",),
    "apart, one after the other: 4 roll out, 4 train (data=2 x tensor=2)": (
        "grpo.rollout_devices=4", "parallel.data=2", "parallel.tensor=2"),
    "apart, beside the steps: the same, staleness 1": (
        "grpo.rollout_devices=4", "grpo.staleness=1", "parallel.data=2", "parallel.tensor=2"),
}  # fmt: skip


class _Clock(Hook):
    """Each step's start, after the rollouts' work before it: a step's whole time."""

    def __init__(self):
        self.at: list[float] = []

    def before_due(self, step: int) -> bool:
        return True

    def before(self, state, step: int) -> None:
        self.at.append(time.perf_counter())


def apart_steps(tables: dict) -> dict:
    """A GRPO step's whole time (the trainer's wait for its rollout, the reshard and
    the update) with the rollouts on the trainer's devices and on devices of their own,
    made one step ahead beside the update."""
    import jax

    from jaxpar.recipe import setup
    from jaxpar.training.trainer import train

    results, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        folder = _prompts(Path(tmp) / "prompts", 512)
        for name, overrides in APART.items():
            cfg = _config(folder, APART_STEPS, (*WALK_THROUGH, *overrides))
            s, clock = setup(cfg, jax.devices()), _Clock()
            out = Path(tmp) / str(len(rows))
            run = train(s.problem, cfg, s.batches, mesh=s.mesh, out_dir=out, quiet=True,
                        hooks=(*s.hooks, clock))  # fmt: skip
            later = run.rows[2:]  # the first steps' compiles apart
            r = results[name] = {
                "step_s": float(np.median(np.diff(clock.at)[1:])),
                **{k: float(np.median([row.get(k, 0.0) for row in later]))
                   for k in ("generate_s", "rollout_wait_s", "update_s")},
            }  # fmt: skip
            shown = ("generate_s", "rollout_wait_s", "update_s", "step_s")
            rows.append([name, *(f"{r[k] * 1e3:.0f}" for k in shown)])
    together = next(iter(results.values()))["step_s"]
    for row, r in zip(rows, results.values(), strict=True):
        r["x_together"] = r["step_s"] / together
        row.append(f"{r['x_together']:.2f}x")
    title = (
        f"GRPO apart and together, the walk-through's Llama (4 layers, 128 wide), a step: "
        f"{PROMPTS} prompts x {GROUP} completions of up to {NEW} ids on "
        f"{jax.device_count()} devices sharing {os.cpu_count()} cores (the median of "
        f"steps 3-{APART_STEPS})"
    )
    header = ["rollouts", "generate ms", "waited ms", "update ms", "a step, ms", "x together"]
    measure.show(tables, "grpo-apart", title, table(rows, header))
    return results


def run(base, steps: int, tables: dict, out=None) -> dict:
    return {"grpo": grpo_steps(tables), "grpo-apart": apart_steps(tables)}
