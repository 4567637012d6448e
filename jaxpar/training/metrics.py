"""Run-directory outputs: metrics.jsonl, loss.png, summary.json, and the tables we print."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from jaxpar import disk
from jaxpar.errors import ConfigError

# What TensorBoard gets of each metrics row (those present in it).
TENSORBOARD_TAGS = (
    "loss",
    "eval_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "flops_per_s_per_device",
    "mfu",
)
# What the model reports (jaxpar.report), beside its "group/name" metrics ("moe/dropped"):
# multi-token prediction's loss, apart from the loss it is weighted into; a reward
# model's (TRL's names: jaxpar.objectives.reward)
MODEL_METRICS = ("mtp_loss", "accuracy", "margin", "mean_reward")


DATA_KEYS = ("epoch/", "eval_loss/", "tokens/")  # a mixture's sources' figures, the data's own


def model_reported(row: dict) -> list[str]:
    """The keys of `row` that the model reported."""
    return [k for k in row if ("/" in k or k in MODEL_METRICS) and not k.startswith(DATA_KEYS)]


def _summary_writer():
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch
    when it is installed (0.8 s, for tensors we never pass; an `hf` install has it), so
    the import is made with torch marked absent unless torch is loaded already."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # import torch raises ImportError: tensorboardX's cue
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsLog:
    """One JSON object per logged step, flushed as it is written; and, with `events`,
    the same numbers as TensorBoard scalars in event files in that folder (tensorboardX:
    a small writer with no TensorFlow behind it).

    `resume_at=N` keeps the complete rows of an earlier run up to step N (a torn last
    line, or rows past the checkpoint being resumed, are dropped) and appends after them;
    TensorBoard drops the earlier events past N likewise (purge_step). `through`: the
    step of the last row the checkpoint was saved after; a file without it lost rows a
    kill cannot tear, and is refused, untouched.
    """

    def __init__(
        self,
        path: Path | None,
        resume_at: int = 0,
        events: Path | None = None,
        through: int | None = None,
    ):
        self.rows: list[dict] = _rows(path, resume_at, through) if path and resume_at else []
        if path:  # whole: a kill or a full disk leaves the old or the new file
            disk.write_whole(path, "".join(json.dumps(r) + "\n" for r in self.rows))
        self.path, self._file = path, path.open("a") if path else None
        self._events = None
        if events:
            self._events = _summary_writer()(
                str(events), purge_step=resume_at + 1 if resume_at else None
            )

    def write(self, row: dict) -> None:
        # not-finite numbers as null: strict JSON readers refuse NaN
        row = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()
        }
        self.rows.append(row)
        if self._file:
            with disk.named(self.path):
                self._file.write(json.dumps(row) + "\n")
                self._file.flush()
        if self._events:
            # and what the model reported (jaxpar.report: "moe/dropped", ...)
            for tag in [*TENSORBOARD_TAGS, *model_reported(row)]:
                if row.get(tag) is not None:
                    self._events.add_scalar(tag, row[tag], row["step"])
            self._events.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._events:
            self._events.close()


def _rows(path: Path, up_to: int, through: int | None = None) -> list[dict]:
    """The rows of steps up to `up_to`; a last line torn by a kill is dropped, but a
    file whose other lines are not rows, or that lacks the row of step `through`, is
    refused, not rewritten without them."""
    if not path.exists():
        return []
    rows = _read_rows(path, up_to)
    if through and through not in {r["step"] for r in rows}:
        last = max((r["step"] for r in rows), default=0)
        lost = f"step {through}" if last + 1 == through else f"steps {last + 1}-{through}"
        raise ConfigError(
            f"{path}: its rows end at step {last}, but the checkpoint of step {up_to} was "
            f"saved after the row of step {through}: rows of {lost} are missing, which a "
            "kill cannot do (it tears the last line only). The file is left as it is; put "
            "its rows back, or move it away to resume with its rows started afresh"
        )
    return rows


def saved_rows(path: Path) -> list[dict]:
    """The rows a run wrote to `path` (its metrics.jsonl): what a finished run reports
    when it is asked to train again (a torn last line dropped)."""
    return _read_rows(path, up_to=1 << 62) if path.exists() else []


def _read_rows(path: Path, up_to: int) -> list[dict]:
    rows = []
    lines = path.read_bytes().splitlines()
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if number == len(lines) and line.startswith(b'{"'):  # a row torn by a kill
                continue
            raise ConfigError(
                f"{path}:{number}: not a JSON row of metrics (the run's rows are written one "
                "a line); move the file away to resume with its rows started afresh"
            ) from None
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= up_to:
            rows.append(row)
    return rows


def plot_loss(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib  # here: only runs that write a plot pay the import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(
        [r["step"] for r in rows],
        [np.nan if r["loss"] is None else r["loss"] for r in rows],
        lw=1.5,
        label="training loss",
    )
    held_out = [r for r in rows if "eval_loss" in r]
    if held_out:
        ax.plot(
            [r["step"] for r in held_out],
            [np.nan if r["eval_loss"] is None else r["eval_loss"] for r in held_out],
            "o-",
            lw=1.5,
            ms=3,
            label="held-out loss",
        )
        ax.legend(fontsize=8)
    # an RL objective's rollouts' mean reward, or a reward model's pair accuracy (held
    # out where measured), on its own scale
    for key, label in (("reward", "mean reward"), ("eval_accuracy", "held-out accuracy"),
                       ("accuracy", "pair accuracy")):  # fmt: skip
        shown = [r for r in rows if r.get(key) is not None]
        if shown:
            right = ax.twinx()
            right.plot([r["step"] for r in shown], [r[key] for r in shown], "o-",
                       color="tab:green", lw=1.5, ms=3, label=label)  # fmt: skip
            right.set_ylabel(label, color="tab:green")
            right.legend(fontsize=8, loc="lower left")
            break
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)


def plot_strategies(results: dict[str, dict], path: Path, title: str) -> None:
    """The bench's strategies side by side: memory per device by kind, bytes on the wire
    against the textbook minimum, and step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    reports = [results[n]["report"] for n in names]
    x = np.arange(len(names))
    fig, (mem, wire, time_) = plt.subplots(1, 3, figsize=(15, 4.2), dpi=110)
    bottom = np.zeros(len(names))
    for kind in ("params", "grads", "opt_state", "temp"):
        mib = np.array([getattr(r.memory_per_device, kind) for r in reports]) / 2**20
        mem.bar(x, mib, bottom=bottom, label=kind)
        bottom += mib
    mem.set_title("memory per device (MiB)", fontsize=9)
    mem.legend(fontsize=7)
    sent = np.array([r.comm.wire_bytes_per_device for r in reports]) / 2**20
    least = np.array([r.comm.minimum_bytes_per_device for r in reports]) / 2**20
    wire.bar(x, sent, label="on the wire")
    wire.scatter(x, least, color="black", marker="_", s=400, zorder=3, label="textbook minimum")
    wire.set_title("bytes per device per step (MiB)", fontsize=9)
    wire.legend(fontsize=7)
    time_.bar(x, [results[n]["step_s"] * 1e3 for n in names], color="tab:green")
    time_.set_title("step time (ms)", fontsize=9)
    for ax in (mem, wire, time_):
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    """A figure written whole or not at all, in the format its name ends with; closed."""
    import matplotlib.pyplot as plt

    with disk.named(path), disk.staged(path) as part:
        fig.savefig(part, format=path.suffix.lstrip("."))
    plt.close(fig)


def write_json(path: Path, obj: dict) -> None:
    disk.write_whole(path, json.dumps(obj, indent=2) + "\n")
