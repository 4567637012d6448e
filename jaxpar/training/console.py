"""What `jaxpar train` prints: the start-up summary and the closing table."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from jaxpar.adapters import lora
from jaxpar.config import registry
from jaxpar.config.sections import Adapter, AdapterKind, Data
from jaxpar.cost.report import Report, human_bytes, table
from jaxpar.cost.throughput import shown
from jaxpar.data.tokens import byte_level, tokenizer_of
from jaxpar.parallel.axes import EXPERT, REPLICA
from jaxpar.step import xla_flags
from jaxpar.training.metrics import model_reported


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}"


def count(n: int) -> str:
    """1536 -> '1,536'; 12_345_678 -> '12.3 M'."""
    for size, unit in ((1e9, "B"), (1e6, "M")):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:,}"


def _comm(report: Report, minimum: str) -> str:
    """'1.002 x the minimum (data + tensor)': the axes whose traffic the ratio is of."""
    comm = report.comm
    axes = [a for a in comm.ratio_axes if report.mesh[a] > 1] or comm.ratio_axes
    return f"{_ratio(comm.ratio)} x {minimum} ({' + '.join(axes)})"


def _mesh(mesh: dict) -> str:
    """The axes, `replica` and `expert` only where they are more than 1."""
    return " x ".join(f"{a}={n}" for a, n in mesh.items() if a not in (REPLICA, EXPERT) or n > 1)


LORA_NAMES = {"lora": "LoRA"}


def _trains(config: dict, params: int, trainable: int | None) -> list[str]:
    """The model line (its adapters and how its base is stored, for an adapter run) and
    what the run trains: its objective, its trainable parameters as PEFT counts them."""
    model, adapter, objective = config["model"], config["adapter"], config["train"]["objective"]
    adapted = ""
    if adapter["kind"] != "none":
        targets = adapter["targets"] or ",".join(lora.DEFAULT_TARGETS)  # PEFT's default
        adapted = (
            f"; {LORA_NAMES.get(adapter['kind'], adapter['kind'])} rank {adapter['rank']} on "
            f"{targets}, its base frozen ({adapter['base']})"
        )
    lines = [f"  model     {model['name']}, {count(params)} parameters{adapted}"]
    if trainable is not None:
        lines.append(
            f"  trains    train.objective={objective}; trainable params: {trainable:,} || all "
            f"params: {params:,} || trainable%: {100 * trainable / max(params, 1):.4f}"
        )
    return lines


def _spikes(train: dict) -> list[str]:
    """train.on_spike's line: what a spike is, and what is done with one."""
    if train["on_spike"] == "off":
        return []
    done = {"skip": "not applied", "rollback": "rolled back to the checkpoint before it"}
    return [
        f"  spikes    a loss over the mean + {train['spike_sigmas']:g} standard deviations of "
        f"the last {train['spike_window']} applied steps' losses: {done[train['on_spike']]}"
    ]


def _newton_schulz(report) -> list[str]:
    """Muon's line: Newton-Schulz's FLOPs a step and temporaries, per device, beside the
    model's FLOPs a step on a device, and its least bytes moved (its path's minimum)."""
    ns = report.newton_schulz
    if not ns:
        return []
    model, wire = ns["model_flops"], ns.get("wire_bytes")
    share = f" ({ns['flops'] / model:.1%} of the model's)" if model else ""
    moved = f", at least {human_bytes(wire)} moved a step" if wire else ""
    return [
        f"  {'':<9} Newton-Schulz: {ns['flops'] / 1e9:.3g} GFLOP a step per device{share}, "
        f"{human_bytes(ns['temp_bytes'])} of temporaries{moved}"
    ]


