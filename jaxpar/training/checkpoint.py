"""Checkpoints with orbax: asynchronous saves, exact resume, restore into any layout, export.

A checkpoint is one orbax step directory with two items: `state`, the TrainState in the
model's own layout (a pipeline's staged layer stack unstaged, in device memory), and
`meta`, JSON with the resolved config, the mesh it was saved from and every
parameter's shape. Orbax writes a step into a temporary directory and renames it when
complete, so a save cut short (kill -9) is never taken for the latest.

Nor is the frozen base of a run that trains adapters (Problem.frozen): `meta` names where
it came from and its fingerprint (jaxpar.adapters.base), and a restore makes it again
from there, checked by that fingerprint.

Not stored either: the compute copy of an offloaded run. It is the master weights cast to the
compute dtype, bit for bit (at init and after every host update), so a restore makes it
again, in whatever precision the restoring run uses. Nor the data position: a batch is
a pure function of (seed, step), and the step is in the state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxpar import disk
from jaxpar.adapters import base as base_lib
from jaxpar.config.presets import to_dict
from jaxpar.config.sections import Checkpoint as CheckpointKeys
from jaxpar.config.sections import Config, OnNonfinite, Parallel, Precision, given
from jaxpar.cost.formulas import DTYPES
from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.nn.problem import Problem
from jaxpar.parallel import pipeline
from jaxpar.parallel.mesh import build_mesh, describe
from jaxpar.parallel.sharding import leaf_key, plan
from jaxpar.step import offload, spikes
from jaxpar.step import state as state_lib
from jaxpar.step.build import build
from jaxpar.step.engine import Engine
from jaxpar.step.state import TrainState

STATE, META = "state", "meta"
WINDOW = "spike_window"  # the saved dict's key of a train.on_spike run's window


@dataclass(frozen=True)
class Layout:
    """A run's TrainState <-> its checkpoint (the model's own layout)."""

    to_saved: Callable  # TrainState (run layout, any memory) -> saved dict
    # saved dict, its params joined by the frozen ones -> TrainState in the run's shardings
    from_saved: Callable
    target: Any  # saved dict of ShapeDtypeStructs with this run's shardings: restore targets
    params: dict  # every parameter's ShapeDtypeStruct with its sharding, the model's layout
    shapes: dict[str, list[int]]  # parameter key -> shape, in the model's layout
    fresh: Callable  # parameters (the model's layout, `params`' shardings) -> a step-0 state
    base_hash: Callable  # TrainState -> the fingerprint of its frozen (unsaved) parameters
    frozen: frozenset[str] = frozenset()  # the parameters not saved (a frozen base)
    copies: int | None = None  # parallel.dp_sync=params: the devices' copies (data)


def layout(problem: Problem, engine: Engine, mesh: Mesh, zero: int, precision: Precision) -> Layout:
    """How `engine`'s state is saved and restored on `mesh`. Restore targets come from
    the model-layout plan of this run, never from the shardings a checkpoint was saved
    with, so any layout restores into any other."""
    shapes = jax.tree.map(lambda s: s.shape, problem.shapes)
    specs = plan(problem.names, shapes, zero=zero, mesh_shape=describe(mesh))
    watch = engine.state_shardings.window is not None
    model = state_lib.shardings(mesh, specs, engine.tx, problem.shapes, problem.trainable, watch)
    abstract = jax.tree.map(  # shapes alone: an offloaded state's also name host memory
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
        engine.init.eval_shape(jax.random.key(0)),
    )
    to_saved, from_saved, unstage = _converters(problem, engine, precision, abstract.window)
    on_device = jax.tree.map(
        lambda s: s.with_memory_kind("device"),
        engine.state_shardings,
        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
    )
    # Copies, never the state's own buffers, where the next step donates those while orbax
    # is still copying the saved ones off the device (jit would copy an unchanged leaf
    # anyway; the copy is explicit). A step that does not donate (checkpoint.every=1)
    # leaves the state's own leaves to orbax, where they are in the model's layout on the
    # device: no copy holds the loop.
    save_jit = jax.jit(lambda state: jax.tree.map(jnp.copy, to_saved(state)))
    as_they_are = not engine.donates and engine.layout is None
    as_they_are &= engine.state_shardings.compute is None  # (offload: in host memory)

    def to_saved_on_device(state: TrainState) -> dict:
        if as_they_are:
            return to_saved(state)
        # offloaded parts live in host memory: bring them over, then unstage
        return save_jit(jax.device_put(state, on_device))

    def fresh(params) -> TrainState:
        zero = jnp.zeros((), jnp.int32)
        opt = engine.tx.init(problem.trainable(params))
        saved = {"step": zero, "skipped": zero, "params": params, "opt": opt}
        if engine.spread is not None:
            saved["local"] = engine.spread(params)
        return from_saved(saved)

    def leaf_sum(k: str, x):  # of a stored leaf, in the model's layout (on the device)
        return base_lib.leaf_sum(unstage(k, jax.device_put(x, on_device.params[k])))

    def base_hash(state: TrainState) -> str:
        sums = {k: leaf_sum(k, state.params[k]) for k in problem.frozen}
        return base_lib.fingerprint(sums, problem.shapes)

    return Layout(
        to_saved=to_saved_on_device,
        from_saved=jax.jit(from_saved, out_shardings=engine.state_shardings),
        target=_targets(problem, engine, model, to_saved, abstract),
        params=jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            problem.shapes,
            model.params,
        ),
        shapes={k: list(v) for k, v in _flat(shapes).items()},
        fresh=jax.jit(fresh, out_shardings=engine.state_shardings),
        base_hash=base_hash,
        frozen=problem.frozen,
        copies=describe(mesh)["data"] if engine.spread is not None else None,
    )


def _converters(problem: Problem, engine: Engine, precision: Precision, window):
    """(to_saved, from_saved, unstage): the state in the run's layout (a pipeline's layer
    stack in stages) to the saved dict in the model's layout, and back (a spike window
    of `window`'s shape made empty where the saved dict has none)."""
    staged = engine.layout
    stack = set(problem.parts.stack_keys) if staged else set()
    keys = jax.tree_util.tree_map_with_path(lambda path, _: leaf_key(path), problem.shapes)

    def params_map(fn, tree_of_params_like):
        """Apply fn(key, leaf) to the params and every params-like part of the opt state."""
        return state_lib.map_params(
            engine.tx, lambda x, k: fn(k, x), tree_of_params_like, problem.trainable(keys)
        )

    def unstage(k, x):
        return pipeline.from_stages(staged, x) if k in stack else x

    def stage(k, x):
        return pipeline.to_stages(staged, x) if k in stack else x

    def to_saved(state: TrainState) -> dict:
        saved = {
            "step": state.step,
            "skipped": state.skipped,
            "params": {k: unstage(k, x) for k, x in problem.trainable(state.params).items()},
            "opt": params_map(unstage, state.opt) if staged else state.opt,
        }
        if state.local is not None:  # parameter averaging: each device's copy
            saved["local"] = state.local
        if state.window is not None:  # train.on_spike
            saved[WINDOW] = _fields(state.window)
        return saved

    dtype = DTYPES[precision]

    def from_saved(saved: dict) -> TrainState:
        params = {k: stage(k, x) for k, x in saved["params"].items()} if staged else saved["params"]
        compute = None
        if engine.state_shardings.compute is not None:
            compute = offload.compute_copy(params, dtype)
        return TrainState(
            step=saved["step"],
            params=params,
            opt=params_map(stage, saved["opt"]) if staged else saved["opt"],
            skipped=saved["skipped"],
            compute=compute,
            local=saved.get("local"),
            window=_window(saved.get(WINDOW), window),
        )

    return to_saved, from_saved, unstage


