"""A config into what a run trains: the mesh over the devices, the registered model as a
Problem (its adapters and objective on it) and its batches, held-out batches where the
config evaluates. What `jaxpar train` builds, for a Python user too (`jaxpar.setup`):

    cfg = jaxpar.load("gpt-tiny", ["parallel.data=2"])
    s = jaxpar.setup(cfg)
    jaxpar.train(s.problem, cfg, s.batches, mesh=s.mesh, eval_batches=s.eval_batches)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from jax.sharding import Mesh

from jaxpar.adapters import lora
from jaxpar.config import registry
from jaxpar.config.sections import AdapterKind, Config, Objective, Reference
from jaxpar.data import pairs, prompts
from jaxpar.data import tokens as data
from jaxpar.errors import ConfigError
from jaxpar.nn.problem import Problem, registered
from jaxpar.objectives import dpo, grpo, precompute
from jaxpar.parallel import layout_checks
from jaxpar.parallel.axes import TENSOR
from jaxpar.parallel.mesh import build_mesh, describe
from jaxpar.parallel.sharding import check_tensor_split, tensor_dims


@dataclass(frozen=True)
class Setup:
    mesh: Mesh
    problem: Problem  # the registered model, shapes only until its init runs
    batches: Callable[..., dict]  # (step, rows=slice(None)) -> one global batch
    source: str  # the data, in words
    # (i, rows=slice(None)) -> held-out batch i (train.eval_every > 0; else None)
    eval_batches: Callable[..., dict] | None = None


def setup(cfg: Config, devices=None) -> Setup:
    """The mesh over `devices` (default: all), the model as a Problem and its batches:
    the config checked against the mesh first."""
    mesh = build_mesh(cfg.parallel, devices)
    problem, batches = model_problem(cfg, describe(mesh), devices)
    return Setup(
        mesh, problem, batches, data.describe(cfg.data, cfg.train), held_out_batches(cfg, devices)
    )


def model_problem(
    cfg: Config, mesh_shape: dict, devices=None
) -> tuple[Problem, Callable[..., dict]]:
    """(the registered model `model.*` as a Problem, batches(step) from `data.*`)."""
    registry.check_model(cfg.model, mesh_shape)
    layout_checks.check_train(cfg, mesh_shape)
    own = trained_model(cfg)
    shipped = registered(cfg.model, cfg.train.seq_len)
    check_tensor_split(tensor_dims(shipped.names, shipped.shapes), mesh_shape[TENSOR])
    if cfg.train.objective is Objective.DPO:
        return dpo.objective(own, cfg), _pair_batches(cfg, own, "train", devices)
    if cfg.train.objective is Objective.GRPO:
        from jaxpar.generation.rollouts import Rollouts

        _check_grpo(cfg)
        return grpo.objective(own, cfg), Rollouts(cfg, own, math.prod(mesh_shape.values()))
    if prompts.meta_of(cfg.data) is not None:
        raise ConfigError(
            f"data.path={cfg.data.path} holds prompts (prepare-data --format prompts), with no "
            f"answers to train on by train.objective={cfg.train.objective}; train them with "
            "train.objective=grpo"
        )
    if pairs.meta_of(cfg.data) is not None:
        raise ConfigError(
            f"data.path={cfg.data.path} holds preference pairs (prepare-data --format "
            "preference), and train.objective=lm would train on the rejected answers too; "
            "train them with train.objective=dpo"
        )
    tokens = data.load_tokens(cfg.data, cfg.train, cfg.model)
    return own, _batches(cfg, tokens, 0, "train")


def _check_grpo(cfg: Config) -> None:
    g, every = cfg.grpo, cfg.checkpoint.every
    if cfg.train.eval_every:
        raise ConfigError(
            f"train.eval_every={cfg.train.eval_every}: train.objective=grpo has no held-out "
            "loss (its measure is the rollouts' reward, in metrics.jsonl); give "
            "train.eval_every=0"
        )
    if every % g.iterations:
        raise ConfigError(
            f"checkpoint.every={every}: a GRPO run saves between rollouts, each grpo.iterations="
            f"{g.iterations} steps, so that a resume samples them again; give a multiple of "
            f"{g.iterations}"
        )


def trained_model(cfg: Config) -> Problem:
    """The registered model with adapter.* on it, as the objective trains it (before the
    objective: what DPO wraps and what its precomputed reference scores)."""
    return with_adapters(registered(dpo.model_of(cfg), cfg.train.seq_len), cfg)


def with_adapters(problem: Problem, cfg: Config) -> Problem:
    """The registered model's `problem` with adapter.* on it (unchanged for kind=none)."""
    if cfg.adapter.kind is AdapterKind.LORA:
        return lora.adapted(problem, cfg.adapter, cfg.model)
    return problem


def _pair_batches(cfg: Config, own: Problem, split: str, devices=None) -> Callable[..., dict]:
    """(i, rows=slice(None)) -> batch i of `split`'s preference pairs, with the
    reference's log-probabilities where dpo.reference=precompute (`own`: the model
    before the objective, scored once)."""
    t = cfg.train
    held = pairs.load(cfg.data, t, cfg.model.vocab, split)
    reference = None
    if dpo.mode(cfg) is Reference.PRECOMPUTE:
        reference = precompute.reference_logps(cfg, own, split, devices)

    def batches(i: int, rows: slice = slice(None)) -> dict:
        return pairs.batch_at(
            held,
            seed=t.seed,
            step=i,
            batch_size=t.batch_size,
            seq_len=t.seq_len,
            rows=rows,
            reference=reference,
        )

    return batches


def _batches(cfg: Config, tokens, first: int, split: str) -> Callable[..., dict]:
    """(i, rows=slice(None)) -> batch first + i of `split`'s `tokens`, with the marks
    (documents, loss mask) the config uses."""
    t = cfg.train
    marks = data.load_marks(cfg.data, t, tokens, split) if tokens is not None else data.Marks()

    def batches(i: int, rows: slice = slice(None)) -> dict:
        return data.batch_at(
            tokens,
            seed=t.seed,
            step=first + i,
            batch_size=t.batch_size,
            seq_len=t.seq_len,
            vocab=cfg.model.vocab,
            rows=rows,
            marks=marks,
        )

    return batches


def held_out_batches(cfg: Config, devices=None) -> Callable[..., dict] | None:
    """Held-out batch i (same shape as a training batch), when train.eval_every asks."""
    if not cfg.train.eval_every:
        return None
    if cfg.train.objective is Objective.DPO:
        return _pair_batches(cfg, trained_model(cfg), "val", devices)
    tokens = data.load_eval_tokens(cfg.data, cfg.train, cfg.model)
    first = data.EVAL_STREAM if tokens is None else 0  # synthetic: draws never trained on
    return _batches(cfg, tokens, first, "val")
