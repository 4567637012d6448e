"""The one device mesh: axes `replica`, `data`, `expert`, `pipeline`, `context`, `tensor`
(outermost to innermost)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar.errors import ConfigError
from jaxpar.parallel.axes import AXES, CONTEXT, DATA, OPTIONAL_AXES, PIPE, REPLICA, TENSOR

if TYPE_CHECKING:
    from jaxpar.config.sections import Parallel


def resolve_degrees(parallel: Parallel, devices: int) -> dict[str, int]:
    """Degrees per axis with -1 filled in; the product must equal the device count."""
    degrees = {axis: getattr(parallel, axis) for axis in AXES}
    rest = [a for a, d in degrees.items() if d == -1]
    if len(rest) > 1:
        raise ConfigError(
            f"parallel.{rest[0]} and parallel.{rest[1]} are both -1: at most one "
            "degree may take the remaining devices"
        )
    fixed = math.prod(d for d in degrees.values() if d != -1)
    shown = " * ".join(f"{a}({d})" for a, d in degrees.items() if a not in OPTIONAL_AXES or d != 1)
    if rest:
        if devices % fixed:
            raise ConfigError(
                f"parallel.{rest[0]}=-1: {shown} cannot fill {devices} devices "
                f"because {fixed} does not divide {devices}; choose degrees whose "
                f"product divides {devices}"
            )
        degrees[rest[0]] = devices // fixed
    elif fixed != devices:
        raise ConfigError(
            f"parallel degrees: {shown} = {fixed} != {devices} devices; make the "
            f"product {devices}, or set one degree to -1"
        )
    return degrees


def build_mesh(parallel: Parallel, devices: list | None = None) -> Mesh:
    """The mesh over all (or the given) devices, with Auto axis types.

    Auto (not Explicit) because the step mixes compiler-placed collectives (tensor
    parallel) with hand-placed ones inside shard_map (the ZeRO reductions), and the
    sharding rules, not per-op annotations, decide placement.
    """
    devices = list(jax.devices()) if devices is None else devices
    degrees = resolve_degrees(parallel, len(devices))
    shape = tuple(degrees[a] for a in AXES)
    types = (AxisType.Auto,) * len(AXES)
    if len({d.process_index for d in devices}) == 1:
        return jax.make_mesh(shape, AXES, axis_types=types, devices=devices)
    # Many processes: each one's devices side by side, processes outermost (on `replica`,
    # then `data`), so the slow links between hosts carry data parallelism only, and with
    # replica = processes only the replicas' reduction of 1/data of the gradients.
    _check_inside_process(degrees, len(devices) // len({d.process_index for d in devices}))
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(ordered).reshape(shape), AXES, axis_types=types)


def _check_inside_process(degrees: dict[str, int], local: int) -> None:
    inner = degrees[PIPE] * degrees[CONTEXT] * degrees[TENSOR]
    shown = f"parallel.pipeline({degrees[PIPE]}) * parallel.tensor({degrees[TENSOR]})"
    if degrees[CONTEXT] > 1:
        shown += f" * parallel.context({degrees[CONTEXT]})"
    if inner <= local and local % inner:
        raise ConfigError(
            f"{shown} = {inner} does not divide the {local} devices of a process, so some "
            "pipeline, context or tensor groups would span two processes (slow links) "
            f"although they need not; choose degrees whose product divides {local}"
        )
    if inner > local and jax.process_index() == 0:
        print(
            f"jaxpar: note: {shown} = {inner} is more than the {local} devices of a process: "
            "those collectives cross processes"
        )
    group = degrees[DATA] * inner
    if degrees[REPLICA] > 1 and inner <= local < group and jax.process_index() == 0:
        print(
            f"jaxpar: note: a ZeRO group, data({degrees[DATA]}) * pipeline * context * tensor "
            f"= {group}, "
            f"is more than the {local} devices of a process: its reductions cross processes; "
            f"parallel.replica={degrees[REPLICA] * group // local} keeps each group in one"
        )


def by_hand(mesh: Mesh, axes) -> set[str]:
    """The axes a shard_map over `mesh` is manual over: `axes`, and every other axis of
    degree 1 (nothing to place there). Over a mesh left partly to the compiler, jax
    constrains every op's result in the body to the compiler's axes, open; manual over
    the whole mesh it annotates none (gemma3-tiny's step over data=8: 2,631 of its
    9,764 lines, a fifth of its compile time)."""
    return set(axes) | {a for a in mesh.axis_names if mesh.shape[a] == 1}


def describe(mesh: Mesh) -> dict[str, int]:
    return {axis: int(mesh.shape[axis]) for axis in mesh.axis_names}


def accelerator_installed() -> bool:
    """Whether a GPU/TPU plugin for jax is installed (checked without starting jax)."""
    from importlib.metadata import distributions

    names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in distributions()}
    return any(n.startswith(("jax-cuda", "jax-rocm", "libtpu")) for n in names)


def jax_started() -> bool:
    """Whether jax has started its backends in this process (its devices then fixed)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def use_cpu_devices(n: int) -> None:
    """Simulate n devices on the CPU. Must run before jax starts its backends."""
    if jax_started():
        have = jax.device_count()
        if have != n or jax.devices()[0].platform != "cpu":
            raise ConfigError(
                f"{n} simulated CPU devices asked for, but jax already started in this "
                f"process with {have} {jax.devices()[0].platform} device(s): call "
                f"jaxpar.mesh.use_cpu_devices({n}) before anything touches jax (jax.devices(), "
                "an array, a jit), or pass --cpu-devices to the jaxpar command"
            )
        return
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def serving_layout(model, devices: int) -> tuple[int, int]:
    """(data, tensor) for a forward pass alone on `devices` (decoding, scoring): tensor is
    the most devices that divide the model's heads, key/value heads, MLP width and
    vocab; the rest split the rows over data."""
    split = [model.heads, getattr(model, "kv_heads", model.heads), model.mlp, model.vocab]
    tensor = max(
        t for t in range(1, devices + 1) if devices % t == 0 and not any(n % t for n in split)
    )
    return devices // tensor, tensor
