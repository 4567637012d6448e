"""`jaxpar bench`: the sections asked for (default: all), each measured by its module on
the same model and batch, their tables printed, and with --out all of it as JSON."""

from __future__ import annotations

import importlib
from pathlib import Path

from jaxpar.bench.measure import Base
from jaxpar.errors import ConfigError
from jaxpar.training import metrics

# in the order they run; each is jaxpar.bench.<name>, with run(base, steps, tables, out)
SECTIONS = ("strategies", "schedules", "dp", "hosts", "offload", "remat", "context")
SECTIONS += ("experts", "checkpoint", "longest", "compile", "plan", "generate", "grpo")
SECTIONS += ("optimizers", "speculative")


def run_bench(
    base: Base | None = None,
    steps: int = 20,
    out: Path | None = None,
    only: list[str] | None = None,
) -> dict:
    """Measure the `only` sections (default: all) on `base`'s model (default: the default
    model's tiny preset) and print their tables."""
    base = Base() if base is None else base
    unknown = sorted(set(only or ()) - set(SECTIONS))
    if unknown:
        raise ConfigError(
            f"jaxpar bench --only {' '.join(unknown)}: no such section; "
            f"choose from {' '.join(SECTIONS)}"
        )
    tables: dict = {}
    results: dict = {}
    for name in (s for s in SECTIONS if not only or s in only):
        section = importlib.import_module(f"jaxpar.bench.{name}")
        results |= section.run(base, steps, tables, out)
    if out:
        metrics.write_json(
            out,
            {
                section: {
                    name: {**r, "report": r["report"].to_json()} if "report" in r else r
                    for name, r in rows.items()
                }
                for section, rows in results.items()
            }
            | {"tables": tables},
        )
    return results
