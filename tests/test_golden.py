"""Golden partition specs per (model, strategy) and collective counts per strategy.

Regenerate after an intended change, then review the diff:
    python -m pytest tests/test_golden.py --update-golden
"""

import json
from pathlib import Path

import jax
import pytest
from helpers import compile_only
from layouts import STRATEGIES

from jaxpar import recipe
from jaxpar.config import presets
from jaxpar.parallel.mesh import resolve_degrees
from jaxpar.parallel.sharding import SPEC_FIELDS, plan

GOLDEN = Path(__file__).parent / "golden"
MODELS = ("gpt-tiny", "mlp-tiny")


def _specs(preset: str, overrides) -> dict:
    cfg = presets.load(preset, list(overrides))
    mesh_shape = resolve_degrees(cfg.parallel, 8)
    problem, _ = recipe.model_problem(cfg, mesh_shape)
    specs = plan(
        problem.names,
        jax.tree.map(lambda s: s.shape, problem.shapes),
        zero=cfg.parallel.zero,
        mesh_shape=mesh_shape,
    )
    return {
        path: {field: ",".join(a or "-" for a in getattr(s, field)) for field in SPEC_FIELDS}
        for path, s in sorted(specs.items())
    }


def _check(name: str, actual: dict, update: bool) -> None:
    path = GOLDEN / name
    if update:
        path.write_text(json.dumps(actual, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"rewrote {path}")
    assert actual == json.loads(path.read_text()), (
        f"{path} differs; if intended, rerun with --update-golden and review the diff"
    )


def test_partition_specs(update_golden):
    actual = {
        f"{model}/{name}": _specs(model, overrides)
        for model in MODELS
        for name, overrides in STRATEGIES.items()
    }
    _check("partition_specs.json", actual, update_golden)


@pytest.mark.slow  # compiles every strategy of both models
def test_collective_counts(devices, update_golden):
    actual = {
        name: compile_only("gpt-tiny", overrides).collective_counts
        for name, overrides in STRATEGIES.items()
    }
    _check("collective_counts.json", actual, update_golden)
