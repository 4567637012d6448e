"""Hugging Face checkpoints in and out: `config.json` and safetensors (one file or many,
with their index), for the models whose registry entry declares an `HFFormat`.

In: `config.json` is read into `model.*` (a key the user set that disagrees is refused);
then every parameter is built straight into its sharded place with
`jax.make_array_from_callback`, each device's shard read from just its bytes of the file
(`os.pread` after the safetensors header; no memory map, whose resident pages would count
against the process), so no device, and no process, holds or reads more than its own
shards. Out: the parameters of a run's checkpoint and its config, as
`transformers`' `from_pretrained` reads them.

A tensor's layout is written as dims in both conventions, e.g. `"(h d) e"` for a
`nn.Linear` weight ([out, in]) against jaxpar's `"e h d"`: groups in parentheses are
flattened into one dim of the file; reading a slice reads whole rows of the file's
dims, slicing only the first dim of each group (the others are read whole).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxpar.errors import CheckpointError, ConfigError

SCHEME = "hf:"


@dataclass(frozen=True)
class Tensor:
    """One of our parameter leaves and the Hugging Face tensor it is."""

    key: str  # our leaf, e.g. "blocks/attn/wq"
    # the file's name for it; each "{...}" in it (e.g. "{layer}", "{expert}"): one tensor
    # per index of one of our leaf's leading dims, in order (a stack of layers, of experts)
    name: str
    file_dims: str  # its dims in the file, e.g. "(h d) e"
    our_dims: str  # ours without the stacked dims, e.g. "e h d"
    # "{layer}" of a leaf stacked by groups of blocks (model.moe_every): the file's layer
    # at our index i is i x every + offset
    every: int = 1
    offset: int = 0
    # (i, n): our leaf is the i-th of n interleaved in the file's dim "t", e.g. GPT-OSS's
    # gate and up projections in one tensor, "x e (m t)": gate at even columns, up at odd
    part: tuple[int, int] | None = None

    @property
    def stacked(self) -> list[str]:
        """The placeholders of `name`, one a leading dim of our leaf."""
        return re.findall(r"\{(\w+)\}", self.name)

    def file_name(self, index: tuple[int, ...]) -> str:
        """The file's tensor at `index` of our stacked dims."""
        at = dict(zip(self.stacked, index, strict=True))
        if "layer" in at:
            at["layer"] = at["layer"] * self.every + self.offset
        return self.name.format(**at)


@dataclass(frozen=True)
class Wrapper:
    """A release that holds the model inside a larger one, e.g. Gemma 3's multimodal
    checkpoints, whose text model is read and whose vision tower is skipped."""

    architecture: str  # its config.json's `architectures`
    config: str  # the key of its config.json holding the model's, e.g. "text_config"
    prefix: str  # the model's tensors' prefix in its files, e.g. "language_model."
    others: str  # a pattern of its other tensors: skipped on reading, carried on export
    what: str  # what they are, in words
    # keys of its inner config that its transformers class never applies: read as unset
    ignores: tuple[str, ...] = ()


@dataclass(frozen=True)
class HFFormat:
    architecture: str  # config.json's `architectures`, e.g. "LlamaForCausalLM"
    config_from_hf: Callable[[dict], dict]  # config.json -> {model key: value}
    config_to_hf: Callable[..., dict]  # (model config, seq_len) -> config.json
    tensors: Callable[..., list[Tensor]]  # (model config) -> the leaves and their tensors
    ignore: str = r"rotary_emb\.inv_freq$"  # tensors in a file that are not parameters
    # model keys config.json suggests for training (not the architecture): a value the
    # user sets is taken instead, not refused
    training: tuple[str, ...] = ()
    wrappers: tuple[Wrapper, ...] = ()  # the releases holding the model inside a larger one
    # (config.json) -> None, or a CheckpointError: weights it cannot read (its config
    # alone, as plan reads it, is still read)
    weights_check: Callable[[dict], None] = lambda hf: None
    # (model config) -> a pattern of the tensors a checkpoint may hold that the model
    # does not read (layers past its own)
    unread: Callable[..., str] = lambda model: r"$^"
    # (model config) -> {tensor: the tensor it repeats}: written on export as copies
    copies: Callable[..., dict] = lambda model: {}

    @property
    def architectures(self) -> tuple[str, ...]:
        """Every config.json `architectures` it reads: its own, then its wrappers'."""
        return (self.architecture, *(w.architecture for w in self.wrappers))

    def wrapper(self, hf: dict) -> Wrapper | None:
        """The wrapper whose release this config.json is (None: the model's own)."""
        archs = hf.get("architectures") or ()
        return next((w for w in self.wrappers if w.architecture in archs), None)


