"""Export: a run's parameters as one safetensors file (unsharded, in the model's own
layout, keys = parameter paths joined by '/'), readable by any program with the
`safetensors` package; and the way back into a model."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from jaxpar import disk, hf
from jaxpar.adapters import base, lora, peft
from jaxpar.config import presets, registry
from jaxpar.config.sections import Adapter, AdapterKind, Model
from jaxpar.data import pairs
from jaxpar.errors import ConfigError, ParamsError
from jaxpar.nn.problem import Problem, registered
from jaxpar.parallel import distributed
from jaxpar.parallel.sharding import leaf_key
from jaxpar.training import checkpoint


def checkpoint_dir(run_dir: Path) -> Path:
    """A run directory's checkpoints (or `run_dir` itself, if it holds them)."""
    inside = Path(run_dir) / "checkpoints"
    return inside if inside.is_dir() else Path(run_dir)


def holding(run_dir: Path, step: int | None = None) -> Path:
    """The folder of a run's checkpoints that holds its newest (or `step`): its local
    tier (checkpoint.local_dir, as its summary.json names it) where that holds a newer
    one, as after a kill -9 between shared saves, else checkpoint_dir's."""
    shared, summary = checkpoint_dir(run_dir), Path(run_dir) / "summary.json"
    try:
        local = json.loads(summary.read_text())["config"]["checkpoint"]["local_dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return shared
    if not local or not Path(local).is_dir():
        return shared
    if step is not None:
        return Path(local) if (Path(local) / str(step)).is_dir() else shared
    newer = (distributed.newest_step(Path(local)) or -1) > (distributed.newest_step(shared) or -1)
    return Path(local) if newer else shared


def run_params(run_dir: Path, step: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """(a run's parameters as trained, host arrays by key, and the meta of its newest
    checkpoint or of `step`, in either tier): an adapter run's frozen base made again
    from the reference its checkpoint holds (jaxpar.adapters.base), beside the adapters."""
    directory = holding(run_dir, step)
    params, meta = checkpoint.saved_params(directory, step)
    cfg = presets.from_dict(meta["config"])
    if cfg.adapter.kind is AdapterKind.LORA:
        problem = lora.adapted(registered(cfg.model, cfg.train.seq_len), cfg.adapter, cfg.model)
        where = directory / str(meta["step"])
        params = base.rebuilt(cfg.model, cfg.train, problem, params, meta.get("base"), where)
    return params, meta


def export(run_dir: Path, to: Path) -> tuple[int, int]:
    """Write the latest checkpoint's parameters to `to`; returns (step, tensors)."""
    params, meta = run_params(run_dir)
    to = Path(to)
    if to.is_dir():
        raise ConfigError(
            f"--to {to}: is a directory; give a file name, e.g. {to}/model.safetensors"
        )
    saved = {"jaxpar.step": str(meta["step"]), "jaxpar.config": json.dumps(meta["config"])}
    try:
        with _whole(to, params) as part:
            hf.save_safetensors(params, part, saved)
    except OSError as e:
        raise ConfigError(f"--to {to}: cannot be written ({e.strerror})") from None
    return meta["step"], len(params)


@contextlib.contextmanager
def _whole(to: Path, params: dict):
    """A path to write `to` at, renamed to it when whole; a full disk is one line."""
    needed = sum(np.asarray(x).nbytes for x in params.values())
    then = "free space (or give another --to), then export again"
    with disk.writing(to.parent.absolute(), to.name, then, needed), disk.staged(to) as part:
        yield part


def _saved(run_dir: Path, what: str, read=run_params):
    """(the latest checkpoint's parameters as `read` gives them, its meta, the run's
    model.*, its adapter.*)."""
    params, meta = read(run_dir)
    model_keys = meta["config"]["model"]
    model = (registry.config_class(model_keys["name"]) or Model)(**model_keys)
    registry.hf_format(model.name, what)
    adapter = Adapter(**meta["config"].get("adapter", {}))
    return params, meta, model, adapter


def export_hf(run_dir: Path, to: Path, architecture: str = "") -> tuple[int, int]:
    """Write the latest checkpoint as a Hugging Face checkpoint directory (config.json,
    model.safetensors) for the run's model, an adapter run's adapters merged into its
    base, as `architecture` (default: the one model.init was read as); returns (step,
    tensors)."""
    params, meta, model, adapter = _saved(run_dir, "--format hf")
    seq_len = meta["config"]["train"]["seq_len"]
    if adapter.kind is AdapterKind.LORA:
        params = {
            k: np.asarray(v)
            for k, v in lora.merged(registered(model, seq_len), adapter, model, params).items()
        }
    fmt = registry.hf_format(model.name, "--format hf")
    release = _release(fmt, model, architecture)
    # a classifier's head (hf.SCORE) is read by the last token before the data's pad id
    pad = pairs.pad_id(meta["config"]["data"]["path"]) if hf.SCORE in params else None
    with _whole(Path(to), params) as part:
        tensors = hf.export(fmt, model, seq_len, params, part, release, pad)
    return meta["step"], tensors


def _release(fmt: hf.HFFormat, model: Model, architecture: str) -> Path | None:
    """The checkpoint whose wrapper (e.g. Gemma3ForConditionalGeneration) an export as
    `architecture` writes into: model.init's, if it is one and `architecture` is its or
    unset; None for the model's own layout."""
    if architecture and architecture not in fmt.architectures:
        raise ConfigError(
            f"--architecture {architecture}: model.name={model.name} is written as "
            f"{' or '.join(fmt.architectures)}; choose one of them"
        )
    init = Path(model.init.removeprefix(hf.SCHEME)) if model.init else None
    w = fmt.wrapper(hf.read_config(init)) if init and init.is_dir() else None
    if architecture in ("", getattr(w, "architecture", "")):
        return init if w else None
    if architecture == fmt.architecture:
        return None
    raise ConfigError(
        f"--architecture {architecture}: its other tensors are carried from the run's "
        f"model.init, and {model.init or 'an empty model.init'} is no {architecture} "
        f"checkpoint (or is gone); export --architecture {fmt.architecture}, or train from "
        f"a {architecture}"
    )


def export_peft(run_dir: Path, to: Path) -> tuple[int, int]:
    """Write an adapter run's adapters as a PEFT adapter directory; returns (step,
    tensors). The base the adapters name is checked by the fingerprint the run saved, as
    every reader checks it: adapters trained on other weights would load onto it without
    a word in PEFT."""
    params, meta, model, adapter = _saved(run_dir, "--format peft")
    if adapter.kind is not AdapterKind.LORA:
        raise ConfigError(
            f"--format peft: {run_dir} trained every weight (adapter.kind=none), and has no "
            "adapters to write; use --format hf"
        )
    base = model.init.removeprefix(hf.SCHEME)
    with _whole(Path(to), params) as part:
        tensors = peft.export(adapter, model, params, part, base)
    return meta["step"], tensors


def load(path: Path, problem: Problem | None = None):
    """An exported file's parameters: a dict by key, or (given the problem it was trained
    as) in that problem's own pytree structure."""
    params = load_file(str(path))
    if problem is None:
        return params
    wanted = jax.tree_util.tree_map_with_path(lambda p, _: leaf_key(p), problem.shapes)
    missing = [k for k in jax.tree.leaves(wanted) if k not in params]
    if missing:
        raise ParamsError(f"{path}: has no parameter {missing[0]} ({len(missing)} missing)")
    return jax.tree.map(lambda k: params[k], wanted)


def to_nnx(make: Callable[[nnx.Rngs], nnx.Module], params: dict) -> nnx.Module:
    """The NNX module `make` builds, holding `params` (a dict by key, as `jaxpar.train`'s
    result or `load` give them) instead of fresh initial values."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
    entries = []
    for path, var in nnx.to_flat_state(state):
        key = "/".join(map(str, path))
        if key not in params:
            raise ParamsError(f"to_nnx: no value for parameter {key} {var.shape}")
        value = jnp.asarray(np.asarray(params[key]))
        if value.shape != var.shape:
            raise ParamsError(
                f"to_nnx: parameter {key} is {value.shape}, the model has {var.shape}"
            )
        entries.append((path, var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(entries))
