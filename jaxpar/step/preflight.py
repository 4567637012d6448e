"""Will the step fit in memory? Checked twice before the first step: before compiling
(the model state alone, by the ZeRO formula: a lower bound) and after (the compiled
step's own buffer sizes), against what this host or device has. A step that cannot fit
is refused with the estimate and the settings that would shrink it; `force` runs it
anyway.

On the CPU every simulated device of a process shares the host's memory, so a process
needs its per-device figure times its devices; a GPU or TPU has its own memory.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax

from jaxpar.config.sections import Config, Offload, Parallel, Remat, Train
from jaxpar.cost import formulas as cost
from jaxpar.cost.report import human_bytes
from jaxpar.errors import ConfigError
from jaxpar.parallel.axes import DATA
from jaxpar.parallel.batches import batch_split


@dataclass(frozen=True)
class Budget:
    bytes_per_device: int  # what one device may use
    what: str  # where that figure comes from, for the message
    devices: int  # devices sharing it (the CPU's simulated devices share the host)


def host_available() -> int:
    """Bytes the host can still give (MemAvailable; else all physical memory)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budget() -> Budget | None:
    """This process's memory per device (None: the backend does not say)."""
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        n = jax.local_device_count()
        return Budget(host_available() // n, f"available host memory / {n} CPU devices", n)
    limit = (device.memory_stats() or {}).get("bytes_limit")
    what = f"{device.device_kind} memory"
    if device.platform == "gpu":  # JAX's allocator takes a share of the card, not all
        share = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ".75")
        what += f" JAX takes (XLA_PYTHON_CLIENT_MEM_FRACTION={share} of it; .95 leaves room)"
    return Budget(int(limit), what, 1) if limit else None


def check_state(cfg: Config, engine, mesh_shape: dict, force: bool) -> None:
    """Before compiling: the model state and gradients alone must fit (the whole config:
    the last release's jaxpar.preflight.check_state takes it so)."""
    par, train = cfg.parallel, cfg.train
    have = budget()
    if force or have is None:
        return
    leaves, problem = engine.leaves, engine.problem
    psi = cost.params_per_device(leaves)
    offloaded = par.offload is not Offload.NONE
    state = 0 if offloaded else cost.problem_state(par, train, leaves, problem, mesh_shape)
    need = state + cost.grad_bytes(problem.trainable(leaves))
    if need > have.bytes_per_device:
        raise ConfigError(
            f"memory: the parameters, gradients and Adam state alone need "
            f"{human_bytes(need)} per device ({psi:.3g} parameters per device), more than "
            f"the {human_bytes(have.bytes_per_device)} of {have.what}; "
            + "try parallel.zero=3 (split over data), more devices, or a smaller model; "
            "--force runs it anyway (the system may kill it)"
        )


def step_bytes(compiled) -> int:
    """Per-device bytes of a compiled step: arguments, outputs (less what they alias) and
    temporaries; on the CPU its host buffers too (the same memory)."""
    stats = compiled.memory_analysis()
    kinds = ("",) + (("host_",) if jax.local_devices()[0].platform == "cpu" else ())
    return sum(
        getattr(stats, f"{k}argument_size_in_bytes")
        + getattr(stats, f"{k}output_size_in_bytes")
        - getattr(stats, f"{k}alias_size_in_bytes")
        + getattr(stats, f"{k}temp_size_in_bytes")
        for k in kinds
    )


def check_compiled(
    cfg: Config,
    compiled,
    mesh_shape: dict,
    force: bool,
    need_of: Callable[[Config], int],
    compile_s: float,
) -> None:
    """After compiling: its arguments, outputs and temporaries must fit. If not, the
    settings that would shrink it are compiled too (`need_of(cfg)` -> bytes), when the
    first compile was quick, so that the message says which of them fit."""
    have = budget()
    if force or have is None:
        return
    need = step_bytes(compiled)
    if need <= have.bytes_per_device:
        return
    temp = compiled.memory_analysis().temp_size_in_bytes
    shared = (
        f", x {have.devices} devices = {human_bytes(need * have.devices)}"
        if have.devices > 1
        else ""
    )
    raise ConfigError(
        f"memory: the compiled step needs {human_bytes(need)} per device (of it "
        f"{human_bytes(temp)} activations and temporaries{shared}), more than the "
        f"{human_bytes(have.bytes_per_device)} per device of {have.what}. "
        + _tried(
            cfg.train,
            cfg.parallel,
            mesh_shape,
            lambda t, p: need_of(dataclasses.replace(cfg, train=t, parallel=p)),
            have.bytes_per_device,
            compile_s,
        )
        + "; --force runs it anyway (the system may kill it)"
    )


SEARCH_S = 60  # at most this long compiling alternatives for the message


def _tried(train: Train, par: Parallel, mesh_shape: dict, need_of, have: int, compile_s) -> str:
    """Alternatives compiled and measured (need_of(train, parallel) -> bytes), cheapest
    change first; which fit."""
    alternatives = _alternatives(train, par, mesh_shape)
    if compile_s * len(alternatives) > SEARCH_S:
        return "Try " + ", ".join(label for label, *_ in alternatives)
    fit, too_big, start = [], [], time.perf_counter()
    for label, *changed in alternatives:
        if time.perf_counter() - start > SEARCH_S:
            break
        if fit and label.split("=")[0] in (f.split("=")[0] for f in fit):
            continue  # a smaller step of a knob that already fits
        bytes_ = need_of(*changed)
        (fit if bytes_ <= have else too_big).append(f"{label} ({human_bytes(bytes_)})")
    found = f"Compiled and fits: {', '.join(fit)}" if fit else "None of these fits either"
    return found + (f"; too big still: {', '.join(too_big)}" if too_big else "")


def _alternatives(train: Train, par: Parallel, mesh_shape: dict) -> list[tuple]:
    """(override, train, parallel): more accumulation (same batch, fewer rows at once), a
    smaller batch, recomputed activations, ZeRO-3."""
    data = mesh_shape[DATA]
    out = []
    for factor in (2, 4, 8):
        changed = dataclasses.replace(train, grad_accum=train.grad_accum * factor)
        if _splits(changed, par, mesh_shape):
            out.append((f"train.grad_accum={changed.grad_accum}", changed, par))
    for factor in (2, 4):
        changed = dataclasses.replace(train, batch_size=train.batch_size // factor)
        if changed.batch_size and _splits(changed, par, mesh_shape):
            out.append((f"train.batch_size={changed.batch_size}", changed, par))
    if par.remat is Remat.NONE:
        out.append(("parallel.remat=full", train, dataclasses.replace(par, remat="full")))
    if par.zero < 3 and data > 1:
        out.append(("parallel.zero=3", train, dataclasses.replace(par, zero=3)))
    return out


def _splits(train, parallel, mesh_shape: dict) -> bool:
    try:
        batch_split(train, parallel, mesh_shape)
    except ConfigError:
        return False
    return True