def model_config(fmt: HFFormat, hf: dict) -> dict:
    """The model's own keys of a config.json: a wrapper's inner config, or all of it."""
    w = fmt.wrapper(hf)
    return hf if w is None else hf[w.config] | dict.fromkeys(w.ignores)


def wrapped(tensors: list[Tensor], w: Wrapper | None) -> list[Tensor]:
    """`tensors` as a wrapper's files name them (under its prefix)."""
    if w is None:
        return tensors
    return [dataclasses.replace(t, name=w.prefix + t.name) for t in tensors]


def dims_of(dims: str) -> list[list[str]]:
    """'(h d) e' -> [['h', 'd'], ['e']]."""
    return [g.split() for g in re.findall(r"\(([^)]*)\)|(\w+)", dims) for g in g if g]


def _sizes(t: Tensor, shape: tuple[int, ...]) -> dict[str, int]:
    """Each dim letter's size, from our leaf's shape (layer stack first, if any)."""
    ours = t.our_dims.split()
    sizes = dict(zip(ours, shape[len(shape) - len(ours) :], strict=True))
    return sizes | ({"t": t.part[1]} if t.part else {})


def file_shape(t: Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    sizes = _sizes(t, shape)
    return tuple(math.prod(sizes[d] for d in g) for g in dims_of(t.file_dims))


def _block(reader: _Reader, name: str, t: Tensor, sizes: dict, region: dict) -> np.ndarray:
    """Our dims' `region` (letter -> slice) of the file's tensor `name`: the rows of the
    file that hold it (each group's first letter sliced, the others whole), then sliced."""
    groups, ours = dims_of(t.file_dims), t.our_dims.split()
    index, shape, order = [], [], []
    for g in groups:
        first, inner = region[g[0]], math.prod(sizes[d] for d in g[1:])
        index.append(slice(first.start * inner, first.stop * inner))
        shape += [first.stop - first.start, *(sizes[d] for d in g[1:])]
        order += g
    block = reader.read(name, tuple(index)).reshape(shape)
    if t.part:  # our part of the interleaved ones
        block = np.take(block, t.part[0], axis=order.index("t"))
        order.remove("t")
    block = block.transpose([order.index(d) for d in ours])
    firsts = {g[0] for g in groups}
    return block[tuple(slice(None) if d in firsts else region[d] for d in ours)]


def to_file(t: Tensor, ours: np.ndarray) -> np.ndarray:
    """One of our arrays (one layer's, for a stack) in the file's layout."""
    groups, dims = dims_of(t.file_dims), t.our_dims.split()
    order = [d for g in groups for d in g]
    return np.ascontiguousarray(
        ours.transpose([dims.index(d) for d in order]).reshape(file_shape(t, ours.shape))
    )


DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
          "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8"}  # fmt: skip


