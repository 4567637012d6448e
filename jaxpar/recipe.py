"""A config into what a run trains: the mesh over the devices, the registered model as a
Problem (its adapters and objective on it) and its batches, held-out batches where the
config evaluates. What `jaxpar train` builds, for a Python user too (`jaxpar.setup`):

    cfg = jaxpar.load("gpt-tiny", ["parallel.data=2"])
    s = jaxpar.setup(cfg)
    jaxpar.train(s.problem, cfg, s.batches, mesh=s.mesh, eval_batches=s.eval_batches,
                 hooks=s.hooks)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.sharding import Mesh

from jaxpar import objectives
from jaxpar.adapters import initial, lora
from jaxpar.config import presets, registry
from jaxpar.config.sections import Adapter, AdapterKind, Config, Model, Train, computed_model, given
from jaxpar.data import mixture
from jaxpar.data import tokens as data
from jaxpar.nn.problem import Problem, registered
from jaxpar.objectives import reference
from jaxpar.parallel import layout_checks
from jaxpar.parallel.axes import TENSOR
from jaxpar.parallel.mesh import build_mesh, describe
from jaxpar.parallel.sharding import check_tensor_split, tensor_dims
from jaxpar.training.trainer import Result, finished, finished_at, train


@dataclass(frozen=True)
class Setup:
    mesh: Mesh
    problem: Problem  # the registered model, shapes only until its init runs
    batches: Callable[..., dict]  # (step, rows=slice(None)) -> one global batch
    source: str  # the data, in words
    # (i, rows=slice(None)) -> held-out batch i (train.eval_every > 0; else None)
    eval_batches: Callable[..., dict] | None = None
    # what the objective does around the steps (jaxpar.training.hooks): GRPO's rollouts,
    # which are its batches too (train.eval_tasks' scores: jaxpar.evaluation.during_training)
    hooks: tuple = ()


def setup(cfg: Config, devices=None) -> Setup:
    """The mesh over `devices` (default: all), the model as a Problem and its batches:
    the config checked against the mesh first."""
    trained_on = getattr(objectives.of(cfg.train.objective), "trained_on", None)
    kept = devices  # an objective may keep devices of its own (GRPO's rollout devices)
    if trained_on is not None:
        kept = given(trained_on, cfg, list(jax.devices() if devices is None else devices))
    mesh = build_mesh(cfg.parallel, kept)
    problem, batches = model_problem(cfg, describe(mesh), devices)
    hooks = objectives.of(cfg.train.objective).hooks(batches)
    mixed = cfg.data.mixture and mixture.describe(cfg.data.mixture, cfg.train.steps)
    source = data.describe(cfg.data, cfg.train, mixed or None)
    return Setup(mesh, problem, batches, source, held_out_batches(cfg, devices), hooks)


def model_problem(
    cfg: Config, mesh_shape: dict, devices=None
) -> tuple[Problem, Callable[..., dict]]:
    """(the registered model `model.*` as a Problem, batches(step) from `data.*`), as
    train.objective trains it."""
    registry.check_model(cfg.model, mesh_shape)
    given(layout_checks.check, cfg, mesh_shape)
    own = trained_model(cfg.model, cfg.adapter, cfg.train)
    shipped = registered(cfg.model, cfg.train.seq_len)
    check_tensor_split(tensor_dims(shipped.names, shipped.shapes), mesh_shape[TENSOR])
    objective = objectives.of(cfg.train.objective)
    given(objective.check, cfg)
    return (
        given(objective.problem, cfg, own),
        given(objective.batches, cfg, own, "train", mesh_shape, devices),
    )


def trained_model(model: Model, adapter: Adapter, train: Train) -> Problem:
    """The registered model with adapter.* on it, as the objective trains it (before the
    objective: what DPO wraps and what its precomputed reference scores)."""
    computed = registered(computed_model(model, train.objective), train.seq_len)
    return with_adapters(computed, adapter, model)


def with_adapters(problem: Problem, adapter: Adapter, model: Model) -> Problem:
    """The registered model's `problem` with adapter.* on it (unchanged for kind=none)."""
    if adapter.kind is AdapterKind.LORA:
        return lora.adapted(problem, adapter, model)
    return problem


def held_out_batches(cfg: Config, devices=None) -> Callable[..., dict] | None:
    """Held-out batch i (same shape as a training batch), when train.eval_every asks."""
    if not cfg.train.eval_every:
        return None
    own = trained_model(cfg.model, cfg.adapter, cfg.train)
    return given(objectives.of(cfg.train.objective).batches, cfg, own, "val", None, devices)


def initial_params(
    model: Model, adapter: Adapter, train: Train, problem: Problem
) -> Callable[[dict], dict] | None:
    """A run's initial parameters read from files (targets -> arrays, as jaxpar.train
    takes them): model.init's checkpoint with adapter.init's adapters, and the copy of
    the reference that `problem` (as setup made it) holds; None for the init from
    train.seed."""
    params = initial.params(model, adapter, train, trained_model(model, adapter, train))
    own = getattr(objectives.of(train.objective), "initial", None)  # an objective's leaves
    if params is not None and own is not None:
        params = own(params, model, train)
    if params is None or not problem.reference:
        return params
    return reference.copies(params, [k.removeprefix(reference.COPY) for k in problem.reference])


def train_config(cfg: Config, out_dir: str | Path | None = None, **kwargs) -> Result | None:
    """Train the registered model as the config says (what `jaxpar train` runs), from
    model.init's checkpoint if it names one (its config.json already read into cfg).
    None, saying so at once, for a run already done (unless restarted). Relative paths
    are recorded absolute (presets.absolute_paths)."""
    cfg = presets.absolute_paths(cfg)
    out_dir = None if out_dir is None else Path(out_dir)
    if (
        not kwargs.get("restart")
        and (done := finished_at(cfg.checkpoint, cfg.train.steps, out_dir)) is not None
    ):
        print(finished(done, cfg.train.steps))
        return None
    s = setup(cfg)
    hooks = s.hooks
    if cfg.train.eval_tasks.strip():  # built where a run trains: tasks are read now
        from jaxpar.evaluation.during_training import Benchmarks

        hooks += (Benchmarks(cfg),)
    return train(
        s.problem,
        cfg,
        s.batches,
        out_dir=out_dir,
        mesh=s.mesh,
        source=s.source,
        params=initial_params(cfg.model, cfg.adapter, cfg.train, s.problem),
        eval_batches=s.eval_batches,
        hooks=hooks,
        **kwargs,
    )
