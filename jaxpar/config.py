"""Frozen, keyword-only configuration: presets in YAML, dotted KEY=VALUE overrides.

Every option and its default is visible here. Unknown keys and wrong types raise
ConfigError, which the command line turns into exit status 2 and one message.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import re
import textwrap
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from jaxpar.axes import DATA, PIPE, TENSOR
from jaxpar.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Parallel:
    data: int = -1  # degree of the `data` axis; -1 = all devices left over
    pipeline: int = 1  # degree of the `pipeline` axis: stages of the layer stack
    tensor: int = 1  # degree of the `tensor` axis (Megatron column/row splits)
    zero: int = 0  # ZeRO stage over `data`: 0 none, 1 optimizer state, 2 +gradients, 3 +parameters
    microbatches: int = 1  # pipeline micro-batches each data shard's batch is split into
    schedule: str = "1f1b"  # pipeline schedule: gpipe | 1f1b | interleaved
    virtual_stages: int = 1  # chunks of layers per device (schedule=interleaved)
    # activation checkpointing of each layer: none | full (keep its input, recompute the
    # rest) | offload (full, with the kept inputs in host memory)
    remat: str = "none"
    dp_collective: str = "xla"  # how gradients are reduced over data: xla | ring | server
    bucket_mb: float = 25.0  # ring/server: fuse gradient leaves into buckets of this size
    # none | optimizer (Adam state + fp32 master weights on the host, update there) |
    # optimizer+params (ZeRO-3 only: also the stored parameter shards, fetched per layer)
    offload: str = "none"


@dataclass(frozen=True, kw_only=True)
class Model:
    name: str = "gpt"  # a model in models/: gpt | mlp
    layers: int = 4  # number of scanned blocks
    embed: int = 64  # width of the residual stream
    heads: int = 8  # attention heads (gpt)
    mlp: int = 256  # hidden width of the feed-forward layer
    vocab: int = 256  # output classes; byte-level text needs 256


@dataclass(frozen=True, kw_only=True)
class Train:
    steps: int = 10  # optimizer steps
    batch_size: int = 16  # global sequences per optimizer step (all shards, all micro-batches)
    seq_len: int = 64  # tokens per sequence
    lr: float = 3e-3  # peak learning rate of the warm-up + cosine schedule
    warmup: int = 2  # warm-up steps (linear from 0 to lr)
    weight_decay: float = 0.1  # AdamW decay, applied to matrices only
    seed: int = 0  # seeds parameters and data
    grad_accum: int = 1  # micro-batches accumulated per optimizer step
    precision: str = "fp32"  # fp32 | bf16 (bf16 compute; fp32 master parameters and Adam state)
    # the dtype gradients are summed over `data` in: fp32 | compute (train.precision's:
    # half the bytes in bf16, at bf16's rounding of each device's gradient and the sum)
    grad_reduce_dtype: str = "fp32"
    clip_norm: float = 1.0  # global gradient-norm clip; 0 disables it
    log_every: int = 1  # write a metrics row every N steps
    # a step whose loss or gradients are not finite: stop (save the last good state,
    # exit 3) | skip (leave the state as it was, count it in the metrics' `skipped`)
    on_nonfinite: str = "stop"


@dataclass(frozen=True, kw_only=True)
class Data:
    source: str = "corpus"  # corpus (embedded stdlib text) | file | synthetic
    path: str = ""  # text file for source=file


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    every: int = 0  # save every N steps (asynchronously), and at the end; 0 = off
    keep: int = 3  # how many of the newest checkpoints to keep
    dir: str = ""  # where; empty = <run directory>/checkpoints


@dataclass(frozen=True, kw_only=True)
class Distributed:
    timeout_s: float = 300.0  # how long processes wait for each other to arrive


@dataclass(frozen=True, kw_only=True)
class Config:
    parallel: Parallel = field(default_factory=Parallel)
    model: Model = field(default_factory=Model)
    train: Train = field(default_factory=Train)
    data: Data = field(default_factory=Data)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    distributed: Distributed = field(default_factory=Distributed)


CHOICES = {
    "parallel.zero": (0, 1, 2, 3),
    "parallel.remat": ("none", "full", "offload"),
    "parallel.schedule": ("gpipe", "1f1b", "interleaved"),
    "parallel.dp_collective": ("xla", "ring", "server"),
    "parallel.offload": ("none", "optimizer", "optimizer+params"),
    "model.name": ("gpt", "mlp"),
    "train.precision": ("fp32", "bf16"),
    "train.grad_reduce_dtype": ("fp32", "compute"),
    "data.source": ("corpus", "file", "synthetic"),
    "train.on_nonfinite": ("stop", "skip"),
}


@dataclass(frozen=True)
class Range:
    """The values a numeric key takes: low <= value <= high (low < value if open)."""

    low: float
    high: float
    why: str  # the reason for the bounds, shown when they are broken
    open_low: bool = False

    def admits(self, value) -> bool:
        return (value > self.low if self.open_low else value >= self.low) and value <= self.high

    def text(self) -> str:
        def num(x) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        return f"{'>' if self.open_low else '>='} {num(self.low)} and <= {num(self.high)}"


_DEVICES = Range(1, 65536, "a degree is a count of devices; -1 takes the rest")
_COUNT = Range(1, 10**9, "a count of steps")
# Every numeric key, with the range it enforces. Sizes are bounded so that no product of
# them overflows and no absurd model reaches the compiler; memory is checked separately.
RANGES = {
    "parallel.data": _DEVICES,
    "parallel.pipeline": _DEVICES,
    "parallel.tensor": _DEVICES,
    "parallel.microbatches": Range(1, 65536, "micro-batches per data shard"),
    "parallel.virtual_stages": Range(1, 1024, "layer chunks per pipeline device"),
    "parallel.bucket_mb": Range(0, 65536, "a gradient bucket in MiB, at most 64 GiB", True),
    "model.layers": Range(1, 10_000, "blocks in the stack"),
    "model.embed": Range(1, 2**20, "the residual width; the largest models use ~25k"),
    "model.heads": Range(1, 2**14, "attention heads"),
    "model.mlp": Range(1, 2**22, "the feed-forward width"),
    "model.vocab": Range(1, 2**24, "output classes"),
    "train.steps": _COUNT,
    "train.batch_size": Range(1, 2**24, "sequences per optimizer step"),
    "train.seq_len": Range(1, 2**20, "tokens per sequence"),
    "train.lr": Range(0, 10, "an AdamW learning rate; usual ones are 1e-5 to 1e-2", True),
    "train.warmup": Range(0, 10**9, "warm-up steps"),
    "train.weight_decay": Range(0, 10, "the AdamW decay per unit of learning rate"),
    "train.seed": Range(0, 2**32 - 1, "seeds are 32-bit unsigned integers"),
    "train.grad_accum": Range(1, 65536, "micro-batches accumulated per step"),
    "train.clip_norm": Range(0, 1e9, "a gradient norm; 0 disables clipping"),
    "train.log_every": _COUNT,
    "checkpoint.every": Range(0, 10**9, "steps between checkpoints; 0 = off"),
    "checkpoint.keep": Range(1, 10_000, "checkpoints kept"),
    "distributed.timeout_s": Range(0, 7 * 86400, "seconds, at most a week", True),
}
DEGREES = {"parallel.data", "parallel.pipeline", "parallel.tensor"}


def preset_names() -> list[str]:
    folder = resources.files("jaxpar") / "configs"
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _yaml(text: str, source: str):
    """YAML text -> Python values; a parse error is one line naming line and column."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or e
        if isinstance(e, yaml.reader.ReaderError):  # a character YAML does not allow
            where = f" at character {e.position}"
            problem = f"{e.reason} (#x{e.character:04x})"
        raise ConfigError(f"{source}: not valid YAML{where}: {_one_line(problem)}") from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise ConfigError(f"{source}: {_one_line(e)}") from None