class _File:
    """One safetensors file: its header parsed, its tensors read by `os.pread` of just
    the bytes a slice needs (no memory map, whose pages would count as the process's)."""

    def __init__(self, path: Path):
        import ml_dtypes  # jax's own dependency: bfloat16 for numpy

        self.path, self.fd = path, os.open(path, os.O_RDONLY)
        size = os.fstat(self.fd).st_size
        n = int.from_bytes(os.pread(self.fd, 8, 0), "little") if size >= 8 else size
        try:
            header = json.loads(os.pread(self.fd, n, 8)) if 8 + n <= size else None
        except ValueError:
            header = None
        if not isinstance(header, dict):
            raise ValueError(f"no safetensors header in its {size} bytes")
        self.base = 8 + n
        self.tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((v["data_offsets"][1] for v in self.tensors.values()), default=0)
        if self.base + end > size:
            raise ValueError(f"truncated: {size} bytes, its header promises {self.base + end}")
        self.dtypes = {
            k: np.dtype(getattr(ml_dtypes, DTYPES[v["dtype"]], DTYPES[v["dtype"]]))
            for k, v in self.tensors.items()
        }

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def whole(self, name: str) -> np.ndarray:
        """The tensor `name`, of any rank, as stored."""
        start, stop = self.tensors[name]["data_offsets"]
        raw = os.pread(self.fd, stop - start, self.base + start)
        return np.frombuffer(raw, self.dtypes[name]).reshape(self.shape(name))

    def read(self, name: str, index: tuple[slice, ...]) -> tuple[np.ndarray, int]:
        """(the slice `index` of a tensor, bytes read: of more than two dims, the whole
        rows of its first dim's slice)."""
        shape, dtype = self.shape(name), self.dtypes[name]
        start = self.base + self.tensors[name]["data_offsets"][0]
        rows = index[0]
        if len(shape) > 2:
            row = math.prod(shape[1:]) * dtype.itemsize
            raw = os.pread(self.fd, (rows.stop - rows.start) * row, start + rows.start * row)
            block = np.frombuffer(raw, dtype).reshape(-1, *shape[1:])
            return block[(slice(None), *index[1:])], len(raw)
        if len(shape) == 1:
            item = dtype.itemsize
            raw = os.pread(self.fd, (rows.stop - rows.start) * item, start + rows.start * item)
            return np.frombuffer(raw, dtype), len(raw)
        cols, width = index[1], shape[1] * dtype.itemsize
        if (cols.start, cols.stop) == (0, shape[1]):  # whole rows: one read
            raw = os.pread(self.fd, (rows.stop - rows.start) * width, start + rows.start * width)
            return np.frombuffer(raw, dtype).reshape(-1, shape[1]), len(raw)
        out = np.empty((rows.stop - rows.start, cols.stop - cols.start), dtype)
        item = dtype.itemsize
        for i, row in enumerate(range(rows.start, rows.stop)):  # each row's part
            at = start + row * width + cols.start * item
            out[i] = np.frombuffer(os.pread(self.fd, out.shape[1] * item, at), dtype)
        return out, out.nbytes


class _Reader:
    """The tensors of a Hugging Face checkpoint directory: one file or many, by index."""

    def __init__(self, directory: Path, where: str):
        self.directory = directory
        index = directory / "model.safetensors.index.json"
        files = sorted(directory.glob("*.safetensors"))
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif len(files) == 1:
            weight_map = None
        else:
            raise CheckpointError(
                f"{where}: {len(files)} *.safetensors files and no "
                "model.safetensors.index.json; give the directory save_pretrained wrote"
            )
        self.files = {}
        for path in {directory / f for f in weight_map.values()} if weight_map else files:
            try:
                self.files[path.name] = _File(path)
            except (OSError, ValueError, KeyError, TypeError) as e:  # truncated, foreign
                raise CheckpointError(f"{where}: {path.name} cannot be read ({e})") from None
        self.where = weight_map or {
            name: files[0].name for name in self.files[files[0].name].tensors
        }
        self.bytes_read = 0  # what this process has read from the files

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[self.where[name]].shape(name)

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        block, read = self.files[self.where[name]].read(name, index)
        self.bytes_read += read
        return block

    def whole(self, name: str) -> np.ndarray:
        return self.files[self.where[name]].whole(name)


SCORE = "score"  # a sequence classifier's head [embed, labels]: a reward model's


def directory_of(init: str) -> Path | None:
    """model.init -> the checkpoint directory (None: random parameters)."""
    if not init:
        return None
    if not init.startswith(SCHEME):
        raise ConfigError(
            f"model.init={init!r}: give hf:DIR, a Hugging Face checkpoint directory, or "
            "leave it empty for random parameters"
        )
    directory = Path(init.removeprefix(SCHEME)).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"model.init={init}: {directory} is not a directory")
    return directory


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"model.init=hf:{directory}: no config.json there; give a directory written by "
            "transformers' save_pretrained"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"model.init=hf:{directory}: config.json: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(
            f"model.init=hf:{directory}: config.json holds a JSON {type(config).__name__}, "
            "not a model's settings; give a directory written by transformers' save_pretrained"
        )
    return config


