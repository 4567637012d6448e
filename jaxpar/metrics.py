"""Run-directory outputs: metrics.jsonl, loss.png, summary.json, and the tables we print."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """One JSON object per logged step, flushed as it is written."""

    def __init__(self, path: Path | None):
        self._file = path.open("w") if path else None
        self.rows: list[dict] = []

    def write(self, row: dict) -> None:
        self.rows.append(row)
        if self._file:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()


def plot_loss(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib  # here: only runs that write a plot pay the import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1.5)
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
    path.write_text(json.dumps(obj, indent=2) + "\n")
