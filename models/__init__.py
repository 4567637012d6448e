"""Models shipped with jaxpar, by `model.name`, their loss, and the wiring that makes one
a jaxpar Problem on the configured data (what `jaxpar train` and `jaxpar bench` run)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar import config as config_lib
from jaxpar import data
from jaxpar.config import Config, Model
from jaxpar.layers import scan_layers
from jaxpar.mesh import build_mesh, describe
from jaxpar.problem import Problem, Stages, from_nnx
from jaxpar.trainer import Result, train
from models.common import apply_layer
from models.gpt import GPT
from models.mlp import MLP

MODELS = {"gpt": GPT, "mlp": MLP}


def build(cfg: Model, seq_len: int, rngs: nnx.Rngs) -> nnx.Module:
    return MODELS[cfg.name](cfg, seq_len, rngs)


def embed_inputs(model: nnx.Module, batch: dict) -> jnp.ndarray:
    """The pipeline's first piece: tokens[:, :-1] -> residual stream."""
    return model.embed(batch["tokens"][:, :-1])


def token_losses(model: nnx.Module, x_BxSxE: jnp.ndarray, batch: dict) -> jnp.ndarray:
    """The pipeline's last piece: per-token cross-entropy of predicting tokens[:, 1:]."""
    logits_BxSxV = model.logits(x_BxSxE).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxSxV, batch["tokens"][:, 1:])


def next_token_loss(model: nnx.Module, batch: dict) -> jnp.ndarray:
    """Per-token cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1]."""
    x_BxSxE = scan_layers(model.blocks, embed_inputs(model, batch), apply_layer)
    return token_losses(model, x_BxSxE, batch)


def stages(cfg: Model, seq_len: int) -> Stages:
    """How the shipped models are cut into pipeline stages, with forward FLOPs per token
    of the embedding, one block and the output head (for balancing the stages)."""
    e, m, v = cfg.embed, cfg.mlp, cfg.vocab
    block = {"gpt": 8 * e * e + 4 * e * m + 4 * seq_len * e, "mlp": 4 * e * m}[cfg.name]
    return Stages(
        pre=embed_inputs,
        stack="blocks",
        layer=apply_layer,
        post=token_losses,
        costs=(2 * v * e, block, 2 * e * v),
    )


# Megatron all-reduces of a [batch, seq, embed] activation over `tensor`, per micro-batch:
# each block's row-split outputs in forward and column-split inputs in backward, plus the
# vocab-split embedding (forward) and output projection (backward).
TENSOR_ALLREDUCES = {
    "gpt": lambda layers: 4 * layers + 2,  # attention + MLP, 2 each way
    "mlp": lambda layers: 2 * layers + 2,  # one feed-forward, 1 each way
}


def tensor_allreduce_elements(cfg: Model, rows: int, seq_len: int) -> int:
    """Elements all-reduced over `tensor` for one micro-batch of `rows` sequences."""
    return TENSOR_ALLREDUCES[cfg.name](cfg.layers) * rows * seq_len * cfg.embed


def problem(cfg: Config, mesh_shape: dict) -> tuple[Problem, Callable[[int], dict]]:
    """(the shipped model `model.*` as a Problem, batches(step) from `data.*`)."""
    config_lib.check_model(cfg.model, mesh_shape)
    config_lib.check_train(cfg, mesh_shape)
    tokens = data.load_tokens(cfg.data, cfg.train, cfg.model)
    t = cfg.train
    shipped = abstract(cfg)

    def batches(step: int, rows: slice = slice(None)) -> dict:
        return data.batch_at(
            tokens,
            seed=t.seed,
            step=step,
            batch_size=t.batch_size,
            seq_len=t.seq_len,
            vocab=cfg.model.vocab,
            rows=rows,
        )

    return shipped, batches


def train_config(cfg: Config, out_dir: Path | None = None, **kwargs) -> Result:
    """Train a shipped model as the config says (what `jaxpar train` runs)."""
    mesh = build_mesh(cfg.parallel)
    shipped, batches = problem(cfg, describe(mesh))
    source = data.describe(cfg.data, cfg.train)
    return train(shipped, cfg, batches, out_dir=out_dir, mesh=mesh, source=source, **kwargs)


def inspect_config(cfg: Config, picture: Path) -> str:
    """A shipped model's step as the config says, compiled and not run (`jaxpar
    inspect`): the leaf table and the ledger's summary; the layout drawn to `picture`."""
    from jaxpar import console, inspect
    from jaxpar.run import prepare

    mesh = build_mesh(cfg.parallel)
    shipped, batches = problem(cfg, describe(mesh))
    run = prepare(cfg, shipped, mesh, batches(0), force=True)
    rows = inspect.leaves(run)
    inspect.draw(run, rows, picture)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(shipped.shapes))
    source = data.describe(cfg.data, cfg.train)
    return "\n".join(
        [
            inspect.leaf_table(rows),
            "",
            console.startup(run.report, n_params, mesh.devices.flat[0].platform, source),
            f"\nlayout picture: {picture}",
        ]
    )


