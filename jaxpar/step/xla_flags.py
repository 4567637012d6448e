"""The XLA flags jaxpar compiles a GPU step with, and the user's word over them.

On a GPU the step is compiled with the flags NVIDIA's JAX-Toolbox and MaxText set for
LLM training: the latency-hiding scheduler (collectives overlap compute), the
collectives on their own high-priority stream, all-gathers and reduce-scatters
pipelined across the layer loop (ZeRO-3's gathers hide behind the previous layer), the
loop double-buffered, and the collectives of a step combined up to thresholds scaled by
the device count as MaxText does (1 GiB all-reduce; 1 GiB / devices all-gather; half of
that reduce-scatter). They are passed as the step's compiler options, so nothing else
jax compiles is touched, and only where the step is built for CUDA or ROCm. A flag the
user names in XLA_FLAGS is left to XLA_FLAGS: theirs wins. A flag the running XLA does
not know (XLA retires them: jaxlib 0.11 has no `xla_gpu_enable_pipelined_*`) is left out,
and said in the run header, rather than failing every compile.
"""

from __future__ import annotations

import functools
import os
import re

GPU_PLATFORMS = ("cuda", "rocm")
COMBINE = 2**30  # bytes: MaxText's all-reduce combine threshold


def gpu_flags(devices: int) -> dict[str, bool | int]:
    return {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_enable_highest_priority_async_stream": True,
        "xla_gpu_enable_pipelined_all_gather": True,
        "xla_gpu_enable_pipelined_reduce_scatter": True,
        "xla_gpu_enable_pipelined_all_reduce": True,
        "xla_gpu_enable_while_loop_double_buffering": True,
        "xla_gpu_all_reduce_combine_threshold_bytes": COMBINE,
        "xla_gpu_all_gather_combine_threshold_bytes": COMBINE // devices,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": COMBINE // (2 * devices),
    }


def user_named(xla_flags: str) -> set[str]:
    """The flag names an XLA_FLAGS string sets ('--name=value' or '--name')."""
    return set(re.findall(r"--([A-Za-z0-9_]+)", xla_flags))


def for_step(platform: str, devices: int, xla_flags: str | None = None) -> dict:
    """The compiler options of a step built for `platform` on `devices` devices: the GPU
    flags less those the user's XLA_FLAGS (default: the environment's) names; none off
    a GPU."""
    if platform not in GPU_PLATFORMS:
        return {}
    theirs = user_named(os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags)
    known = set(gpu_flags(devices)) - unknown()
    return {k: v for k, v in gpu_flags(devices).items() if k not in theirs and k in known}


@functools.cache
def unknown() -> frozenset[str]:
    """The GPU flags this XLA refuses as compile options: a trivial program compiled
    with them, each one named in 'No such compile option' dropped until it compiles.
    XLA parses them into its DebugOptions on every backend, so a CPU answers too."""
    import jax  # (this module is read before jax starts: the run header, the CLI)

    options, dropped = gpu_flags(1), set()
    probe = jax.jit(lambda x: x + 1).lower(1.0)
    while True:
        try:
            probe.compile(compiler_options=options)
            return frozenset(dropped)
        except jax.errors.JaxRuntimeError as e:
            name = re.search(r"No such compile option: '(\w+)'", str(e))
            if name is None or name[1] not in options:
                raise
            dropped.add(name[1])
            del options[name[1]]


def shown(options: dict) -> str:
    """One line for the run header: the flags as XLA_FLAGS would spell them."""
    return " ".join(f"--{k}={str(v).lower()}" for k, v in options.items())