def _targets(problem: Problem, engine: Engine, model, to_saved, abstract) -> dict:
    """The saved dict as ShapeDtypeStructs with this run's shardings in the model's layout
    (`model`): what a restore reads into."""
    saved_shapes = jax.eval_shape(to_saved, abstract)
    saved_shardings = {
        "step": model.step,
        "skipped": model.skipped,
        "params": problem.trainable(model.params),
        "opt": model.opt,
    }
    if engine.spread is not None:
        saved_shardings["local"] = engine.state_shardings.local
    if model.window is not None:
        saved_shardings[WINDOW] = _fields(model.window)
    return jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
        saved_shapes,
        saved_shardings,
    )


def _fields(window: spikes.Window) -> dict:
    """A spike window as the plain dict a checkpoint holds."""
    return {f.name: getattr(window, f.name) for f in dataclasses.fields(window)}


def _window(saved: dict | None, like):
    """The run's spike window (None where it keeps none) from a checkpoint's (None where
    it was saved without one: empty, judged again from half full)."""
    if like is None:
        return None
    if saved is None:
        return spikes.empty(like.losses.shape[0])
    return spikes.Window(**saved)


def read_state(ckpts: Checkpoints, step: int, target: dict) -> dict:
    """Checkpoint `step`'s saved dict into `target`. A spike window is read where both
    keep one: a run that watches for spikes resumes from a checkpoint of a run that did
    not (an empty window), and the other way round (the saved window left unread)."""
    saved = ckpts.saved_tree(step)
    if WINDOW in target and WINDOW not in saved:
        target = {k: v for k, v in target.items() if k != WINDOW}
    elif WINDOW in saved and WINDOW not in target:
        like = target["step"].sharding  # replicated, as a window is
        target = {
            **target,
            WINDOW: jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=like),
                saved[WINDOW],
                is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"),
            ),
        }
        return {k: v for k, v in ckpts.restore(step, target).items() if k != WINDOW}
    return ckpts.restore(step, target)


