"""What the `jaxpar` subcommands run, over one `jaxpar.recipe.setup(cfg, devices)`: a
registered model (`model.name`) as a Problem on the configured data and mesh. Trained,
compiled for inspection, or planned from its shapes."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax

from jaxpar import moved, objectives, recipe
from jaxpar.config import presets, registry
from jaxpar.config import sections as config_lib
from jaxpar.config.sections import AdapterKind, Config
from jaxpar.data import tokens as data
from jaxpar.nn import staging
from jaxpar.nn.problem import registered
from jaxpar.parallel import layout_checks
from jaxpar.training.trainer import Result, finished, finished_at, train


def __getattr__(name: str):  # setup and its helpers moved to jaxpar.recipe
    return moved.attribute(__name__, name)


def train_config(cfg: Config, out_dir: Path | None = None, **kwargs) -> Result | None:
    """Train the registered model as the config says (what `jaxpar train` runs), from
    model.init's checkpoint if it names one (its config.json already read into cfg).
    None, saying so at once, for a run already done (unless restarted)."""
    if not kwargs.get("restart") and (done := finished_at(cfg, out_dir)) is not None:
        print(finished(done, cfg.train.steps))
        return None
    s = recipe.setup(cfg)
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
        params=recipe.initial_params(cfg, s.problem),
        eval_batches=s.eval_batches,
        hooks=hooks,
        **kwargs,
    )


def inspect_config(cfg: Config, picture: Path) -> str:
    """A shipped model's step as the config says, compiled and not run (`jaxpar
    inspect`): the leaf table and the ledger's summary; the layout drawn to `picture`."""
    from jaxpar.cli import inspect
    from jaxpar.step.build import prepare
    from jaxpar.training import console

    s = recipe.setup(cfg)
    run = prepare(cfg, s.problem, s.mesh, s.batches(0), force=True)
    rows = inspect.leaves(run)
    picture.parent.mkdir(parents=True, exist_ok=True)
    inspect.draw(run, rows, picture)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(s.problem.shapes))
    return "\n".join(
        [
            inspect.leaf_table(rows),
            "",
            console.startup(run.report, n_params, s.mesh.devices.flat[0].platform, s.source),
            f"\nlayout picture: {picture}",
        ]
    )


def validate(plan, machine, top: int, scale: str) -> str:
    """`jaxpar plan --validate`: the top layouts that fit on this host's devices, with the
    model and batch scaled down to `scale`'s, predicted and compiled (not run)."""
    from jaxpar.cost import planner
    from jaxpar.cost.report import human_bytes, table
    from jaxpar.step.build import prepare

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
            layout_checks.check_train(cfg, c.mesh)
        except config_lib.ConfigError as e:
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
    import yaml

    from jaxpar.cost import planner
    from jaxpar.cost.report import human_bytes
    from jaxpar.errors import ConfigError

    problem = recipe.with_adapters(registered(cfg.model, cfg.train.seq_len), cfg)
    problem = objectives.of(cfg).problem(problem, cfg)  # a reference held, or not
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
            f"{human_bytes(machine.device_memory)}: the smallest, {c.label()}, needs "
            f"{human_bytes(c.device)} per device; give more devices or memory, a smaller "
            "train.batch_size, or a smaller model"
        )
    text = planner.report(plan, top)
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


def next_steps(cfg: Config, out: Path) -> list[str]:
    """The commands that take a finished run on, each as it runs when typed: its weights
    exported (and as a Hugging Face checkpoint, for a model that has the format; an
    adapter run's adapters as PEFT's), and,
    for a model that decodes, `jaxpar generate` and `jaxpar eval` with the tokenizer its
    data was made by."""
    spec = registry.get(cfg.model.name)
    steps = [f"jaxpar export {out} --to {out / 'model.safetensors'}"]
    if spec.hf is not None:
        steps.append(f"jaxpar export {out} --to {out / 'hf'} --format hf")
    if cfg.adapter.kind is AdapterKind.LORA:
        steps.append(f"jaxpar export {out} --to {out / 'peft'} --format peft")
    if spec.cache_dims is not None:
        tokenizer = data.tokenizer_of(cfg.data) or "TOKENIZER_DIR"
        steps.append(f'jaxpar generate {out} --tokenizer {tokenizer} --prompt "Hello"')
        given = "" if data.tokenizer_of(cfg.data) else f" --tokenizer {tokenizer}"
        steps.append(f"jaxpar eval {out}{given} --tasks jaxpar_arithmetic_mc jaxpar_arithmetic_gen")
    return steps
