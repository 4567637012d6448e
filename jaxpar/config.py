"""Frozen, keyword-only configuration: presets in YAML, dotted KEY=VALUE overrides.

Every option and its default is visible here. Unknown keys and wrong types raise
ConfigError, which the command line turns into exit status 2 and one message.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from jaxpar.errors import ConfigError
from jaxpar.mesh import DATA, PIPE, TENSOR


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
    "data.source": ("corpus", "file", "synthetic"),
    "train.on_nonfinite": ("stop", "skip"),
}
# Keys that may be 0 (the rest of the numbers must be positive, degrees may also be -1).
MAY_BE_ZERO = {
    "parallel.zero",
    "train.weight_decay",
    "train.clip_norm",
    "train.seed",
    "train.warmup",
    "checkpoint.every",
}
DEGREES = {"parallel.data", "parallel.pipeline", "parallel.tensor"}


def preset_names() -> list[str]:
    folder = resources.files("jaxpar") / "configs"
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


def _read_preset(name_or_path: str) -> dict:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(
                f"--config {name_or_path}: no such file; give a YAML file or one "
                f"of the presets {preset_names()}"
            )
        text = path.read_text()
    else:
        if name_or_path not in preset_names():
            raise ConfigError(
                f"--config {name_or_path}: no such preset; choose one of "
                f"{preset_names()} or give a path to a YAML file"
            )
        text = (resources.files("jaxpar") / "configs" / f"{name_or_path}.yaml").read_text()
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {name_or_path}: not valid YAML ({e})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"--config {name_or_path}: expected a mapping of sections, got {tree!r}")
    return tree


_NUMBER = re.compile(r"[+-]?(\d[\d_]*\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _coerce(key: str, value, kind):
    if kind in (int, float) and isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        # numbers as people write them, which YAML 1.1 leaves as strings: 1e-3, 3E-4, 1_000
        number = float(value.strip().replace("_", ""))
        value = int(number) if kind is int and number.is_integer() else number
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is str and isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if type(value) is not kind:
        raise ConfigError(f"{key}={value!r}: expected {kind.__name__}, got {type(value).__name__}")
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"{key}={value!r}: choose one of {list(CHOICES[key])}")
    if kind in (int, float) and key not in CHOICES:
        low_ok = -1 if key in DEGREES else 0
        if (
            value < low_ok
            or (value == 0 and key not in MAY_BE_ZERO)
            or (key in DEGREES and value == 0)
        ):
            allowed = (
                "-1 (the rest) or a positive degree"
                if key in DEGREES
                else ("0 or more" if key in MAY_BE_ZERO else "a positive number")
            )
            raise ConfigError(f"{key}={value}: must be {allowed}")
    return value


def _section(cls, key: str, values: dict):
    if not isinstance(values, dict):
        raise ConfigError(f"{key or 'config'}: expected a mapping of keys, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        full = f"{key}.{name}" if key else name
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f"; did you mean {key}.{close[0]}?" if close else f"; known: {sorted(fields)}"
            raise ConfigError(f"{full}: unknown key{hint}")
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
        if not sep or not key or "." not in key:
            raise ConfigError(
                f"{item!r}: overrides are KEY=VALUE with a dotted key, e.g. parallel.tensor=2"
            )
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
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