def _flat(tree) -> dict:
    return {
        leaf_key(path): x
        for path, x in jax.tree_util.tree_leaves_with_path(
            tree, is_leaf=lambda x: isinstance(x, tuple)
        )
    }


def _state_handler(compress: bool, own: ocp.options.MultiprocessingOptions | None = None):
    """orbax's StandardCheckpointHandler, its arrays zstd-compressed only if `compress`
    (orbax's default is on: float weights shrink by under a tenth, and the save's CPU
    time grows about 4x, taken from the steps an asynchronous save runs beside; a
    restore reads either). It writes a replicated array's replicas in parallel (each a
    slice of it) only where several processes share the writing. In one process every
    replica is on this host: the slices would cost a compiled program per leaf and slice
    (200 on a small run's first save) and parallelise nothing. The files are the same
    either way (tests/test_checkpoint.py holds orbax's internals to it). `own`: a
    process's checkpoint of its own (OwnCheckpoints), every array written by it alone."""
    mp = {} if own is None else {"multiprocessing_options": own}
    handler = ocp.StandardCheckpointHandler(**mp)
    registry = {}
    if jax.process_count() == 1 or own is not None:
        types = ocp.type_handlers
        store = types.get_type_handler(jax.Array)._array_metadata_store
        alone = {} if own is None else {"primary_host": None, "replica_id": None}
        whole = types.ArrayHandler(use_replica_parallel=False, array_metadata_store=store, **alone)
        # made with it in place (orbax's add(..., override=True) logs a WARNING to the
        # console of every run that saves)
        handlers = (
            (t, whole if issubclass(t, jax.Array) else types.get_type_handler(t))
            for t in types.supported_types()
        )
        registry = {"type_handler_registry": types.create_type_handler_registry(*handlers)}
    handler._impl = ocp.PyTreeCheckpointHandler(  # as orbax makes it, with these options
        save_concurrent_gb=96, restore_concurrent_gb=96, use_compression=compress, **registry, **mp
    )
    return handler


