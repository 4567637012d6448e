"""Parameter averaging against gradient all-reduce: the loss curves, on the default corpus.

    python scripts/local_sgd_curve.py                # docs/local-sgd.png and a table
    python scripts/local_sgd_curve.py --steps 60     # shorter

The default job's model, batch and schedule (`jaxpar train`'s preset) on data=8 with
AdamW, once with gradients all-reduced every step and then with parallel.dp_sync=params
at several sync_every, plain averaging and DiLoCo's outer Nesterov step. Every run
starts from the same parameters and sees the same batches; each device's local steps
use its own 4 rows of each 32-row batch. The held-out loss (the preset evaluates every
50 steps on the corpus's held-out tail) is the last one, at the final step.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from jaxpar.config import presets

RUNS = {
    "grads (all-reduce every step)": (),
    "params, every 4 steps": ("parallel.dp_sync=params", "parallel.sync_every=4"),
    "params, every 16 steps": ("parallel.dp_sync=params", "parallel.sync_every=16"),
    "DiLoCo, every 16, outer lr 0.7, Nesterov 0.9": (
        "parallel.dp_sync=params",
        "parallel.sync_every=16",
        "parallel.outer_lr=0.7",
        "parallel.outer_momentum=0.9",
    ),
}
LAYOUT = ("parallel.data=8", "parallel.pipeline=1", "parallel.tensor=1", "parallel.zero=0")
LAYOUT += ("parallel.microbatches=1",)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("docs/local-sgd.png"))
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from jaxpar.cost.report import human_bytes, table
    from jaxpar.recipe import setup
    from jaxpar.training.trainer import train

    curves, rows = {}, []
    for name, overrides in RUNS.items():
        cfg = presets.load("default", [*LAYOUT, *overrides, f"train.steps={args.steps}"])
        s = setup(cfg)
        result = train(
            s.problem,
            cfg,
            s.batches,
            mesh=s.mesh,
            quiet=True,
            progress=False,
            eval_batches=s.eval_batches,
        )
        curves[name] = result.losses
        tail = float(np.mean(result.losses[-20:]))
        wire = result.report.comm.by_axis["data"].wire
        held_out = result.report.eval_loss
        rows.append([name, f"{tail:.3f}", f"{held_out:.3f}", human_bytes(wire)])
        print(f"ran {name}", flush=True)
    print()
    header = ["run", "mean loss, last 20 steps", "held-out loss", "data bytes/step/device"]
    print(table(rows, header))

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (bytes, nats)")
    ax.set_title(f"gpt (default preset) on data=8, AdamW, {args.steps} steps")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()