def resolve(fmt: HFFormat, model, directory: Path, explicit: dict) -> dict:
    """The model keys of `directory`'s config.json, for a model config whose keys in
    `explicit` (key -> value) the user set: each of those must agree (or is a training
    key, and is taken)."""
    hf = read_config(directory)
    arch = hf.get("architectures") or [hf.get("model_type", "?")]
    if not set(fmt.architectures) & set(arch):
        raise CheckpointError(
            f"model.init=hf:{directory}: config.json says {arch[0]}; model.name="
            f"{model.name} reads {' or '.join(fmt.architectures)}"
        )
    keys = fmt.config_from_hf(model_config(fmt, hf))
    for key, value in explicit.items():
        if key in fmt.training:
            keys[key] = value
        elif key in keys and keys[key] != value:
            raise ConfigError(
                f"model.{key}={value} disagrees with model.init=hf:{directory}, whose "
                f"config.json gives {keys[key]}; drop model.{key}, or use another checkpoint"
            )
    return keys


def initial_params(fmt: HFFormat, model, directory: Path, shapes: dict):
    """(targets -> params) for a model of parameter `shapes` (key -> ShapeDtypeStruct,
    its own layout): the files' tensors checked now (names, shapes), before anything is
    compiled; then, given each leaf's target with its sharding, the leaves built from
    `directory`, each device's shard read from its own slices."""
    where = f"model.init=hf:{directory}"
    config = read_config(Path(directory))
    fmt.weights_check(config)
    w = fmt.wrapper(config)
    ignore = f"{fmt.ignore}|{fmt.unread(model)}" + ("" if w is None else f"|{w.others}")
    tensors = wrapped(fmt.tensors(model), w)
    return read_params(tensors, Path(directory), shapes, where, f"model.name={model.name}", ignore)


def init_notes(fmt: HFFormat, model) -> list[str]:
    """What the start-up summary says of model.init's release: a wrapper's tensors that
    are not the model's, skipped."""
    directory = directory_of(model.init)
    w = directory and fmt.wrapper(read_config(directory))
    if not w:
        return []
    others = [n for n in _Reader(directory, model.init).where if re.search(w.others, n)]
    return [
        f"model.init is a {w.architecture}: its {w.prefix.rstrip('.')} read as "
        f"model.name={model.name}, its {len(others)} other tensors ({w.what}) skipped; "
        "export --format hf carries them through"
    ]


def read_params(
    tensors: list[Tensor], directory: Path, shapes: dict, where: str, owner: str, ignore: str
):
    """initial_params of the leaves `tensors` name, from the safetensors in `directory`
    (`where` names it in a refusal, `owner` what declares the layout; tensors matching
    `ignore` may be there unread)."""
    import jax

    reader = _Reader(directory, where)
    tensors = {t.key: t for t in tensors}
    names = {}  # file tensor -> (its Tensor, our leaf's shape)
    for key, t in tensors.items():
        shape = tuple(shapes[key].shape)
        stacked = shape[: len(t.stacked)]
        names |= {t.file_name(i): (t, shape) for i in np.ndindex(stacked)}
    missing = [n for n in names if n not in reader.where]
    if missing:
        raise CheckpointError(f"{where}: no tensor {missing[0]} ({len(missing)} missing)")
    extra = [n for n in reader.where if n not in names and not re.search(ignore, n)]
    if extra:
        raise CheckpointError(
            f"{where}: unexpected tensor {extra[0]} ({len(extra)} not in {owner}'s layout)"
        )
    for name, (t, shape) in names.items():
        if reader.shape(name) != file_shape(t, shape):
            raise CheckpointError(
                f"{where}: {name} has shape {list(reader.shape(name))}; {owner}'s "
                f"dims make it {list(file_shape(t, shape))}"
            )

    def leaf(key: str, target):
        t, shape = tensors[key], target.shape
        sizes, ours = _sizes(t, shape), t.our_dims.split()

        def shard(index) -> np.ndarray:
            idx = [slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)]
            n = len(t.stacked)
            region = dict(zip(ours, idx[n:], strict=True))
            stacked = [range(s.start, s.stop) for s in idx[:n]]
            blocks = [
                _block(reader, t.file_name(i), t, sizes, region)
                for i in itertools.product(*stacked)
            ]
            block = np.stack(blocks).reshape(tuple(map(len, stacked)) + blocks[0].shape)
            return block.astype(target.dtype, copy=False)

        return jax.make_array_from_callback(shape, target.sharding, shard)

    def build(targets: dict) -> dict:
        return {key: leaf(key, target) for key, target in targets.items()}

    build.reader = reader  # bytes_read: what this process has read
    return build