class Checkpoints:
    """The checkpoints of one run directory (an orbax CheckpointManager)."""

    def __init__(
        self, directory: Path, keep: int = 3, *, create: bool = True, compress: bool = False
    ):
        self.directory = Path(directory).absolute()
        # the last save started, its bytes, and whether a save met a full disk (reported)
        self.in_flight, self.needed, self.failed = None, None, False
        _check_directory(self.directory, create)
        _orbax_errors_unlogged()
        _echoes_unraised()
        try:
            self.manager = self._manager(keep, create, compress)
        except Exception as e:  # orbax's many errors, reported as one line
            raise CheckpointError(
                f"checkpoint.dir={self.directory}: cannot be opened ({_first_line(e)})"
            ) from None

    def _manager(self, keep: int, create: bool, compress: bool, own=None) -> ocp.CheckpointManager:
        """orbax's manager of the folder; `own`: the multiprocessing options of a process's
        own (OwnCheckpoints), whose folders each process makes, as orbax's emergency
        checkpointing makes its local tier's."""
        mp = {} if own is None else {"multiprocessing_options": own}
        if own is not None and create:  # (orbax makes the folder only for all processes)
            self.directory.mkdir(parents=True, exist_ok=True)
        return ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=True,
                create=create and own is None,
                cleanup_tmp_directories=create,  # saves cut short by a kill
                enable_per_process_directory_creation=own is not None,
                **mp,
            ),
            item_handlers={
                STATE: _state_handler(compress, own),
                META: ocp.JsonCheckpointHandler(**mp),
            },
        )

    @property
    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, saved: dict, meta: dict) -> None:
        """Start saving (returns once the arrays are copied off the device; the writing
        goes on in the background). A full disk, met by this save or by the one before
        it, is DiskFull's one line."""
        self.needed = sum(x.nbytes for x in jax.tree.leaves(saved))
        # orbax first waits for the save before, whose failure is met here
        with self._writing(f"checkpoint {self.in_flight or step}"):
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    **{STATE: ocp.args.StandardSave(saved), META: ocp.args.JsonSave(meta)}
                ),
                force=True,
            )
        self.in_flight = step

    def wait(self) -> None:
        with self._writing(f"checkpoint {self.in_flight}"):
            self.manager.wait_until_finished()

    def complete(self) -> list[int]:
        """The steps whose checkpoints are whole (orbax renames a step's folder to its
        number once it is), read from the folder."""
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())

    @contextlib.contextmanager
    def _writing(self, what: str):
        """A full disk met in the block: DiskFull's line, naming the step to resume from."""
        try:
            yield
        except Exception as e:
            if not disk.is_full(e):
                raise
            self.failed = True  # reported once: orbax's threads say it again, unheard
            _quiet_the_reads_in_flight()
            done = self.complete()
            then = (
                f"free space (or lower checkpoint.keep, or give another checkpoint.dir), then "
                f"run the same command again: it resumes from step {done[-1]}, the newest "
                "whole checkpoint"
                if done
                else "free space, or give another checkpoint.dir, then run the same command again"
            )
            raise disk.full(self.directory, what, then, self.needed) from None

    def meta(self, step: int) -> dict:
        return self._restore(step, **{META: ocp.args.JsonRestore()})[META]

    def restore(self, step: int, target) -> dict:
        return self._restore(step, **{STATE: ocp.args.StandardRestore(target)})[STATE]

    def saved_tree(self, step: int):
        """The saved state's tree of array metadata (shape, dtype), read without a model."""
        return self._read(step, lambda: self.manager.item_metadata(step)[STATE].tree)

    def _restore(self, step: int, **items):
        return self._read(
            step, lambda: self.manager.restore(step, args=ocp.args.Composite(**items))
        )

    def _read(self, step: int, read: Callable[[], Any]):
        _quiet_the_reads_in_flight()
        try:
            if not (self.directory / str(step) / STATE / "_METADATA").is_file():
                raise FileNotFoundError(f"{STATE}/_METADATA (orbax's index of it) is missing")
            return read()
        except Exception as e:  # a corrupt or foreign checkpoint: one line, no traceback
            error = CheckpointError(
                f"checkpoint {self.directory / str(step)}: cannot be read ({_cause(e)}); "
                "move it away (or use --restart) to start fresh"
            )
            if not (self.directory / str(step)).exists():  # rotated away as it was read
                error = CheckpointError(
                    f"checkpoint {self.directory / str(step)}: was removed while it was read "
                    "(a run still writing there keeps its newest checkpoint.keep); run the "
                    "command again to read the newest"
                )
        _collect_orbax_leftovers()
        raise error

    def close(self) -> None:
        if self.failed:  # its failure is on its way out already
            with contextlib.suppress(Exception):
                self.manager.close()
            _collect_orbax_leftovers()
            return
        self.wait()
        self.manager.close()


def _collect_orbax_leftovers() -> None:
    """The failed read's or write's coroutines that were never awaited, collected now,
    unsaid (at the interpreter's exit they would each print a traceback)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
        gc.collect()


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _cause(e: BaseException) -> str:
    """The first failure under orbax's wrappers, in one line: TensorStore's own words
    (which file, what is wrong with it), without the spec it appends."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = _first_line(e)
    for tail in (" [tensorstore_spec", " See full TensorStore details"):
        text = text.split(tail)[0]
    return text


def _echo(value: BaseException | None, tb) -> bool:
    """An orbax read's failure, or its callback finding orbax's event loop closed."""
    frames = traceback.extract_tb(tb)
    closed = isinstance(value, RuntimeError) and str(value) == "Event loop is closed"
    return any(f"{os.sep}orbax{os.sep}" in f.filename for f in frames) or (
        closed and all(f"{os.sep}asyncio{os.sep}" in f.filename for f in frames)
    )


