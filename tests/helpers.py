"""Run a shipped preset on a sub-mesh and compare runs."""

from __future__ import annotations

import functools
import math
import subprocess
import sys

import jax
import numpy as np

from jaxpar import config
from jaxpar.mesh import build_mesh, describe
from jaxpar.trainer import shipped_problem, train


def run(preset: str, overrides: list[str], steps: int = 10):
    """Train `preset` with `overrides` on as many devices as the degrees ask for."""
    cfg = config.load(preset, [f"train.steps={steps}", *overrides])
    n = math.prod(max(getattr(cfg.parallel, a), 1) for a in ("data", "pipeline", "tensor"))
    mesh = build_mesh(cfg.parallel, jax.devices()[:n])
    problem, batches, tensor_elements = shipped_problem(cfg, describe(mesh))
    return train(problem, cfg, batches, mesh=mesh, tensor_elements=tensor_elements, quiet=True)


def assert_same_training(result, reference, rtol: float = 1e-4, per_leaf: bool = True) -> None:
    """Every step's loss, and the final parameters, within relative `rtol`: each leaf
    (per_leaf) or the whole parameter vector. The whole-vector form is for models where
    even one device with grad_accum=4 versus 1 misses the per-leaf form: float32
    reassociation, amplified by Adam on near-zero gradients of small leaves (biases)."""
    losses, ref_losses = np.array(result.losses), np.array(reference.losses)
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol, atol=0)
    got_leaves = jax.tree_util.tree_leaves_with_path(result.params)
    want_leaves = jax.tree_util.tree_leaves_with_path(reference.params)
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
    pairs = [
        (jax.tree_util.keystr(path), np.asarray(got), np.asarray(want))
        for (path, got), (_, want) in zip(got_leaves, want_leaves, strict=True)
    ]
    if not per_leaf:
        diff = np.sqrt(sum(np.sum((g - w) ** 2) for _, g, w in pairs))
        err = diff / np.sqrt(sum(np.sum(w**2) for _, _, w in pairs))
        assert err <= rtol, f"parameters: relative error {err:.2e} > {rtol}"
        return
    for name, got, want in pairs:
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= rtol, f"parameter {name}: relative error {err:.2e} > {rtol}"


@functools.cache
def compile_only(preset: str, overrides: tuple[str, ...]) -> dict:
    """The summary of a compiled (not run) step: memory, collectives, comm (cached)."""
    from jaxpar.step import build  # noqa: PLC0415
    from jaxpar.trainer import compile_step, describe_run  # noqa: PLC0415

    cfg = config.load(preset, overrides)
    n = math.prod(max(getattr(cfg.parallel, a), 1) for a in ("data", "pipeline", "tensor"))
    mesh = build_mesh(cfg.parallel, jax.devices()[:n])
    problem, batches, tensor_elements = shipped_problem(cfg, describe(mesh))
    engine = build(problem, cfg, mesh)
    step = compile_step(engine, batches(0))
    return describe_run(cfg, mesh, engine, step, tensor_elements, batches(0))


def jaxpar_command(*args: str) -> subprocess.CompletedProcess:
    """`jaxpar ARGS` in a fresh process (so --cpu-devices really sets up jax)."""
    return subprocess.run(
        [sys.executable, "-m", "jaxpar.cli", *args], capture_output=True, text=True, timeout=300
    )