def save_safetensors(tensors: dict, path: Path, metadata: dict) -> None:
    """One safetensors file, the same bytes for the same tensors and metadata, readable
    as the umask allows (safetensors itself writes 0600, whatever the umask).
    safetensors keeps the metadata in a hash map, so its order in the header changes from
    one process to the next: the header is written again with it sorted."""
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata=metadata)
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        if "__metadata__" in header:
            header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        # the same entries, the same escapes: the same length (the rest is padding)
        assert len(text) <= size, (len(text), size)
        f.seek(8)
        f.write(text.ljust(size))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def export(
    fmt: HFFormat,
    model,
    seq_len: int,
    params: dict,
    to: Path,
    release: Path | None = None,
    pad: int | None = None,
) -> int:
    """Write `params` (host arrays in our own layout, by key) and the model's config as a
    Hugging Face checkpoint directory; returns the number of tensors. `release`: a
    wrapper's checkpoint to write the model into, its other tensors and its config's
    other keys carried through as they are (None: the model's own layout). `params` with
    a SCORE leaf are a sequence classifier's (`classified`; `pad`: its pad id)."""
    config = fmt.config_to_hf(model, seq_len)
    w = fmt.wrapper(read_config(release)) if release else None
    written = fmt.tensors(model)
    if SCORE in params:  # a classifier's head in place of the language model's
        written = [t for t in written if t.key in params]
    tensors, parts = {}, {}  # parts: a tensor's interleaved leaves, (its Tensor, arrays)
    for t in wrapped(written, w):
        ours = np.asarray(params[t.key])
        for i in np.ndindex(ours.shape[: len(t.stacked)]):
            if t.part:
                parts.setdefault(t.file_name(i), (t, {}))[1][t.part[0]] = ours[i]
            else:
                tensors[t.file_name(i)] = to_file(t, ours[i])
    for name, (t, arrays) in parts.items():  # the parts side by side in their dim "t"
        whole = np.stack([arrays[i] for i in range(t.part[1])], -1)
        both = dataclasses.replace(t, our_dims=f"{t.our_dims} t", part=None)
        tensors[name] = to_file(both, whole)
    prefix = w.prefix if w else ""
    tensors |= {prefix + n: tensors[prefix + of] for n, of in fmt.copies(model).items()}
    if w:
        reader = _Reader(release, f"model.init=hf:{release}")
        tensors |= {n: reader.whole(n) for n in reader.where if re.search(w.others, n)}
        source = read_config(release)
        inner = source[w.config] | {k: v for k, v in config.items() if k != "architectures"}
        config = source | {w.config: inner, "dtype": config["dtype"]}
    if SCORE in params:
        tensors, config = classified(tensors, config, params[SCORE], pad)
    to.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, to / "model.safetensors", {"format": "pt"})
    (to / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return len(tensors)


def classified(tensors: dict, config: dict, score: np.ndarray, pad: int | None):
    """A causal language model's (tensors, config) made a `...ForSequenceClassification`'s
    with `score` [embed, labels] as its head (`score.weight` [labels, embed]; the language
    model's head is left out by the caller), and the pad id transformers finds each
    sequence's last token by."""
    labels = score.shape[-1]
    causal = config["architectures"][0]
    arch = re.sub("(ForCausalLM|LMHeadModel)$", "ForSequenceClassification", causal)
    config = config | {
        "architectures": [arch],
        "num_labels": labels,
        "id2label": {str(i): f"LABEL_{i}" for i in range(labels)},
        "label2id": {f"LABEL_{i}": i for i in range(labels)},
        "pad_token_id": pad,
    }
    head = np.ascontiguousarray(np.asarray(score, np.float32).T)
    return tensors | {"score.weight": head}, config