def _read_preset(name_or_path: str) -> dict:
    path = Path(name_or_path)
    source = f"--config {name_or_path}"
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(
                f"{source}: no such file; give a YAML file or one of the presets {preset_names()}"
            )
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8")
        except OSError as e:
            raise ConfigError(f"{source}: cannot read it ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{source}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                "a config is a YAML file of sections, e.g. `train: {steps: 20}`"
            ) from None
    else:
        if name_or_path not in preset_names():
            raise ConfigError(
                f"{source}: no such preset; choose one of {preset_names()} or give a path "
                "to a YAML file"
            )
        text = (resources.files("jaxpar") / "configs" / f"{name_or_path}.yaml").read_text()
    tree = _yaml(text, source) or {}
    if not isinstance(tree, dict):
        raise ConfigError(
            f"{source}: expected a mapping of sections (parallel, model, train, ...), got "
            f"{_shown(tree)}"
        )
    return tree


_NUMBER = re.compile(r"[+-]?(\d[\d_]*\.?\d*|\.\d+)([eE][+-]?\d+)?")
_NOT_FINITE = re.compile(r"[+-]?\.?(nan|inf|infinity)", re.IGNORECASE)


def _shown(value) -> str:
    """A value for a message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:16]}... ({len(str(value))} characters)"


def _number(key: str, text: str, kind):
    """A number as people write it (YAML 1.1 leaves 1e-3, 3E-4 as strings)."""
    digits = text.strip().replace("_", "")
    if kind is int and digits.lstrip("+-").isdigit():
        if len(digits) > 30:
            raise ConfigError(f"{key}={_shown(text)}: out of range; {_range_text(key)}")
        return int(digits)
    number = float(digits)
    if not math.isfinite(number):
        raise ConfigError(f"{key}={_shown(text)}: out of range; {_range_text(key)}")
    return int(number) if kind is int and number.is_integer() else number


def _range_text(key: str) -> str:
    r = RANGES[key]
    extra = " (or -1)" if key in DEGREES else ""
    return f"it must be {r.text()}{extra} ({r.why})"


def _coerce(key: str, value, kind):
    if kind in (int, float) and isinstance(value, str):
        if _NOT_FINITE.fullmatch(value.strip()):
            raise ConfigError(f"{key}={value}: not a finite number; {_range_text(key)}")
        if _NUMBER.fullmatch(value.strip()):
            value = _number(key, value, kind)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is str and isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if type(value) is not kind:
        if isinstance(value, dict):
            raise ConfigError(f"{key}: is a key, not a section; write {key}=VALUE")
        if key in CHOICES:
            raise ConfigError(f"{key}={_shown(value)}: choose one of {list(CHOICES[key])}")
        raise ConfigError(
            f"{key}={_shown(value)}: expected {kind.__name__}, got {type(value).__name__}"
        )
    if key in CHOICES:
        if value not in CHOICES[key]:
            raise ConfigError(f"{key}={_shown(value)}: choose one of {list(CHOICES[key])}")
    elif kind in (int, float):
        if kind is float and not math.isfinite(value):
            raise ConfigError(f"{key}={value}: not a finite number; {_range_text(key)}")
        if not (RANGES[key].admits(value) or (key in DEGREES and value == -1)):
            shown = f"{value:.4g}" if isinstance(value, float) else _shown(value)
            raise ConfigError(f"{key}={shown}: out of range; {_range_text(key)}")
    return value


def _section(cls, key: str, values: dict):
    if not isinstance(values, dict):
        raise ConfigError(f"{key or 'config'}: expected a mapping of keys, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        full = f"{key}.{name}" if key else str(name)
        if name not in fields:
            what = "key" if key else "section"
            close = difflib.get_close_matches(str(name), fields, n=1)
            hint = (
                f"did you mean {key + '.' if key else ''}{close[0]}?"
                if close
                else f"the {what}s are {', '.join(sorted(fields))}"
            )
            raise ConfigError(f"{_shown(full)[1:-1]}: unknown {what}; {hint}")
        kind = hints[name]
        kwargs[name] = (
            _section(kind, full, value)
            if dataclasses.is_dataclass(kind)
            else _coerce(full, value, kind)
        )
    return cls(**kwargs)


def _set_dotted(tree: dict, key: str, value) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: {part} is not a section")
    node[leaf] = value


def parse_overrides(items: list[str]) -> dict:
    tree: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key or not all(key.split(".")):
            raise ConfigError(
                f"{_shown(item)}: overrides are SECTION.KEY=VALUE, e.g. parallel.tensor=2"
                + (f"; the key {key!r} has an empty part" if sep and "." in key else "")
            )
        try:
            value = yaml.safe_load(raw) if raw else ""
        except (yaml.YAMLError, ValueError):  # not YAML, or an integer of 4300+ digits
            value = raw
        _set_dotted(tree, key, value)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load(name_or_path: str = "default", overrides: list[str] = ()) -> Config:
    """The resolved config: the preset, then each KEY=VALUE override on top."""
    tree = _merge(_read_preset(name_or_path), parse_overrides(list(overrides)))
    return _section(Config, "", tree)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


@dataclass(frozen=True)
class BatchSplit:
    """How one optimizer step's global batch is cut (rows = sequences or examples)."""

    shard: int  # rows each data shard gets
    accum: int  # rows of one accumulation micro-batch on a shard
    micro: int  # rows of one pipeline micro-batch


