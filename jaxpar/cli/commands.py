"""What the `jaxpar` subcommands run, over one `setup(cfg, devices)`: a registered model
(`model.name`) as a Problem on the configured data and mesh. Trained, compiled for
inspection, or planned from its shapes."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.sharding import Mesh

from jaxpar.adapters import lora
from jaxpar.config import presets, registry
from jaxpar.config import sections as config_lib
from jaxpar.config.sections import AdapterKind, Config, Objective, Reference
from jaxpar.data import pairs, prompts
from jaxpar.data import tokens as data
from jaxpar.errors import ConfigError
from jaxpar.nn import staging
from jaxpar.nn.problem import Problem, registered
from jaxpar.objectives import dpo, grpo, precompute
from jaxpar.parallel import mesh_rules
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
    mesh_rules.check_train(cfg, mesh_shape)
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


def train_config(cfg: Config, out_dir: Path | None = None, **kwargs) -> Result | None:
    """Train the registered model as the config says (what `jaxpar train` runs), from
    model.init's checkpoint if it names one (its config.json already read into cfg).
    None, saying so at once, for a run already done (unless restarted)."""
    if not kwargs.get("restart") and (done := finished_at(cfg, out_dir)) is not None:
        print(finished(done, cfg.train.steps))
        return None
    s = setup(cfg)
    params = precompute.initial(cfg, trained_model(cfg))
    if params is not None and s.problem.reference:
        params = dpo.copies(params, [k.removeprefix(dpo.COPY) for k in s.problem.reference])
    grpo_run = cfg.train.objective is Objective.GRPO
    benchmarks = None
    if cfg.train.eval_tasks.strip():
        from jaxpar.evaluation.during_training import Benchmarks

        benchmarks = Benchmarks(cfg)
    return train(
        s.problem,
        cfg,
        s.batches,
        out_dir=out_dir,
        mesh=s.mesh,
        source=s.source,
        params=params,
        eval_batches=s.eval_batches,
        rollouts=s.batches if grpo_run else None,
        benchmarks=benchmarks,
        **kwargs,
    )


def inspect_config(cfg: Config, picture: Path) -> str:
    """A shipped model's step as the config says, compiled and not run (`jaxpar
    inspect`): the leaf table and the ledger's summary; the layout drawn to `picture`."""
    from jaxpar.cli import inspect
    from jaxpar.step.build import prepare
    from jaxpar.training import console

    s = setup(cfg)
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
            mesh_rules.check_train(cfg, c.mesh)
        except config_lib.ConfigError as e:
            rows.append([c.label(), f"not at {scale}'s dims: {e}"[:60], *["-"] * 6])
            continue
        shapes = registered(cfg.model, cfg.train.seq_len)
        p = c.mesh["pipeline"]
        staged = staging.in_stages(shapes, p)
        # compiled here: the attention CPU runs (its scores kept)
        work = planner.of_config(cfg, platform="cpu")
        guess = planner.predict(cfg, c.mesh, machine, staged, work)
        s = setup(cfg, jax.devices()[: math.prod(c.mesh.values())])
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

    problem = with_adapters(registered(cfg.model, cfg.train.seq_len), cfg)
    if cfg.train.objective is Objective.DPO:  # its reference held, or not
        problem = dpo.objective(problem, cfg)
    if cfg.train.objective is Objective.GRPO:
        problem = grpo.objective(problem, cfg)
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