def _orbax_coroutine(obj) -> bool:
    """A coroutine of orbax's (one a failed read left never awaited)."""
    code = getattr(obj, "cr_code", None)
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def _quiet_the_reads_in_flight() -> None:
    """When a restore fails, orbax's other reads still in flight fail as they land (their
    event loop closed, their results never collected, their coroutines never awaited),
    and each reports the same broken checkpoint with a traceback, from the moment of the
    failure to the interpreter's exit. The failure is reported once, as a
    CheckpointError: from the first restore on, drop those echoes (tracebacks through
    orbax, or of asyncio's closed loop alone, or an orbax coroutine's "never awaited")."""
    _echoes_unraised()
    if getattr(sys.excepthook, "quiets_orbax", False):
        return

    def excepthook(kind, value, tb, previous=sys.excepthook):
        if not _echo(value, tb):
            previous(kind, value, tb)

    excepthook.quiets_orbax = True
    sys.excepthook = excepthook
    logging.getLogger("asyncio").addFilter(
        lambda record: not (record.exc_info and _echo(*record.exc_info[1:]))
    )


def _echoes_unraised() -> None:
    """Orbax's echoes of a failure, as the interpreter reports what it cannot raise, are
    dropped: from the moment a checkpoint folder is opened, since a failed write's
    callbacks (finding orbax's event loop closed) land from TensorStore's threads before
    the save that meets the failure raises it."""
    if getattr(sys.unraisablehook, "quiets_orbax", False):
        return

    def unraisable(u, previous=sys.unraisablehook):
        if not (_echo(u.exc_value, u.exc_traceback) or _orbax_coroutine(u.object)):
            previous(u)

    unraisable.quiets_orbax = True
    sys.unraisablehook = unraisable


def _orbax_errors_unlogged() -> None:
    """Orbax's background threads log a failed write as ERROR lines (its words, its
    paths, several times over) before the save or wait that meets it raises; the raise
    is the report, so those lines are dropped."""
    absl = logging.getLogger("absl")
    if not any(getattr(f, "orbax_errors", False) for f in absl.filters):
        drop = lambda r: not (r.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in r.pathname)  # noqa: E731
        drop.orbax_errors = True
        absl.addFilter(drop)


def _check_directory(directory: Path, create: bool) -> None:
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(
            f"checkpoint.dir={directory}: is a file, not a directory; remove it or give "
            "another checkpoint.dir"
        )
    if directory.is_dir() and not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        raise CheckpointError(
            f"checkpoint.dir={directory}: cannot be read and written by this user; fix its "
            "permissions or give another checkpoint.dir"
        )
    if not directory.exists() and not create:
        raise CheckpointError(f"{directory}: no such checkpoint directory")


def _seen_by_all(directory: Path) -> bool:
    """Whether every process of the run sees what process 0 writes in `directory` (one
    host's /dev/shm for the processes of that host; a folder of each host's own for a run
    over many hosts)."""
    if jax.process_count() == 1:
        return True
    directory.mkdir(parents=True, exist_ok=True)
    token = int(multihost_utils.broadcast_one_to_all(np.int32(np.random.randint(2**31 - 1))))
    mark = directory / f".jaxpar-tier-{token}"
    if jax.process_index() == 0:
        mark.touch()
    multihost_utils.sync_global_devices("jaxpar local tier marked")
    seen = multihost_utils.process_allgather(np.array([mark.exists()]))
    multihost_utils.sync_global_devices("jaxpar local tier read")
    if jax.process_index() == 0:
        mark.unlink()
    return bool(np.all(seen))


OWN = "process-{}"  # a process's folder of its own, in a local tier of each host's own


