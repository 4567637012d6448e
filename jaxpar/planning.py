"""`jaxpar plan`: every layout of a registered model on a machine, ranked from shapes
alone (jaxpar.cost.planner); the winner's config written out; with --validate, the top
ones that fit this host compiled (not run) at the model's tiny dims, predicted against
compiled."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import yaml

from jaxpar import objectives, recipe
from jaxpar.compiled.run import prepare
from jaxpar.config import presets, registry
from jaxpar.config.sections import Config, given
from jaxpar.cost import planner
from jaxpar.cost.report import human_bytes, table
from jaxpar.errors import ConfigError
from jaxpar.nn import staging
from jaxpar.nn.problem import registered
from jaxpar.parallel import layout_checks
from jaxpar.training.console import count


def validate(plan, machine, top: int, scale: str) -> str:
    """`jaxpar plan --validate`: the top layouts that fit on this host's devices, with the
    model and batch scaled down to `scale`'s, predicted and compiled (not run)."""
    small = presets.load(scale)
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
            registry.check_model(cfg.model, c.mesh)
            given(layout_checks.check, cfg, c.mesh)
        except ConfigError as e:
            rows.append([c.label(), f"not at {scale}'s dims: {e}"[:60], *["-"] * 6])
            continue
        shapes = registered(cfg.model, cfg.train.seq_len)
        p = c.mesh["pipeline"]
        staged = staging.in_stages(shapes, p)
        # compiled here: the attention CPU runs (its scores kept)
        work = planner.of_config(cfg, platform="cpu")
        guess = planner.predict(cfg, c.mesh, machine, staged, work)
        s = recipe.setup(cfg, jax.devices()[: math.prod(c.mesh.values())])
        report = prepare(cfg, s.problem, s.mesh, s.batches(0), force=True).report
        axes = ["data"] if p > 1 else ["replica", "data", "tensor"]
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
    """`jaxpar plan` for a registered model: every layout ranked, from shapes alone; the
    winner's config written to `out`; with `check`, the top ones validated."""
    model = registered(cfg.model, cfg.train.seq_len)
    problem = recipe.with_adapters(model, cfg.adapter, cfg.model)
    objective = objectives.of(cfg.train.objective)
    problem = given(objective.problem, cfg, problem)  # a reference held, or not
    work = planner.of_config(cfg)
    plan = planner.make_plan(cfg, problem, machine, work)
    if not plan.considered:
        staged = problem.parts is not None
        counts = [
            n
            for n in range(1, 2 * machine.devices + 1)
            if any(
                planner.candidates(
                    cfg, dataclasses.replace(machine, devices=n, hosts=1), work, staged
                )
            )
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
            f"{human_bytes(machine.device_memory)} and --host-memory "
            f"{human_bytes(machine.host_memory)}: the nearest, {c.label()}, needs "
            f"{human_bytes(c.device)} per device and {human_bytes(c.host)} per host; give "
            "more devices or memory, a smaller train.batch_size, or a smaller model"
        )
    size = sum(math.prod(s.shape) for s in model.shapes.values())
    line = f"model.name={cfg.model.name}: {size:,} parameters ({count(size)})\n\n"
    text = line + planner.report(plan, top)
    if check:
        scale = registry.tiny_preset(cfg.model.name)
        if scale is None:
            raise ConfigError(
                f"--validate: model.name={cfg.model.name} declares no tiny preset to compile "
                "its layouts at (ModelSpec.tiny)"
            )
        text += "\n" + validate(plan, machine, top, scale)
    if out:
        winner = presets.to_dict(plan.ranked[0].cfg)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"# jaxpar train --config {out}\n" + yaml.safe_dump(winner, sort_keys=False))
        text += f"\nwritten: {out}"
    return text
