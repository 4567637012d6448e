"""dpo.reference=precompute: the reference's log-probabilities of every pair, computed once
before training and stored beside the data, so that no reference model is held.

The reference is the model the run starts as: its initial parameters (model.init's
files, with adapter.init's adapters, or the init from train.seed), scored forward only in
a serving layout of the devices (tensor as far as the model's dims divide, the rows over
the rest; no pipeline or ZeRO), each pair as the training row holds it. The result,
[pairs, 2] (chosen, rejected) per split, is written to `DATA/reference/KEY.SPLIT.npy`,
KEY a hash of what it depends on: the model and adapter keys, train.seq_len, the seed or
the initial files (their sizes and times), and the data's meta.json. A later run (a
resume, another layout) reads it; a change to any of those computes it again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar import hf
from jaxpar.adapters import initial
from jaxpar.config import presets
from jaxpar.config.sections import Adapter, Data, Model, Parallel, Train
from jaxpar.data import pairs
from jaxpar.data.tokens import META
from jaxpar.errors import ConfigError
from jaxpar.nn.problem import Problem
from jaxpar.objectives.answers import logps
from jaxpar.parallel.axes import DATA
from jaxpar.parallel.mesh import build_mesh, serving_layout
from jaxpar.parallel.sharding import named, pick, plan

FOLDER = "reference"  # under data.path


def reference_logps(
    model: Model, adapter: Adapter, train: Train, data: Data, own: Problem, split: str,
    devices=None,
) -> np.ndarray:  # fmt: skip
    """[pairs of `split`, 2] the reference's log-probabilities (the module's docstring)."""
    folder = Path(data.path) / FOLDER
    key = _key(model, adapter, train, data)
    path = folder / f"{key}.{split}.npy"
    if not path.is_file():
        _compute(model, adapter, train, data, own, folder, key, devices)
    count = pairs.meta_of(data)["pairs"][split]
    try:
        values = np.load(path)
    except (OSError, ValueError) as e:
        values = e
    if not isinstance(values, np.ndarray) or values.shape != (count, 2):
        found = values if isinstance(values, Exception) else f"shape {list(values.shape)}"
        raise ConfigError(
            f"dpo.reference=precompute: {path} is not the reference's log-probabilities of "
            f"the {count} {split} pairs ({found}); remove it, and the run computes them again"
        )
    return values


def _key(model: Model, adapter: Adapter, train: Train, data: Data) -> str:
    directory = hf.directory_of(model.init)
    files = []
    for d in [
        directory,
        Path(adapter.init.removeprefix("peft:")) if adapter.init else None,
    ]:
        for f in sorted(d.iterdir()) if d and d.is_dir() else []:
            files.append([f.name, f.stat().st_size, f.stat().st_mtime_ns])
    what = {
        "model": presets.to_dict(model),
        "adapter": presets.to_dict(adapter),
        "seq_len": train.seq_len,
        "seed": train.seed,
        "files": files,
        "data": (Path(data.path) / META).read_text(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _compute(
    model: Model, adapter: Adapter, train: Train, data: Data, own: Problem, folder: Path,
    key: str, devices,
) -> None:  # fmt: skip
    devices = jax.devices() if devices is None else devices
    d, tensor = serving_layout(model, len(devices))
    mesh = build_mesh(Parallel(data=d, tensor=tensor), devices[: d * tensor])
    shapes = {k: s.shape for k, s in own.shapes.items()}
    shardings = named(mesh, pick(plan(own.names, shapes, zero=0, mesh_shape=dict(mesh.shape)),
                                 "storage"))  # fmt: skip
    targets = {
        k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[k])
        for k, s in own.shapes.items()
    }
    fill = initial.params(model, adapter, train, own)
    if fill is None:
        params = jax.jit(own.init, out_shardings=shardings)(jax.random.key(train.seed))
    else:
        params = fill(targets)
    rows = NamedSharding(mesh, PartitionSpec(DATA))
    score = jax.jit(
        lambda p, batch: logps(own.loss(p, batch), batch),
        out_shardings=NamedSharding(mesh, PartitionSpec()),
    )
    chunk = d * max(1, train.batch_size // d)
    scored = {}
    for split in ("train", "val"):
        count = (pairs.meta_of(data) or {}).get("pairs", {}).get(split, 0)
        if not count:
            continue
        held = pairs.load(data, train, model.vocab, split)
        out = []
        for first in range(0, count, chunk):
            index = np.arange(first, first + chunk) % count  # the last chunk padded
            batch = jax.device_put(pairs.rows_of(held, index, train.seq_len), rows)
            out.append(np.asarray(score(params, batch))[: count - first])
        scored[split] = np.concatenate(out).astype(np.float32)
    if jax.process_index() == 0:
        try:
            folder.mkdir(exist_ok=True)
            for split, values in scored.items():
                partial = folder / f".{key}.{split}.npy.partial"
                with partial.open("wb") as f:
                    np.save(f, values)
                os.replace(partial, folder / f"{key}.{split}.npy")
        except OSError as e:
            raise ConfigError(
                f"dpo.reference=precompute: cannot write the reference's log-probabilities "
                f"into {folder} ({e.strerror}); make data.path writable, or use "
                "dpo.reference=copy"
            ) from None
    multihost_utils.sync_global_devices("dpo reference written")