class OwnCheckpoints(Checkpoints):
    """A local tier of each host's own (checkpoint.local_dir, where not every process of
    the run sees what process 0 writes there): each process saves the pieces of the state
    on its own devices, one copy of each, into a folder of its own, process-N, with
    orbax's process-local options (each process its own primary host, as orbax's
    emergency checkpointing saves its local tier). A resume reads it only where every
    process of the run holds the step, saved by as many processes, on the same devices, in
    the same parallel.* layout; otherwise (a host lost with its tier, an elastic restart
    on fewer processes) from the shared tier."""

    def __init__(self, directory: Path, keep: int, *, compress: bool, placement: dict):
        self.placement = placement
        index = jax.process_index()
        self.own = ocp.options.MultiprocessingOptions(
            primary_host=None, active_processes={index}, barrier_sync_key_prefix=OWN.format(index)
        )
        super().__init__(Path(directory) / OWN.format(index), keep, compress=compress)
        self.agreed, self.latest_saved = self._agreed(), None

    def _manager(self, keep: int, create: bool, compress: bool, own=None):
        return super()._manager(keep, create, compress, self.own)

    @property
    def latest(self) -> int | None:
        """The newest step every process holds, placed as this run places it."""
        return self.agreed

    def _agreed(self) -> int | None:
        """The newest step every process holds, placed as now; the others' folders' own
        steps that not all hold, or placed otherwise, are deleted."""
        mine = [s for s in self.complete() if self.meta(s).get("placement") == self.placement]
        slots = np.full(64, -1, np.int32)  # the newest 64 (a tier keeps checkpoint.keep)
        slots[: len(mine[-64:])] = mine[-64:]
        held = np.asarray(multihost_utils.process_allgather(slots)).reshape(-1, 64)
        common = set.intersection(*(set(row[row >= 0].tolist()) for row in held))
        for step in set(self.complete()) - common:  # of no use, and in the way of the saves
            self.manager.delete(step)  # (of this step again, from an older checkpoint)
        return max(common, default=None)

    def save(self, step: int, saved: dict, meta: dict) -> None:
        if self.latest_saved is None:  # the layout is the run's: checked once
            for path, x in jax.tree_util.tree_leaves_with_path(saved):
                _held_whole(leaf_key(path), x)
        super().save(step, saved, {**meta, "placement": self.placement})
        self.latest_saved = step


def _held_whole(key: str, x: jax.Array) -> None:
    """orbax writes, of a process's own, the pieces of one copy (its first device's): a
    layout where this process holds a piece only in another copy would be read back
    without it, so it is refused before the first save."""
    first = x.addressable_shards[0].replica_id
    written = {str(s.index) for s in x.addressable_shards if s.replica_id == first}
    if written != {str(s.index) for s in x.addressable_shards}:
        raise ConfigError(
            f"checkpoint.local_dir: {key} is laid out so that process {jax.process_index()} "
            "holds some of its pieces only in other copies than its first device's, which a "
            "tier of each host's own does not write; give checkpoint.local_dir a folder every "
            "process sees, or drop it"
        )


def meta(cfg: Config, mesh: Mesh, ckpt: Layout, step: int, base: dict | None = None) -> dict:
    """What a checkpoint says of itself; `base`: its frozen base's reference (where from,
    fingerprint), for a run that has one."""
    out = {"config": to_dict(cfg), "mesh": describe(mesh), "shapes": ckpt.shapes, "step": step}
    return out if base is None else {**out, "base": base}


def frozen_base(ckpt: Layout, problem: Problem, params: Callable | None, seed: int) -> dict:
    """The frozen parameters of a fresh run, in the model's layout and `ckpt`'s shardings:
    from `params` (as jaxpar.training.trainer.train takes it), else the problem's own
    init from `seed`."""
    if params is not None:
        made = params(ckpt.params)
        return {k: made[k] for k in ckpt.frozen}
    shardings = {k: ckpt.params[k].sharding for k in ckpt.frozen}

    def init(key):
        return {k: v for k, v in problem.init(key).items() if k in ckpt.frozen}

    return jax.jit(init, out_shardings=shardings)(jax.random.key(seed))


def check_compatible(saved_meta: dict, ckpt: Layout, where: Path) -> None:
    """A checkpoint of another model is refused, naming the first parameter that differs;
    so is one whose per-device copies (parameter averaging) this run cannot take."""
    averaged = saved_meta["config"]["parallel"].get("dp_sync") == "params"
    copies = saved_meta["mesh"]["data"] if averaged else None
    if copies != ckpt.copies:

        def what(n):
            return "parallel.dp_sync=grads" if n is None else f"dp_sync=params over data={n}"

        raise CheckpointError(
            f"checkpoint {where}: saved with {what(copies)}, but this run has "
            f"{what(ckpt.copies)}: each device's own copy and optimizer state cannot move to "
            "another count of copies or to gradient sync; resume with the same parallel.dp_sync "
            "and parallel.data, or export its parameters (jaxpar export) and start from them"
        )
    saved, now = saved_meta["shapes"], ckpt.shapes
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            was = saved.get(key, "absent")
            is_ = now.get(key, "absent")
            raise CheckpointError(
                f"checkpoint {where}: parameter {key} is {was} there but {is_} in this run, "
                "so it was saved from another model; use the model.* it was saved with "
                "(its config is in the checkpoint's meta), or --restart to set it aside"
            )


