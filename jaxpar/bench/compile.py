"""`jaxpar bench --only compile`: seconds to trace, lower and compile each layout's step at
each depth, and the lines of its optimized HLO: the layer stack is scanned, so compiling
should not grow with depth."""

from __future__ import annotations

import jax

from jaxpar.bench import measure
from jaxpar.compiled.run import prepare
from jaxpar.config import presets
from jaxpar.cost import hlo
from jaxpar.cost.report import table
from jaxpar.recipe import setup

# Compile time against depth: each layout at these layer counts (the layer stack is
# scanned, so compiling should not grow with it).
COMPILE_LAYOUTS = {
    "dp8": ("parallel.data=8",),
    "dp8-zero3": ("parallel.data=8", "parallel.zero=3"),
    "dp2-tp4": ("parallel.data=2", "parallel.tensor=4"),
    "dp2-pp2-tp2-1f1b": (
        "parallel.data=2",
        "parallel.pipeline=2",
        "parallel.tensor=2",
        "parallel.microbatches=2",
    ),
}
COMPILE_DEPTHS = (4, 8, 16, 32)


def compile_seconds(base: measure.Base, tables: dict) -> dict:
    """Seconds to trace, lower and compile each layout's step at each depth, and the
    lines of its optimized HLO (what the compiler had to work through); printed as a
    table with compile(deepest) / compile(shallowest)."""
    results = {}
    for name, overrides in COMPILE_LAYOUTS.items():
        results[name] = {}
        for layers in COMPILE_DEPTHS:
            cfg = presets.load(base.preset, [*base.overrides, *overrides, f"model.layers={layers}"])
            s = setup(cfg)
            step = prepare(cfg, s.problem, s.mesh, s.batches(0), base.force).step
            lines = hlo.program_lines(step.hlo)
            results[name][layers] = {"seconds": step.seconds, "hlo_lines": lines}
        print(f"compiled {name}", flush=True)
    first, last = COMPILE_DEPTHS[0], COMPILE_DEPTHS[-1]
    rows = [
        [
            name,
            *(f"{t[n]['seconds']:.2f}" for n in COMPILE_DEPTHS),
            f"{t[last]['seconds'] / t[first]['seconds']:.2f}",
            f"{t[first]['hlo_lines']} / {t[last]['hlo_lines']}",
        ]
        for name, t in results.items()
    ]
    title = f"compile seconds by depth, {base} on {jax.device_count()} devices"
    header = ["layout", *map(str, COMPILE_DEPTHS), f"{last} / {first}", "HLO lines"]
    measure.show(tables, "compile", title, table(rows, header))
    return results


def run(base: measure.Base, steps: int, tables: dict, out=None) -> dict:
    return {"compile": compile_seconds(base, tables)}
