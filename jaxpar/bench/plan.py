"""`jaxpar bench --only plan`: the seconds `jaxpar plan` takes on its heaviest case, and
how many layouts it considered."""

from __future__ import annotations

import time

from jaxpar.bench import measure
from jaxpar.config import presets
from jaxpar.cost.report import table
from jaxpar.nn.problem import registered

# `jaxpar plan`'s heaviest case: a 70B GPT on 64 devices over 8 hosts (shapes only)
PLAN_70B = ("model.layers=80", "model.embed=8192", "model.heads=64", "model.mlp=28672",
            "model.vocab=32000", "train.seq_len=4096", "train.batch_size=512",
            "train.precision=bf16", "data.source=synthetic")  # fmt: skip


def plan_seconds(tables: dict) -> dict:
    """Seconds `jaxpar plan` takes to rank every layout of PLAN_70B (gpt-tiny's model
    scaled to 70B) on 64 devices over 8 hosts, and how many it considered."""
    from jaxpar.cost import planner

    cfg = presets.load("gpt-tiny", list(PLAN_70B))
    problem, work = registered(cfg.model, cfg.train.seq_len), planner.of_config(cfg)
    start = time.perf_counter()
    plan = planner.make_plan(cfg, problem, planner.machine(64, "80GB", hosts=8), work)
    seconds = time.perf_counter() - start
    title = f"jaxpar plan, a 70B GPT on 64 devices over 8 hosts ({' '.join(PLAN_70B)})"
    rows = [[str(plan.considered), str(len(plan.ranked)), f"{seconds:.2f}"]]
    measure.show(tables, "plan", title, table(rows, ["layouts considered", "fit", "seconds"]))
    return {"seconds": seconds, "considered": plan.considered, "fit": len(plan.ranked)}


def run(base: measure.Base, steps: int, tables: dict, out=None) -> dict:
    return {"plan": {"gpt-70b": plan_seconds(tables)}}