def restore(directory: Path, problem: Problem, cfg: Config, mesh=None, step: int | None = None):
    """The TrainState of a checkpoint directory (the latest step, or `step`) under `cfg`
    and `mesh` (default: all devices), whatever layout it was saved from."""
    mesh = build_mesh(cfg.parallel) if mesh is None else mesh
    engine = build(problem, cfg, mesh)
    ckpts = Checkpoints(Path(directory), create=False)
    step = ckpts.latest if step is None else step
    if step is None:
        raise CheckpointError(f"{ckpts.directory}: no complete checkpoint there")
    ckpt = layout(problem, engine, mesh, cfg.parallel.zero, cfg.train.precision)
    saved_meta, where = ckpts.meta(step), ckpts.directory / str(step)
    check_compatible(saved_meta, ckpt, where)
    base = frozen_base(ckpt, problem, None, cfg.train.seed) if ckpt.frozen else {}
    if ckpt.frozen:
        base_lib.check(saved_meta.get("base"), base_lib.of(base), where)
    restored = read_state(ckpts, step, ckpt.target)
    return ckpt.from_saved({**restored, "params": {**base, **restored["params"]}})


def _local_tier(checkpoint: CheckpointKeys, parallel: Parallel) -> Checkpoints:
    """checkpoint.local_dir's checkpoints: one for all processes where all see the folder
    (each process writing its shards into it), else each process's own."""
    folder = Path(checkpoint.local_dir)
    if _seen_by_all(folder):
        return Checkpoints(folder, checkpoint.keep, compress=checkpoint.compress)
    placement = {
        "processes": jax.process_count(),
        "devices": [d.id for d in jax.local_devices()],
        "parallel": to_dict(parallel),
    }
    keep, compress = checkpoint.keep, checkpoint.compress
    return OwnCheckpoints(folder, keep, compress=compress, placement=placement)