def startup(
    report: Report, params: int, platform: str, source: str, trainable: int | None = None
) -> str:
    mem, comm, host = report.memory_per_device, report.comm, report.host_memory_per_device
    devices = f"{report.devices} {platform} device{'s' if report.devices > 1 else ''}"
    lines = [
        f"jaxpar  {report.strategy}",
        f"  mesh      {_mesh(report.mesh)} ({devices})",
        *_trains(report.config, params, trainable),
        *(
            f"  {group:<9} {len(keys)} leaves{': ' * bool(keys)}{', '.join(keys)}"
            for group, keys in report.optimizer_groups.items()
        ),
        *_newton_schulz(report),
        *_spikes(report.config["train"]),
        f"  data      {source}",
        "  memory    per device: "
        + ", ".join(
            f"{k} {human_bytes(v)}"
            for k, v in (
                ("params", mem.params),
                *((("of them the frozen base", mem.base),) if mem.base else ()),
                *((("of them the reference", mem.reference),) if mem.reference else ()),
                ("grads", mem.grads),
                ("opt_state", mem.opt_state),
                ("temp", mem.temp),
            )
        ),
        f"  state     {report.state_bytes.ratio:.3f} x the ZeRO formula",
        f"  comm      {human_bytes(comm.wire_bytes_per_device)} per device per "
        f"step; {_comm(report, 'the textbook minimum')}",
        f"  compiled  in {report.compile_s:.1f} s",
    ]
    if report.xla_flags:
        lacks = ", ".join(sorted(xla_flags.unknown()))
        lines.append(
            f"  xla       {xla_flags.shown(report.xla_flags)} (XLA_FLAGS overrides)"
            + (f"; this XLA has no {lacks}" if lacks else "")
        )
    if any((host.params, host.opt_state, host.activations, host.temp)):
        lines.append(
            f"  host      per device: params {human_bytes(host.params)}, opt_state "
            f"{human_bytes(host.opt_state)}, activations {human_bytes(host.activations)}, "
            f"temp {human_bytes(host.temp)}"
        )
    if host.activations and not host.temp:
        lines.append(
            f"  note      {human_bytes(host.activations)} of layer inputs are sent "
            f"to host memory, but this backend's compiled step keeps them on the device "
            f"(host temp 0 B; XLA:CPU ignores in-step memory placement)"
        )
    check = report.replica_check
    if check:
        share = (
            ""
            if check.share_of_step_comm is None
            else (f", {check.share_of_step_comm:.2%} of the step's comm")
        )
        lines.append(
            f"  replicas  checked every {check.every} step{'s' if check.every > 1 else ''}: "
            f"{check.leaves} copied leaves "
            f"hashed, {human_bytes(check.wire_bytes_per_check)} per device per check in "
            f"{check.collectives_per_check} all-reduces{share}"
        )
    pipe = report.pipeline
    if pipe.schedule:
        lines.append(
            f"  stages    layers per device {pipe.stages}; {pipe.schedule}, "
            f"{pipe.ticks} ticks, bubble {_ratio(pipe.bubble)} "
            f"(formula {pipe.bubble_formula:.3f})"
        )
    lines += [f"  note      {why}" for why in report.tensor_replicated + report.model_notes]
    if report.zero_unsplit_leaves:
        first = report.zero_unsplit_leaves[0]
        lines.append(
            f"  note      ZeRO left {len(report.zero_unsplit_leaves)} small leaf(s) "
            f"replicated, e.g. {first['path']} {first['shape']}: {first['why']}; see summary.json"
        )
    return "\n".join(lines)


DROPPED = "moe/dropped"  # a mixture's share of expert choices dropped (jaxpar.report)
TOO_MANY_DROPPED = 0.10  # past this share of dropped choices, the closing lines warn


def _first_to_last(values: list[float]) -> str:
    """A metric over the rows that log it (a held-out one: the evaluations')."""
    return f"{values[0]:.3f} -> {values[-1]:.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def _loss(losses: list[float], rows, first: int) -> list[list[str]]:
    """The loss from the run's first step to its last; for a run resumed at step
    `first` (rows logged before it), the resumed part's too, each labelled."""
    mine = f"{losses[0]:.4f} -> {losses[-1]:.4f}"
    earlier = [r for r in rows if r["step"] < first and r.get("loss") is not None]
    if not earlier:
        return [["loss", mine]]
    last = first + len(losses) - 1
    return [
        ["loss", f"{earlier[0]['loss']:.4f} (step {earlier[0]['step']}) -> {losses[-1]:.4f} "
         f"(step {last})"],
        ["resumed part", f"{mine} (steps {first}-{last})"],
    ]  # fmt: skip


TOKENS_FED, EVAL_LOSS_OF = "tokens", "eval_loss/"  # metrics keys (jaxpar.data.feed)


