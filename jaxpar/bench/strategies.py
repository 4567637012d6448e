"""`jaxpar bench --only strategies`: every strategy of data, tensor and ZeRO on 8 devices:
compile time, step time and tokens/s, model-state bytes against the ZeRO formula, wire
bytes against the textbook minimum, the trainer's step time over the bare compiled step,
and its own host work per step (what that ratio would cost if nothing overlapped)."""

from __future__ import annotations

from pathlib import Path

from jaxpar.bench import measure
from jaxpar.training import metrics

STRATEGIES = {
    "dp8-zero0": ("parallel.data=8", "parallel.zero=0"),
    "dp8-zero1": ("parallel.data=8", "parallel.zero=1"),
    "dp8-zero2": ("parallel.data=8", "parallel.zero=2"),
    "dp8-zero3": ("parallel.data=8", "parallel.zero=3"),
    "dp4-tp2-zero0": ("parallel.data=4", "parallel.tensor=2", "parallel.zero=0"),
    "dp4-tp2-zero3": ("parallel.data=4", "parallel.tensor=2", "parallel.zero=3"),
    "dp2-tp4-zero2": ("parallel.data=2", "parallel.tensor=4", "parallel.zero=2"),
    "tp8": ("parallel.data=1", "parallel.tensor=8"),
}

STRATEGY_COLUMNS = {
    "compile s": lambda r: f"{r['compile_s']:.1f}",
    "step ms": measure.step_ms,
    "tokens/s": measure.tokens_per_s,
    "state": measure.state,
    "ZeRO formula": measure.bytes_of(lambda rep: rep.state_bytes.formula),
    "ratio": lambda r: f"{r['report'].state_bytes.ratio:.3f}",
    "comm/step": measure.comm,
    "minimum": measure.minimum,
    "ratio ": measure.comm_ratio,
    "trainer/bare": lambda r: f"{r['trainer_over_bare']:.3f}",
    "host ms": lambda r: f"{r['host_s'] * 1e3:.2f}",
}


def run(base: measure.Base, steps: int, tables: dict, out: Path | None = None) -> dict:
    """The table, and its picture beside --out (default bench-strategies.png here)."""
    title = (
        f"{measure.where(base)}; step time is the best of {measure.REPEATS} runs of {steps} steps"
    )
    results = measure.layouts(
        "strategies", tables, title, "strategy", STRATEGIES, STRATEGY_COLUMNS, steps, base
    )
    picture = out.with_suffix(".png") if out else Path("bench-strategies.png")
    measured = {n: r for n, r in results.items() if "report" in r}
    metrics.plot_strategies(measured, picture, title)
    print(f"\npicture: {picture}")
    return {"strategies": results}