class Saver:
    """A run's checkpoints: resumed from if there are any, saved into every
    checkpoint.every steps; at the end (checkpoint.final), and at a stop (a signal, a
    non-finite step, diverged replicas) whatever the keys say, when there is a place for
    them. With checkpoint.local_dir, two tiers: the saves every checkpoint.every steps go
    to the local one, those every checkpoint.shared_every steps and the last to the
    shared one (`directory`), and a run resumes from the newer. Opened when first needed;
    closed (pending writes finished) on any exit."""

    def __init__(self, cfg: Config, directory: Path | None):
        self.cfg, self.directory = cfg, directory
        self.ckpts = self.local = None  # the shared tier (`directory`), the local one
        ckpt = cfg.checkpoint
        if ckpt.local_dir and directory is None:
            raise ConfigError(
                f"checkpoint.local_dir={ckpt.local_dir}: the local tier sits beside a shared "
                "one, and this run has none; give it a place (--out, train(..., out_dir=...) "
                "or checkpoint.dir)"
            )
        if directory and (ckpt.every or directory.exists()):
            self._open()
        if ckpt.local_dir:
            self.local = given(_local_tier, cfg)
        self.held = {}  # step -> the tier this run saved it to
        self.latest = max((t.latest for t in self._tiers() if t.latest is not None), default=None)
        self.newest = self.latest  # the newest step saved (or found)
        self.base = None  # a frozen base's reference (jaxpar.adapters.base), saved in meta
        self.rows: list[dict] = []  # the run's metrics rows so far (MetricsLog.rows)
        self.rows_through = None  # the resumed checkpoint's: its last metrics row's step
        self.position = None  # step -> the data's position then (jaxpar.data.feed)

    def _open(self) -> None:
        ckpt = self.cfg.checkpoint
        self.ckpts = Checkpoints(self.directory, ckpt.keep, compress=ckpt.compress)

    def _tiers(self) -> list[Checkpoints]:
        return [t for t in (self.ckpts, self.local) if t is not None]

    def _holding(self, step: int) -> Checkpoints:
        """The tier that holds `step` (the shared one where both or neither do)."""
        if step in self.held:
            return self.held[step]
        found = [t for t in self._tiers() if step in t.complete()]
        return found[0] if found else self.ckpts

    @property
    def opened(self) -> bool:
        return self.ckpts is not None

    def where(self, step: int) -> Path:
        return self._holding(step).directory / str(step)

    def meta(self, step: int) -> dict:
        return self._holding(step).meta(step)

    def wait(self) -> None:
        """Until the saves in flight are written."""
        for tier in self._tiers():
            tier.wait()

    def bind(self, problem: Problem, engine, mesh) -> None:
        self.mesh = mesh
        self.layout = layout(
            problem, engine, mesh, self.cfg.parallel.zero, self.cfg.train.precision
        )

    def restore(self, step: int, base: dict):
        """The state saved at `step`, its frozen parameters `base` (checked against the
        checkpoint's fingerprint of them)."""
        tier = self._holding(step)
        saved_meta, where = tier.meta(step), tier.directory / str(step)
        check_compatible(saved_meta, self.layout, where)
        self.rows_through = saved_meta.get("rows_through")
        if self.layout.frozen:
            base_lib.check(saved_meta.get("base"), base_lib.of(base), where)
            self.base = saved_meta["base"]
        restored = read_state(tier, step, self.layout.target)
        state = self.layout.from_saved({**restored, "params": {**base, **restored["params"]}})
        if self.cfg.train.on_nonfinite is OnNonfinite.STOP:  # a save that raced a halt
            state = state.replace(skipped=state.skipped * 0)
        return state

    def save(self, state, step: int, shared: bool = False) -> None:
        """Start saving (returns once the state is copied off the device): to the local
        tier, where there is one, unless `shared` or checkpoint.shared_every asks for the
        shared one."""
        if self.ckpts is None:
            self._open()
        saved = meta(self.cfg, self.mesh, self.layout, step, self.base)
        # the step of the last metrics row written before it: a resume finds it in the file
        saved["rows_through"] = max((r["step"] for r in self.rows if r["step"] <= step), default=0)
        if self.position is not None:  # the data's (jaxpar.data.feed), for a resume
            saved["data"] = self.position(step)
        local = self.local and not shared and step % self.cfg.checkpoint.shared_every
        tier = self.local if local else self.ckpts
        for other in self._tiers():  # one save in flight at a time, as with one tier
            if other is not tier:  # (two of orbax's managers meet at the same barriers)
                other.wait()
        tier.save(step, self.layout.to_saved(state), saved)
        self.held[step], self.newest = tier, step

    def finish(self, loop, start: int):
        """The state to return after `loop` (jaxpar.training.trainer.Loop), saved where it
        ought to be."""
        state = loop.state
        if self.directory is None:
            return state
        if loop.nonfinite is not None:
            # the state is the last good one: drop saves of it made after the halt (their
            # labels ran ahead of it), then save it under its own step
            self.wait()
            for late in sorted(s for s in loop.saved if s >= loop.end):
                self._holding(late).manager.delete(late)
            loop.saved = {s for s in loop.saved if s < loop.end}
            state = state.replace(skipped=state.skipped * 0)
        ckpt = self.cfg.checkpoint
        wanted = (
            ckpt.every
            or ckpt.final
            or loop.stopped
            or loop.nonfinite is not None
            or loop.diverged
            or loop.failed is not None
        )
        only_local = self.local is not None and self.held.get(loop.end) is self.local
        if wanted and loop.end != start and (loop.end not in loop.saved or only_local):
            self.save(state, loop.end, shared=True)  # the last state: on the shared tier too
        return state

    def __enter__(self) -> Saver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Finish the writes in flight, each tier's."""
        for tier in self._tiers():
            tier.close()


def saved_params(directory: Path, step: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """(the parameters of a checkpoint as host arrays by key, its meta), read without
    knowing the model: shapes and dtypes from the checkpoint itself."""
    ckpts = Checkpoints(directory, create=False)
    steps = sorted(ckpts.manager.all_steps())
    if not steps:
        raise CheckpointError(f"{ckpts.directory}: no complete checkpoint there")
    if step is not None and step not in steps:
        raise CheckpointError(
            f"--step {step}: no complete checkpoint of that step in {ckpts.directory}; "
            f"it holds {', '.join(map(str, steps))} (the newest is taken without --step)"
        )
    step = steps[-1] if step is None else step
    tree = ckpts.saved_tree(step)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),
        tree,
        is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"),
    )
    state = ckpts.restore(step, target)
    return {k: np.asarray(v) for k, v in _flat(state["params"]).items()}, ckpts.meta(step)