def abstract(cfg: Config) -> Problem:
    """The shipped model as a Problem (shapes only until its init runs: nothing is
    allocated), with its pipeline stages and Megatron's count of tensor all-reduces."""
    seq_len = cfg.train.seq_len
    shipped = from_nnx(
        lambda rngs: build(cfg.model, seq_len, rngs),
        next_token_loss,
        stages(cfg.model, seq_len),
    )
    return dataclasses.replace(
        shipped, tensor_elements=lambda rows: tensor_allreduce_elements(cfg.model, rows, seq_len)
    )


def validate(plan, machine, top: int, scale: str = "gpt-tiny") -> str:
    """`jaxpar plan --validate`: the top layouts that fit on this host's devices, with the
    model and batch scaled down to `scale`'s, predicted and compiled (not run)."""
    from jaxpar import pipeline, planner
    from jaxpar.metrics import human_bytes, table
    from jaxpar.run import prepare

    small = config_lib.load(scale)
    rows, local = [], jax.device_count()
    for c in plan.ranked[:top]:
        if math.prod(c.mesh.values()) > local:
            continue
        cfg = dataclasses.replace(
            c.cfg,
            model=small.model,
            train=dataclasses.replace(
                small.train, grad_accum=c.cfg.train.grad_accum, precision=c.cfg.train.precision
            ),
        )
        try:
            config_lib.check_model(cfg.model, c.mesh)
            config_lib.check_train(cfg, c.mesh)
        except config_lib.ConfigError as e:
            rows.append([c.label(), f"not at {scale}'s dims: {e}"[:60], *["-"] * 6])
            continue
        shapes = abstract(cfg)
        p = c.mesh["pipeline"]
        guess = planner.predict(cfg, c.mesh, machine, pipeline.in_stages(shapes, p))
        mesh = build_mesh(cfg.parallel, jax.devices()[: math.prod(c.mesh.values())])
        shipped, batches = problem(cfg, describe(mesh))
        report = prepare(cfg, shipped, mesh, batches(0), force=True).report
        axes = ["data"] if p > 1 else ["data", "tensor"]
        wire = sum(report.comm.by_axis[a].wire for a in axes)
        predicted_wire = sum(guess.comm[a] for a in axes)
        temp = report.memory_per_device.temp
        rows.append(
            [
                c.label(),
                human_bytes(guess.model_state),
                f"{guess.model_state / report.state_bytes.actual:.3f}",
                human_bytes(guess.activations + guess.gather_temp),
                f"{(guess.activations + guess.gather_temp) / temp:.2f}",
                human_bytes(predicted_wire),
                f"{predicted_wire / wire:.3f}" if wire else "-",
                "" if abs(predicted_wire / max(wire, 1) - 1) <= 0.1 or not wire else "!",
            ]
        )
    header = ["layout", "state", "/ compiled", "activations", "/ compiled temp", "comm",
              "/ compiled", ""]  # fmt: skip
    return (
        f"\nvalidated at {scale}'s dims on {local} local devices (predicted, and predicted "
        "over compiled; temp: the compiled step's temporaries, which the activation count "
        "only estimates):\n\n" + table(rows, header)
    )


def plan_config(cfg: Config, machine, top: int, out: Path | None, check: bool = False) -> str:
    """`jaxpar plan` for a shipped model: every layout ranked, from shapes alone; the
    winner's config written to `out`; with `check`, the top ones validated."""
    import yaml

    from jaxpar import planner
    from jaxpar.errors import ConfigError
    from jaxpar.metrics import human_bytes

    plan = planner.make_plan(cfg, abstract(cfg), machine)
    if not plan.considered:
        counts = [
            n
            for n in range(1, 2 * machine.devices + 1)
            if any(planner.candidates(cfg, dataclasses.replace(machine, devices=n, hosts=1)))
        ]
        raise ConfigError(
            f"--devices {machine.devices}: no layout splits this model and batch over "
            f"{machine.devices} devices (the heads, mlp, vocab, layers and "
            f"train.batch_size must divide by the degrees); device counts that would, up "
            f"to {2 * machine.devices}: {counts}"
        )
    if not plan.ranked:
        c = plan.closest
        raise ConfigError(
            f"no layout of {plan.considered} fits in --device-memory "
            f"{human_bytes(machine.device_memory)}: the smallest, {c.label()}, needs "
            f"{human_bytes(c.device)} per device; give more devices or memory, a smaller "
            "train.batch_size, or a smaller model"
        )
    text = planner.report(plan, machine, top)
    if check:
        text += "\n" + validate(plan, machine, top)
    if out:
        winner = config_lib.to_dict(plan.ranked[0].cfg)
        out.write_text(f"# jaxpar train --config {out}\n" + yaml.safe_dump(winner, sort_keys=False))
        text += f"\nwritten: {out}"
    return text
