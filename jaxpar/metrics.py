"""Run-directory outputs: metrics.jsonl, loss.png, summary.json, and the tables we print."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np


class MetricsLog:
    """One JSON object per logged step, flushed as it is written.

    `resume_at=N` keeps the complete rows of an earlier run up to step N (a torn last
    line, or rows past the checkpoint being resumed, are dropped) and appends after them.
    """

    def __init__(self, path: Path | None, resume_at: int = 0):
        self.rows: list[dict] = _rows(path, resume_at) if path and resume_at else []
        if path:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
            os.replace(tmp, path)  # atomic: a kill leaves the old or the new file
        self._file = path.open("a") if path else None

    def write(self, row: dict) -> None:
        # not-finite numbers as null: strict JSON readers refuse NaN
        row = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()
        }
        self.rows.append(row)
        if self._file:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()


def _rows(path: Path, up_to: int) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a kill
            continue
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
    )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")
