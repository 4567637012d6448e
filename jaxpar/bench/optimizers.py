"""`jaxpar bench --only optimizers`: AdamW and Muon on the default model and corpus, each
at the best of three learning rates by its final held-out loss; the held-out loss against
tokens (a plot beside --out), the steps Muon needs to reach AdamW's final held-out loss,
and each one's step time, state bytes and Newton-Schulz bytes per step (the step's wire
bytes beyond AdamW's in the same layout)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxpar.bench import measure
from jaxpar.config import presets
from jaxpar.cost.report import human_bytes, table
from jaxpar.recipe import setup
from jaxpar.training import metrics
from jaxpar.training.trainer import train

OPTIMIZERS = ("adamw", "muon")
RATES = (1e-3, 3e-3, 1e-2)  # each optimizer's candidates around train.lr's default
TRAIN_STEPS = 300  # steps each candidate trains
EVAL_EVERY = 20  # steps between held-out losses
LAYOUT = ("parallel.data=8", "parallel.zero=1")  # the default layout, its state split


def held_out(base: measure.Base, optimizer: str, lr: float) -> list[tuple[int, float]]:
    """(step, held-out loss) every EVAL_EVERY steps of a TRAIN_STEPS run."""
    keys = [f"train.optimizer={optimizer}", f"train.lr={lr}", f"train.steps={TRAIN_STEPS}"]
    keys += [f"train.eval_every={EVAL_EVERY}", "train.warmup=20", *LAYOUT]
    cfg = presets.load(base.preset, [*base.overrides, *keys])
    s = setup(cfg)
    result = train(s.problem, cfg, s.batches, mesh=s.mesh, quiet=True, eval_batches=s.eval_batches)
    return [(r["step"], r["eval_loss"]) for r in result.rows if r.get("eval_loss") is not None]


def steps_to(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first evaluated step at or below `target` (None: never)."""
    return next((step for step, loss in curve if loss <= target), None)


def run(base: measure.Base, steps: int, tables: dict, out=None) -> dict:
    curves = {opt: {lr: held_out(base, opt, lr) for lr in RATES} for opt in OPTIMIZERS}
    best = {opt: min(RATES, key=lambda lr: curves[opt][lr][-1][1]) for opt in OPTIMIZERS}
    target = curves["adamw"][best["adamw"]][-1][1]
    cfg = presets.load(base.preset, list(base.overrides))
    tokens = cfg.train.batch_size * cfg.train.seq_len
    results, rows = {}, []
    for opt in OPTIMIZERS:
        timed = measure.measure(
            (f"train.optimizer={opt}", f"train.lr={best[opt]}", *LAYOUT), steps, base
        )
        report = timed["report"]
        curve = curves[opt][best[opt]]
        results[opt] = {
            "lr": best[opt],
            "curves": {str(lr): curves[opt][lr] for lr in RATES},
            "final_eval_loss": curve[-1][1],
            "steps_to_adamw_final": steps_to(curve, target),
            "step_s": timed["step_s"],
            "state_bytes": report.state_bytes.actual,
            "wire_bytes": report.comm.wire_bytes_per_device,
        }
        # Newton-Schulz's bytes: the step's beyond AdamW's, the same layout otherwise
        r = results[opt]
        r["ns_bytes"] = r["wire_bytes"] - results["adamw"]["wire_bytes"]
        rows.append([
            opt, f"{r['lr']:g}", f"{r['final_eval_loss']:.4f}",
            str(r["steps_to_adamw_final"] or "-"), f"{r['step_s'] * 1e3:.1f}",
            human_bytes(r["state_bytes"]), human_bytes(r["ns_bytes"]),
        ])  # fmt: skip
    muon, adamw = results["muon"], results["adamw"]
    ratio = (muon["steps_to_adamw_final"] or np.inf) / TRAIN_STEPS
    title = (
        f"optimizers, {measure.where(base)}, data=8 ZeRO-1, {TRAIN_STEPS} steps, best of "
        f"{', '.join(f'{lr:g}' for lr in RATES)}: Muon reaches AdamW's final held-out loss "
        f"in {ratio:.2f}x the steps, at {muon['step_s'] / adamw['step_s']:.2f}x its step time"
    )
    headers = ["optimizer", "lr", "held-out loss", "steps to AdamW's", "step ms", "state"]
    measure.show(tables, "optimizers", title, table(rows, [*headers, "NS bytes/step"]))
    if out:
        _plot(results, tokens, Path(out).with_name("bench-optimizers.png"))
    return {"optimizers": results}


def _plot(results: dict, tokens: int, path: Path) -> None:
    """Held-out loss against tokens, each optimizer at its best rate."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for opt, r in results.items():
        steps, losses = zip(*r["curves"][str(r["lr"])], strict=True)
        ax.plot(np.array(steps) * tokens, losses, marker="o", ms=3, label=f"{opt}, lr {r['lr']:g}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("held-out loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    metrics.save_figure(fig, path)
