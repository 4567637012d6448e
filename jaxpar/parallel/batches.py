"""The global batch: how one optimizer step's batch is cut over data shards,
accumulation and pipeline micro-batches (`batch_split`, the one batch arithmetic), and
how each batch a run is given is checked and put on the devices (`batch_for`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxpar.config.sections import Parallel, Train
from jaxpar.errors import ConfigError
from jaxpar.parallel.axes import BATCH_AXES, DATA, data_parallel


@dataclass(frozen=True)
class BatchSplit:
    """How one optimizer step's global batch is cut (rows = sequences or examples)."""

    shard: int  # rows each data shard gets
    accum: int  # rows of one accumulation micro-batch on a shard
    micro: int  # rows of one pipeline micro-batch


def batch_split(train: Train, parallel: Parallel, mesh_shape: dict) -> BatchSplit:
    """THE batch arithmetic: global batch -> data shards (replica x data x expert) ->
    accumulation -> pipeline."""
    data = data_parallel(mesh_shape)
    parts = data * train.grad_accum * parallel.microbatches
    if train.batch_size % parts:
        shards = "".join(
            f"{a}({mesh_shape[a]}) * " if a == DATA or mesh_shape.get(a, 1) > 1 else ""
            for a in BATCH_AXES
        )
        raise ConfigError(
            f"train.batch_size={train.batch_size} does not split into {shards}"
            f"train.grad_accum({train.grad_accum}) * parallel.microbatches"
            f"({parallel.microbatches}) = {parts} equal parts; use a multiple of {parts}"
        )
    shard = train.batch_size // data
    accum = shard // train.grad_accum
    return BatchSplit(shard=shard, accum=accum, micro=accum // parallel.microbatches)


def _leaves(batch) -> list[tuple[str, object]]:
    import jax

    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(batch)]


def check_first_batch(batch, want: int) -> None:
    """batches(0) is the whole global batch: arrays of train.batch_size (`want`) rows each."""
    for path, x in _leaves(batch):
        shape = getattr(x, "shape", None)
        if shape is None or not shape:
            raise ConfigError(
                f"batches(0){path} is {type(x).__name__} {shape or ''}: a batch is a pytree "
                f"of arrays with a leading dim of train.batch_size={want} rows"
            )
        if shape[0] != want:
            raise ConfigError(
                f"batches(0){path} has {shape[0]} rows (shape {tuple(shape)}) but "
                f"train.batch_size={want}: batches(step) returns the whole global batch of "
                f"every data shard; return {want} rows, or set train.batch_size={shape[0]}"
            )


def check_batch(batch, shapes, step: int, rows: int | None = None) -> None:
    """Every batch like the first (the compiled step's shapes): cheap, and it names the
    leaf and both shapes instead of failing inside the step."""
    got, want = _leaves(batch), _leaves(shapes)
    if [p for p, _ in got] != [p for p, _ in want]:
        raise ConfigError(
            f"batches({step}) has leaves {[p for p, _ in got]}, but batches(0) had "
            f"{[p for p, _ in want]}: every batch must have the same structure"
        )
    for (path, x), (_, w) in zip(got, want, strict=True):
        expected = (w.shape[0] if rows is None else rows, *w.shape[1:])
        if tuple(np.shape(x)) != expected or np.dtype(x.dtype) != np.dtype(w.dtype):
            raise ConfigError(
                f"batches({step}){path} is {np.dtype(x.dtype).name}{list(np.shape(x))}, but the "
                f"step was compiled for {np.dtype(w.dtype).name}{list(expected)} (batches(0)'s, "
                f"train.batch_size={w.shape[0]}): every batch must have the same shapes"
            )


def takes_rows(batches: Callable) -> bool:
    """Whether `batches` can build a slice of the global batch: batches(step, rows=...)."""
    return "rows" in inspect.signature(batches).parameters


def batch_for(batches: Callable, step: int, sharding, shape_of):
    """Global batch `step` as a global array. With many processes each puts in only the
    rows of its own devices, and builds only those when `batches` takes `rows`."""
    import jax

    if jax.process_count() == 1:
        batch = batches(step)
        check_batch(batch, shape_of, step)
        return jax.device_put(batch, sharding)
    global_rows = jax.tree.leaves(shape_of)[0].shape[0]
    spans = [i[0] for i in sharding.addressable_devices_indices_map((global_rows,)).values()]
    mine = slice(min(s.start or 0 for s in spans), max(s.stop or global_rows for s in spans))
    local = (
        batches(step, rows=mine)
        if takes_rows(batches)
        else jax.tree.map(lambda x: x[mine], batches(step))
    )
    check_batch(local, shape_of, step, rows=mine.stop - mine.start)
    return jax.tree.map(
        lambda x, g: jax.make_array_from_process_local_data(sharding, x, g.shape),
        local,
        shape_of,
    )