def closing(report: Report, losses: list[float], rows: list[dict] = (), first: int = 1) -> str:
    """The closing table: the run's figures (`losses`: this call's, from step `first`),
    and what the model reported (a mixture's drops, ...) from the first logged step to
    the last; a warning under it when a mixture drops more than TOO_MANY_DROPPED of its
    tokens' expert choices."""
    mem = report.memory_per_device
    reported = list(dict.fromkeys(k for r in rows for k in model_reported(r) if r[k] is not None))
    figures = [
        *_loss(losses, rows, first),
        *([["held-out loss", f"{report.eval_loss:.4f}"]] if report.eval_loss is not None else []),
        *_fed(rows[-1] if rows else {}),
        ["step time", f"{report.step_time_s * 1e3:.1f} ms (median)"],
        [
            "tokens/s",
            f"{report.tokens_per_s:.0f} ({report.tokens_per_s_per_device:.0f} per device)",
        ],
        ["model FLOPs", shown(report.flops_per_s_per_device, report.mfu)],
        [
            "state / device",
            f"{human_bytes(mem.params + mem.opt_state)} ({report.state_bytes.ratio:.3f} x formula)",
        ],
        [
            "comm / device",
            f"{human_bytes(report.comm.wire_bytes_per_device)} ({_comm(report, 'minimum')})",
        ],
        *([k, _first_to_last([r[k] for r in rows if r.get(k) is not None])] for k in reported),
    ]
    lines = "\n" + table(figures, ["done", report.strategy])
    dropped = rows[-1].get(DROPPED) if rows else None
    if dropped is not None and dropped > TOO_MANY_DROPPED:
        factor = report.config.get("model", {}).get("capacity_factor")
        lines += (
            f"\nwarning: the mixture dropped {dropped:.0%} of its tokens' expert choices at "
            f"step {rows[-1]['step']} (model.capacity_factor={factor}): the router sends more "
            "tokens to some experts than they take. Raise model.capacity_factor (experts / "
            "model.experts_per_token drops none), or model.router_aux_loss to balance them"
        )
    return lines


def _fed(row: dict) -> list[list[str]]:
    """The data's figures in a metrics row: each source's held-out loss, the tokens fed,
    the epochs (jaxpar.data.feed's position)."""
    out = [
        [f"held-out loss {k.split('/', 1)[1]}", f"{v:.4f}"]
        for k, v in row.items()
        if k.startswith(EVAL_LOSS_OF)
    ]
    epochs = {k.split("/", 1)[-1]: v for k, v in row.items() if k.split("/")[0] == "epoch"}
    if TOKENS_FED in row:
        where = ", ".join(f"{n} {e:.3g}" for n, e in epochs.items())
        out.append(["data fed", f"{row[TOKENS_FED]:,} tokens; epochs: {where}"])
    return out


def next_steps(
    out: Path, model_name: str, adapter: Adapter, data: Data, decodes: bool = True
) -> list[str]:
    """The commands that take a finished run on, each as it runs when typed: its weights
    exported (and as a Hugging Face checkpoint, for a model that has the format; an
    adapter run's adapters as PEFT's), and, for a model that decodes (not a reward
    model: `decodes`), `jaxpar generate` and `jaxpar eval` with the tokenizer its data
    was made by."""
    spec, jaxpar = registry.get(model_name), typed()
    steps = [f"{jaxpar} export {out} --to {out / 'model.safetensors'}"]
    if spec.hf is not None:
        steps.append(f"{jaxpar} export {out} --to {out / 'hf'} --format hf")
    if adapter.kind is AdapterKind.LORA:
        steps.append(f"{jaxpar} export {out} --to {out / 'peft'} --format peft")
    if spec.cache_dims is not None and decodes:
        # generate finds the tokenizer the data was prepared with, or decodes bytes
        known = tokenizer_of(data) is not None
        given = "" if known or byte_level(data) else " --tokenizer TOKENIZER_DIR"
        steps.append(f'{jaxpar} generate {out}{given} --prompt "Hello"')
        if not byte_level(data):  # lm-eval's requests are text for a tokenizer
            given = "" if known else " --tokenizer TOKENIZER_DIR"
            steps.append(
                f"{jaxpar} eval {out}{given} --tasks jaxpar_arithmetic_mc jaxpar_arithmetic_gen"
            )
    return steps


def typed() -> str:
    """`jaxpar` as this shell runs this one: the bare name where PATH finds it, else its
    path (the venv's `.venv/bin/jaxpar`, as the README runs it, venv not activated)."""
    mine = Path(sys.executable).with_name("jaxpar")
    found = shutil.which("jaxpar")
    if not mine.exists() or (found and Path(found).absolute() == mine.absolute()):
        return "jaxpar"
    try:
        return str(mine.relative_to(Path.cwd()))
    except ValueError:
        return str(mine)