def batch_split(train: Train, parallel: Parallel, data: int) -> BatchSplit:
    """THE batch arithmetic: global batch -> data shards -> accumulation -> pipeline."""
    parts = data * train.grad_accum * parallel.microbatches
    if train.batch_size % parts:
        raise ConfigError(
            f"train.batch_size={train.batch_size} does not split into data({data}) * "
            f"train.grad_accum({train.grad_accum}) * parallel.microbatches"
            f"({parallel.microbatches}) = {parts} equal parts; use a multiple of {parts}"
        )
    shard = train.batch_size // data
    accum = shard // train.grad_accum
    return BatchSplit(shard=shard, accum=accum, micro=accum // parallel.microbatches)


def check_train(cfg: Config, mesh_shape: dict) -> None:
    """Batch arithmetic every run needs, whatever the model."""
    parallel = cfg.parallel
    batch_split(cfg.train, parallel, mesh_shape[DATA])
    if parallel.dp_collective == "server" and parallel.zero:
        raise ConfigError(
            f"parallel.dp_collective=server with parallel.zero={parallel.zero}: a gradient "
            "server sums everything on one device, which is what ZeRO avoids (it splits the "
            "optimizer state and the reduction over all devices); use parallel.zero=0 with "
            "server, or dp_collective=ring or xla with ZeRO"
        )
    if parallel.offload == "optimizer+params" and parallel.zero != 3:
        raise ConfigError(
            f"parallel.offload=optimizer+params with parallel.zero={parallel.zero}: only "
            "ZeRO-3 stores parameter shards that a layer can fetch when it runs; below "
            "stage 3 every device needs all parameters. Use parallel.zero=3, or "
            "parallel.offload=optimizer"
        )
    pipelined = mesh_shape[PIPE] > 1
    if pipelined and parallel.offload == "optimizer+params":
        raise ConfigError(
            f"parallel.offload=optimizer+params with parallel.pipeline={mesh_shape[PIPE]}: "
            "not supported; JAX refuses the gradient of host-resident stage parameters "
            "inside the pipeline loop (float32<host> expected, float32 got). Use "
            "parallel.offload=optimizer with a pipeline, or parallel.pipeline=1"
        )
    if parallel.microbatches > 1 and not pipelined:
        raise ConfigError(
            f"parallel.microbatches={parallel.microbatches} needs parallel.pipeline > 1; "
            "to accumulate gradients over micro-batches without a pipeline use train.grad_accum"
        )
    if pipelined and parallel.schedule == "1f1b" and parallel.remat == "offload":
        raise ConfigError(
            "parallel.remat=offload with parallel.schedule=1f1b: 1F1B already keeps only "
            "each stage's input per micro-batch and recomputes the layers in the backward "
            "pass, so there are no saved layer inputs to send to the host; use "
            "schedule=gpipe or interleaved with remat=offload, or remat=none with 1f1b"
        )
    interleaved = parallel.schedule == "interleaved"
    if (parallel.virtual_stages > 1 or interleaved) and not pipelined:
        raise ConfigError(
            f"parallel.schedule={parallel.schedule} with parallel.virtual_stages="
            f"{parallel.virtual_stages} needs parallel.pipeline > 1 (it is "
            f"{mesh_shape[PIPE]}): virtual stages are chunks of a pipeline's layers; set "
            "parallel.pipeline, or drop the schedule and virtual stages"
        )
    if (parallel.virtual_stages > 1) != interleaved and pipelined:
        raise ConfigError(
            f"parallel.schedule={parallel.schedule} with parallel.virtual_stages="
            f"{parallel.virtual_stages}: virtual stages (2 or more) go with "
            "schedule=interleaved, and only with it"
        )
    p, m = mesh_shape[PIPE], parallel.microbatches
    if pipelined and interleaved and m % p:
        raise ConfigError(
            f"parallel.microbatches={m} is not a multiple of parallel.pipeline={p}: the "
            "interleaved schedule sends micro-batches round the stages in groups of "
            f"{p}; use {p * max(1, m // p)} or {p * (m // p + 1)}"
        )


def check_model(model: Model, mesh_shape: dict) -> None:
    """The shipped models' dims against the tensor degree (named by key, before any leaf)."""
    tensor = mesh_shape[TENSOR]
    if model.name == "gpt" and model.embed % model.heads:
        raise ConfigError(
            f"model.embed={model.embed} is not divisible by model.heads="
            f"{model.heads}; each head needs embed/heads dims"
        )
    dims = {"model.mlp": model.mlp, "model.vocab": model.vocab}
    if model.name == "gpt":
        dims["model.heads"] = model.heads
    for key, size in dims.items():
        if size % tensor:
            raise ConfigError(
                f"{key}={size} is not divisible by parallel.tensor={tensor}; "
                f"Megatron splits it over tensor: choose a tensor degree "
                f"dividing {size}, or change {key}"
            )


def _field_comments(cls) -> dict[str, str]:
    """Each field's comment in this file (the one place its meaning is written): the
    comment after it on its line, or the comment lines just above it."""
    comments, above = {}, []
    for line in inspect.getsource(cls).splitlines()[1:]:
        code, _, comment = line.strip().partition("#")
        name = code.split(":")[0].strip()
        if not code:
            above.append(comment.strip())
        elif name.isidentifier():
            comments[name] = " ".join(filter(None, [*above, comment.strip()]))
            above = []
    return comments


def keys_help() -> str:
    """Every config key with its default and meaning (for `jaxpar train --help`)."""
    lines = []
    for section, cls in typing.get_type_hints(Config).items():
        comments = _field_comments(cls)
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}={getattr(cls(), f.name)}"
            lines += textwrap.wrap(
                comments[f.name],
                width=100,
                initial_indent=f"  {key:<28} ",
                subsequent_indent=" " * 31,
            )
    return "\n".join(lines)
