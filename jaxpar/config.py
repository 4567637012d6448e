"""Frozen, keyword-only configuration: presets in YAML, dotted KEY=VALUE overrides.

Every option is declared once, on its field: its type (a number, a choice as an enum
or a Literal), its range (`Annotated[..., Range(...)]`), its default and, in the comment
beside it, its meaning. Each object checks its own fields when it is constructed, in
Python as from YAML or the command line, and raises ConfigError with one line naming
the key, the value and the fix; the loader, `--help` and the generated bad-input tests
read the same declarations (`keys()`). Checks across fields and against the mesh
(`check_train`) run before a step is compiled.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import inspect
import math
import re
import textwrap
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import yaml

from jaxpar.axes import DATA, PIPE, REPLICA, data_parallel
from jaxpar.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """The values a numeric key takes: low <= value <= high (low < value if open)."""

    low: float
    high: float
    why: str  # the reason for the bounds, shown when they are broken
    open_low: bool = False
    rest: bool = False  # -1 is allowed too: "all devices left over"

    def admits(self, value) -> bool:
        if self.rest and value == -1:
            return True
        return (value > self.low if self.open_low else value >= self.low) and value <= self.high

    def text(self) -> str:
        def num(x) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        low = f"{'>' if self.open_low else '>='} {num(self.low)} and <= {num(self.high)}"
        return f"it must be {low}{' (or -1)' if self.rest else ''} ({self.why})"


class Schedule(enum.StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


class Remat(enum.StrEnum):
    NONE = "none"
    FULL = "full"
    OFFLOAD = "offload"


class DpCollective(enum.StrEnum):
    XLA = "xla"
    RING = "ring"
    SERVER = "server"


class DpSync(enum.StrEnum):
    GRADS = "grads"
    PARAMS = "params"


class Offload(enum.StrEnum):
    NONE = "none"
    OPTIMIZER = "optimizer"
    OPTIMIZER_PARAMS = "optimizer+params"


class Precision(enum.StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"


class ReduceDtype(enum.StrEnum):
    FP32 = "fp32"
    COMPUTE = "compute"


class Source(enum.StrEnum):
    CORPUS = "corpus"
    FILE = "file"
    SYNTHETIC = "synthetic"
    TOKENS = "tokens"


class TokenDtype(enum.StrEnum):
    UINT16 = "uint16"
    UINT32 = "uint32"


class Optimizer(enum.StrEnum):
    ADAMW = "adamw"
    SGD = "sgd"


class OnNonfinite(enum.StrEnum):
    STOP = "stop"
    SKIP = "skip"


Degree = Annotated[
    int, Range(1, 65536, "a degree is a count of devices; -1 takes the rest", rest=True)
]
Steps = Annotated[int, Range(1, 10**9, "a count of steps")]


class _Section:
    """Checks and normalises every field on construction (the declarations' one reader)."""

    SECTION: ClassVar[str]

    def __post_init__(self):
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            checked = check_value(f"{self.SECTION}.{f.name}", value, hints[f.name])
            if checked is not value:
                object.__setattr__(self, f.name, checked)


@functools.cache
def _hints(cls) -> dict:
    """A section's declarations (read once per class: configs are built by the thousand
    when the planner enumerates layouts)."""
    return typing.get_type_hints(cls, include_extras=True)


@dataclass(frozen=True, kw_only=True)
class Parallel(_Section):
    SECTION: ClassVar[str] = "parallel"
    # degree of the `replica` axis (outermost: across hosts): copies of a ZeRO group;
    # data parallelism is replica x data, ZeRO splits state over `data` only
    replica: Degree = 1
    data: Degree = -1  # degree of the `data` axis; -1 = all devices left over
    pipeline: Degree = 1  # degree of the `pipeline` axis: stages of the layer stack
    tensor: Degree = 1  # degree of the `tensor` axis (Megatron column/row splits)
    # ZeRO stage over `data`: 0 none, 1 optimizer state, 2 +gradients, 3 +parameters
    zero: Literal[0, 1, 2, 3] = 0
    # pipeline micro-batches each data shard's batch is split into
    microbatches: Annotated[int, Range(1, 65536, "micro-batches per data shard")] = 1
    schedule: Schedule = Schedule.ONE_F_ONE_B  # pipeline schedule: gpipe | 1f1b | interleaved
    # chunks of layers per device (schedule=interleaved)
    virtual_stages: Annotated[int, Range(1, 1024, "layer chunks per pipeline device")] = 1
    # activation checkpointing of each layer: none | full (keep its input, recompute the
    # rest) | offload (full, with the kept inputs in host memory)
    remat: Remat = Remat.NONE
    # how gradients are reduced over data: xla | ring | server
    dp_collective: DpCollective = DpCollective.XLA
    # ring/server: fuse gradient leaves into buckets of this size
    bucket_mb: Annotated[float, Range(0, 65536, "a bucket in MiB, at most 64 GiB", True)] = 25.0
    # none | optimizer (Adam state + fp32 master weights on the host, update there) |
    # optimizer+params (ZeRO-3 only: also the stored parameter shards, fetched per layer)
    offload: Offload = Offload.NONE
    # what data parallelism keeps in sync: grads (all-reduced every step) | params (each
    # device takes sync_every local AdamW steps on its own rows, then the parameters
    # are averaged over data: local SGD; with an outer optimizer, DiLoCo)
    dp_sync: DpSync = DpSync.GRADS
    # dp_sync=params: local steps between averages (MaxText's DiLoCo uses 36)
    sync_every: Annotated[int, Range(1, 10**6, "local steps between averages")] = 8
    # dp_sync=params: the outer (Nesterov SGD) learning rate on the averaged change of
    # the parameters; 1 with no momentum is plain averaging (DiLoCo: 0.7, MaxText 0.3)
    outer_lr: Annotated[float, Range(0, 10, "an outer rate; 1 = plain averaging", True)] = 1.0
    # dp_sync=params: the outer Nesterov momentum; 0 = none (DiLoCo and MaxText: 0.9)
    outer_momentum: Annotated[float, Range(0, 0.999, "a momentum below 1")] = 0.0


@dataclass(frozen=True, kw_only=True)
class Model(_Section):
    """The shipped models' dims; a model with keys of its own declares a subclass and
    names it in its registry entry (jaxpar.registry)."""

    SECTION: ClassVar[str] = "model"
    # a registered model (jaxpar.registry): gpt | mlp | one of yours
    name: str = field(default_factory=lambda: _registry().default_name())
    # number of scanned blocks
    layers: Annotated[int, Range(1, 10_000, "blocks in the stack")] = 4
    # width of the residual stream
    embed: Annotated[int, Range(1, 2**20, "the residual width; the largest models use ~25k")] = 64
    heads: Annotated[int, Range(1, 2**14, "attention heads")] = 8  # attention heads (gpt)
    # hidden width of the feed-forward layer
    mlp: Annotated[int, Range(1, 2**22, "the feed-forward width")] = 256
    # output classes; byte-level text needs 256
    vocab: Annotated[int, Range(1, 2**24, "output classes")] = 256
    # where the parameters start: empty = random (train.seed); hf:DIR = a Hugging Face
    # checkpoint directory (config.json, *.safetensors), its config.json read into model.*
    init: str = ""

    def __post_init__(self):
        registry = _registry()
        if self.name not in registry.names():
            raise ConfigError(
                f"model.name={_shown(self.name)}: no such model; choose one of "
                f"{registry.names()}{_near(self.name, registry.names())}, or register yours "
                "(jaxpar.register_model)"
            )
        wanted = registry.config_class(self.name)
        if not isinstance(self, wanted):
            raise ConfigError(
                f"model.name={self.name}: its keys are declared by {wanted.__qualname__}; "
                f"build the model section as {wanted.__qualname__}(...), not "
                f"{type(self).__qualname__}(...)"
            )
        super().__post_init__()


@dataclass(frozen=True, kw_only=True)
class Train(_Section):
    SECTION: ClassVar[str] = "train"
    steps: Steps = 10  # optimizer steps
    # global sequences per optimizer step (all shards, all micro-batches)
    batch_size: Annotated[int, Range(1, 2**24, "sequences per optimizer step")] = 16
    seq_len: Annotated[int, Range(1, 2**20, "tokens per sequence")] = 64  # tokens per sequence
    # adamw (b1 0.9, b2 0.95) | sgd (plain, no momentum); both decay matrices only
    optimizer: Optimizer = Optimizer.ADAMW
    # peak learning rate of the warm-up + cosine schedule
    lr: Annotated[float, Range(0, 10, "usual AdamW rates are 1e-5 to 1e-2", True)] = 3e-3
    # warm-up steps (linear from 0 to lr)
    warmup: Annotated[int, Range(0, 10**9, "warm-up steps")] = 2
    # AdamW decay, applied to matrices only
    weight_decay: Annotated[float, Range(0, 10, "the AdamW decay per unit of learning rate")] = 0.1
    # seeds parameters and data
    seed: Annotated[int, Range(0, 2**32 - 1, "seeds are 32-bit unsigned integers")] = 0
    # micro-batches accumulated per optimizer step
    grad_accum: Annotated[int, Range(1, 65536, "micro-batches accumulated per step")] = 1
    # fp32 | bf16 (bf16 compute; fp32 master parameters and Adam state)
    precision: Precision = Precision.FP32
    # the dtype gradients are summed over `data` in: fp32 | compute (train.precision's:
    # half the bytes in bf16, at bf16's rounding of each device's gradient and the sum)
    grad_reduce_dtype: ReduceDtype = ReduceDtype.FP32
    # global gradient-norm clip; 0 disables it
    clip_norm: Annotated[float, Range(0, 1e9, "a gradient norm; 0 disables clipping")] = 1.0
    log_every: Steps = 1  # write a metrics row every N steps
    # every N steps, the mean loss over eval_batches held-out batches (never trained on:
    # the corpus's or a text file's last tenth, a prepared folder's val.bin); 0 = never
    eval_every: Annotated[int, Range(0, 10**9, "steps between evaluations; 0 = off")] = 0
    # batches of train.batch_size rows in each evaluation
    eval_batches: Annotated[int, Range(1, 10**6, "held-out batches per evaluation")] = 4
    # a step whose loss or gradients are not finite: stop (save the last good state,
    # exit 3) | skip (leave the state as it was, count it in the metrics' `skipped`)
    on_nonfinite: OnNonfinite = OnNonfinite.STOP
    # every N steps, check that every copy of each parameter leaf (over replica and
    # data, and tensor/pipeline where not split) is bit-identical; on a difference save
    # and stop (exit 3), naming the leaf and the devices. 0 = never
    check_replicas_every: Annotated[int, Range(0, 10**9, "steps between checks; 0 = off")] = 0
    # layers per iteration of the layer scan (lax.scan's unroll): fewer, longer loop
    # iterations, at a compile time that grows with it (README, "Speed against PyTorch")
    unroll: Annotated[int, Range(1, 10_000, "layers per iteration of the layer scan")] = 1
    # A:B = profile steps A to B (1-based, both included) with jax.profiler into
    # <run directory>/profile, for TensorBoard or Perfetto; empty = never
    profile_steps: str = ""

    def __post_init__(self):
        super().__post_init__()
        profile_range(self)


@dataclass(frozen=True, kw_only=True)
class Data(_Section):
    SECTION: ClassVar[str] = "data"
    # corpus (embedded stdlib text) | file (a text file, as bytes) | synthetic | tokens
    # (token ids on disk, memory-mapped: a `jaxpar prepare-data` folder, a flat binary
    # file or a .npy)
    source: Source = Source.CORPUS
    path: str = ""  # the text file (source=file) or the tokens (source=tokens)
    # source=tokens, a flat binary file: the dtype of its ids (nanoGPT writes uint16)
    dtype: TokenDtype = TokenDtype.UINT16


@dataclass(frozen=True, kw_only=True)
class Checkpoint(_Section):
    SECTION: ClassVar[str] = "checkpoint"
    # save every N steps (asynchronously); 0 = only at the end (checkpoint.final)
    every: Annotated[int, Range(0, 10**9, "steps between checkpoints; 0 = at the end only")] = 0
    # save the final state when a run ends (its last step, or a stop), so that it can be
    # exported or resumed; false keeps no weights unless checkpoint.every asks for them
    final: bool = True
    # how many of the newest checkpoints to keep
    keep: Annotated[int, Range(1, 10_000, "checkpoints kept")] = 3
    dir: str = ""  # where; empty = <run directory>/checkpoints


@dataclass(frozen=True, kw_only=True)
class Distributed(_Section):
    SECTION: ClassVar[str] = "distributed"
    # how long processes wait for each other to arrive
    timeout_s: Annotated[float, Range(0, 7 * 86400, "seconds, at most a week", True)] = 300.0


@dataclass(frozen=True, kw_only=True)
class Config:
    parallel: Parallel = field(default_factory=Parallel)
    model: Model = field(default_factory=Model)
    train: Train = field(default_factory=Train)
    data: Data = field(default_factory=Data)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    distributed: Distributed = field(default_factory=Distributed)

    def __post_init__(self):
        for section, cls in typing.get_type_hints(Config).items():
            if not isinstance(getattr(self, section), cls):
                raise ConfigError(
                    f"{section}: expected a jaxpar.{cls.__name__}(...), got "
                    f"{type(getattr(self, section)).__name__}"
                )


def _registry():
    """jaxpar.registry (imported late: it imports this module)."""
    from jaxpar import registry

    return registry


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@dataclass(frozen=True)
class Key:
    """One declared key: what its field says."""

    kind: type  # int | float | str | bool, or the enum of a choice
    choices: tuple | None  # the values a choice takes
    range: Range | None  # the range of a number
    default: object
    model: str | None = None  # the model.name whose own config class declares it


def _declaration(hint) -> Key:
    """A field's type hint -> (kind, choices, range)."""
    rng = None
    if typing.get_origin(hint) is Annotated:
        hint, *extras = typing.get_args(hint)
        rng = next(x for x in extras if isinstance(x, Range))
    if typing.get_origin(hint) is Literal:
        args = typing.get_args(hint)
        return Key(type(args[0]), args, None, None)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return Key(hint, tuple(m.value for m in hint), None, None)
    return Key(hint, None, rng, None)


def section_classes() -> dict[str, list[type]]:
    """Each section's classes: one, or for `model` the base and each model's own."""
    from jaxpar import registry

    out = {name: [cls] for name, cls in typing.get_type_hints(Config).items()}
    out["model"] += [c for c in registry.config_classes() if c is not Model]
    return out


def keys() -> dict[str, Key]:
    """Every declared key ('train.lr', ...) with its kind, choices, range and default."""
    out = {}
    for section, classes in section_classes().items():
        for cls in classes:
            hints = typing.get_type_hints(cls, include_extras=True)
            model = _default(dataclasses.fields(cls)[0]) if cls is not classes[0] else None
            for f in dataclasses.fields(cls):
                key = dataclasses.replace(
                    _declaration(hints[f.name]), default=_default(f), model=model
                )
                out.setdefault(f"{section}.{f.name}", key)
    return out


def _near(value, choices) -> str:
    """'; did you mean X?' for a near miss (case and small typos), else ''."""
    names = [str(c) for c in choices]
    lower = {n.lower(): n for n in names}
    close = [lower[str(value).lower()]] if str(value).lower() in lower else []
    close = close or difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def check_value(key: str, value, hint):
    """`value` for the field `key` declared as `hint`, normalised (numbers as people
    write them, a choice as its enum); else ConfigError naming key, value and fix."""
    decl = _declaration(hint)
    kind = decl.kind
    if isinstance(value, str) and kind in (int, float):
        if _NOT_FINITE.fullmatch(value.strip()):
            raise ConfigError(f"{key}={value}: not a finite number; {decl.range.text()}")
        if _NUMBER.fullmatch(value.strip()):
            value = _number(key, value, kind, decl)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is str and isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if decl.choices is not None:
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            if isinstance(value, str) and value in decl.choices:
                return value if type(value) is kind else kind(value)
        elif type(value) is kind and value in decl.choices:
            return value
        raise ConfigError(
            f"{key}={_shown(value)}: choose one of {list(decl.choices)}{_near(value, decl.choices)}"
        )
    if type(value) is not kind:
        if isinstance(value, dict):
            raise ConfigError(f"{key}: is a key, not a section; write {key}=VALUE")
        raise ConfigError(
            f"{key}={_shown(value)}: expected {kind.__name__}, got {type(value).__name__}"
        )
    if decl.range is not None:
        if kind is float and not math.isfinite(value):
            raise ConfigError(f"{key}={value}: not a finite number; {decl.range.text()}")
        if not decl.range.admits(value):
            shown = f"{value:.4g}" if isinstance(value, float) else _shown(value)
            raise ConfigError(f"{key}={shown}: out of range; {decl.range.text()}")
    return value


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
    """A value for a message: its repr (a choice's as its text), cut short."""
    text = repr(str(value) if isinstance(value, enum.Enum) else value)
    return text if len(text) <= 40 else f"{text[:16]}... ({len(str(value))} characters)"


def _number(key: str, text: str, kind, decl: Key):
    """A number as people write it (YAML 1.1 leaves 1e-3, 3E-4 as strings)."""
    digits = text.strip().replace("_", "")
    if kind is int and digits.lstrip("+-").isdigit():
        if len(digits) > 30:
            raise ConfigError(f"{key}={_shown(text)}: out of range; {decl.range.text()}")
        return int(digits)
    number = float(digits)
    if not math.isfinite(number):
        raise ConfigError(f"{key}={_shown(text)}: out of range; {decl.range.text()}")
    return int(number) if kind is int and number.is_integer() else number


def _section(cls, key: str, values: dict):
    if not isinstance(values, dict):
        raise ConfigError(f"{key or 'config'}: expected a mapping of keys, got {values!r}")
    if cls is Model:  # the model's own class, by its name
        from jaxpar import registry

        name = values.get("name", registry.default_name())
        if isinstance(name, str) and name in registry.names():
            cls = registry.config_class(name)
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
            owner = keys().get(full) if key == "model" else None
            if owner is not None and owner.model:  # another model's own key
                hint = f"it is model.name={owner.model}'s; set that model, or drop the key"
            raise ConfigError(f"{_shown(full)[1:-1]}: unknown {what}; {hint}")
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            kwargs[name] = _section(kind, full, value)
        elif isinstance(value, dict):
            raise ConfigError(f"{full}: is a key, not a section; write {full}=VALUE")
        else:
            kwargs[name] = value  # checked by the section's own __post_init__
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
        declared = keys().get(key)
        if declared is not None and declared.kind is str:  # text as typed (YAML reads 3:4
            value = raw  # as the base-60 number 184)
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
    """Plain values (a choice as its text), for YAML, JSON and summary.json."""
    return dataclasses.asdict(
        cfg,
        dict_factory=lambda items: {
            k: v.value if isinstance(v, enum.Enum) else v for k, v in items
        },
    )


@dataclass(frozen=True)
class BatchSplit:
    """How one optimizer step's global batch is cut (rows = sequences or examples)."""

    shard: int  # rows each data shard gets
    accum: int  # rows of one accumulation micro-batch on a shard
    micro: int  # rows of one pipeline micro-batch


def batch_split(train: Train, parallel: Parallel, mesh_shape: dict) -> BatchSplit:
    """THE batch arithmetic: global batch -> data shards (replica x data) -> accumulation
    -> pipeline."""
    data = data_parallel(mesh_shape)
    parts = data * train.grad_accum * parallel.microbatches
    if train.batch_size % parts:
        shards = f"replica({mesh_shape[REPLICA]}) * " if mesh_shape.get(REPLICA, 1) > 1 else ""
        raise ConfigError(
            f"train.batch_size={train.batch_size} does not split into {shards}"
            f"data({mesh_shape[DATA]}) * "
            f"train.grad_accum({train.grad_accum}) * parallel.microbatches"
            f"({parallel.microbatches}) = {parts} equal parts; use a multiple of {parts}"
        )
    shard = train.batch_size // data
    accum = shard // train.grad_accum
    return BatchSplit(shard=shard, accum=accum, micro=accum // parallel.microbatches)


def check_train(cfg: Config, mesh_shape: dict) -> None:
    """Batch arithmetic every run needs, whatever the model."""
    parallel = cfg.parallel
    batch_split(cfg.train, parallel, mesh_shape)
    if parallel.dp_collective is DpCollective.SERVER and parallel.zero:
        raise ConfigError(
            f"parallel.dp_collective=server with parallel.zero={parallel.zero}: a gradient "
            "server sums everything on one device, which is what ZeRO avoids (it splits the "
            "optimizer state and the reduction over all devices); use parallel.zero=0 with "
            "server, or dp_collective=ring or xla with ZeRO"
        )
    if parallel.offload is Offload.OPTIMIZER_PARAMS and parallel.zero != 3:
        raise ConfigError(
            f"parallel.offload=optimizer+params with parallel.zero={parallel.zero}: only "
            "ZeRO-3 stores parameter shards that a layer can fetch when it runs; below "
            "stage 3 every device needs all parameters. Use parallel.zero=3, or "
            "parallel.offload=optimizer"
        )
    pipelined = mesh_shape[PIPE] > 1
    _check_dp_sync(parallel, mesh_shape)
    if pipelined and parallel.offload is Offload.OPTIMIZER_PARAMS:
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
    if pipelined and parallel.schedule is Schedule.ONE_F_ONE_B and parallel.remat is Remat.OFFLOAD:
        raise ConfigError(
            "parallel.remat=offload with parallel.schedule=1f1b: 1F1B already keeps only "
            "each stage's input per micro-batch and recomputes the layers in the backward "
            "pass, so there are no saved layer inputs to send to the host; use "
            "schedule=gpipe or interleaved with remat=offload, or remat=none with 1f1b"
        )
    interleaved = parallel.schedule is Schedule.INTERLEAVED
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


def _check_dp_sync(parallel: Parallel, mesh_shape: dict) -> None:
    """Parameter averaging runs a whole model and optimizer per data-parallel device."""
    if parallel.dp_sync is DpSync.GRADS:
        for key in ("sync_every", "outer_lr", "outer_momentum"):
            value, default = getattr(parallel, key), _default(Parallel.__dataclass_fields__[key])
            if value != default:
                raise ConfigError(
                    f"parallel.{key}={value:g} has an effect only with parallel.dp_sync=params "
                    f"(it is grads); set parallel.dp_sync=params, or drop parallel.{key}"
                )
        return
    why = {
        "parallel.zero": (
            parallel.zero != 0,
            "ZeRO splits the optimizer state (and more) over data, but each device's local "
            "steps need a whole model and optimizer state of its own; use parallel.zero=0",
        ),
        "parallel.pipeline": (
            mesh_shape[PIPE] > 1,
            "a pipeline's stages step together on one model, not as copies of it; use "
            "parallel.pipeline=1 (tensor parallelism is fine)",
        ),
        "parallel.replica": (
            mesh_shape.get(REPLICA, 1) > 1,
            "replicas split ZeRO groups, and averaging has none: it averages over every "
            "data-parallel device; put them all on parallel.data",
        ),
        "parallel.offload": (
            parallel.offload is not Offload.NONE,
            "each device's own optimizer state stays on the device; use parallel.offload=none",
        ),
        "parallel.dp_collective": (
            parallel.dp_collective is not DpCollective.XLA,
            "the average is one compiler-placed all-reduce; ring and server reduce "
            "gradients; use parallel.dp_collective=xla",
        ),
    }
    for key, (bad, reason) in why.items():
        if bad:
            value = mesh_shape.get(key.split(".")[1], getattr(parallel, key.split(".")[1]))
            raise ConfigError(f"parallel.dp_sync=params with {key}={value}: {reason}")


def profile_range(train: Train) -> tuple[int, int] | None:
    """train.profile_steps as (first, last) step, both included; None when empty."""
    if not train.profile_steps:
        return None
    first, sep, last = train.profile_steps.partition(":")
    if not (sep and first.strip().isdigit() and last.strip().isdigit()):
        yaml_number = " (unquoted in YAML, 5:7 reads as the base-60 number 307: quote it)"
        raise ConfigError(
            f"train.profile_steps={_shown(train.profile_steps)}: write FIRST:LAST, the steps "
            "to profile (1-based, both included), e.g. 5:7"
            + (yaml_number if train.profile_steps.isdigit() else "")
        )
    first, last = int(first), int(last)
    if not 1 <= first <= last <= train.steps:
        raise ConfigError(
            f"train.profile_steps={first}:{last}: give 1 <= FIRST <= LAST <= train.steps "
            f"({train.steps}); e.g. {min(5, train.steps)}:{min(7, train.steps)}"
        )
    return first, last


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
    """Every config key with its default and meaning (for `jaxpar train --help`); a
    model's own keys say which model declares them."""
    lines = []
    for section, classes in section_classes().items():
        base = set()
        for cls in classes:
            comments = _field_comments(cls)
            for f in dataclasses.fields(cls):
                if f.name in base:
                    continue
                whose = "" if cls is classes[0] else f" ({cls.__name__})"
                lines += textwrap.wrap(
                    comments.get(f.name, "") + whose,
                    width=100,
                    initial_indent=f"  {f'{section}.{f.name}={_default(f)}':<28} ",
                    subsequent_indent=" " * 31,
                )
            base |= {f.name for f in dataclasses.fields(cls)}
    return "\n".join(lines)
