"""The one channel from the running step to model code.

While a step traces the model it installs a `Context`; the helpers that models call
(`jaxpar.constrain`, `jaxpar.scan_layers`) read it, and nothing else does. Outside a
step there is none, and those helpers leave their input as it is. The other way, a
model's loss may `report` scalars (a mixture's balance, its drops) that the training
step collects into its metrics: their mean over micro-batches and devices, or, for a
name under MAXIMUM ("max/..."), their maximum.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpar.parallel.context import Split
from jaxpar.parallel.zero import Keep

HOST = "pinned_host"  # the memory kind of host memory (offload, remat=offload)
LAYER_INPUT = "jaxpar_layer_input"  # checkpoint name of a layer's input (remat=offload)
MAXIMUM = "max/"  # reports combined by their maximum (`combined`)
KEY = "jaxpar_key"  # Variable metadata set by from_nnx: the leaf's key in the parameters


@dataclass(frozen=True)
class Context:
    rules: tuple  # logical name -> mesh axis (jaxpar.parallel.sharding.RULES)
    mesh_shape: dict[str, int]
    keep: Keep  # what scan_layers keeps of each layer for the backward pass
    # (leaf key, one layer's stored slice of a stacked leaf) -> what the layer computes
    # with: the offload fetch and the ZeRO-3 gather of that layer alone
    layer: Callable[[str, jax.Array], jax.Array]
    # (leaf key, a stored leaf) -> the whole leaf, fetched and gathered; for a stacked
    # leaf that a model reads without scan_layers (others arrive ready)
    whole: Callable[[str, jax.Array], jax.Array]
    # the platform the step is built for ('cpu', 'cuda', 'rocm', 'tpu'): what
    # jaxpar.causal_attention picks its program by
    platform: str = "cpu"
    unroll: int = 1  # layers per iteration of scan_layers' loop (train.unroll)
    # how sequences are split over `context` (None: whole on every device)
    sequence: Split | None = None
    # Megatron sequence parallelism: the residual stream split by sequence over `tensor`
    sequence_parallel: bool = False
    # the manual axes over which one step's batch is split, whose devices' sums make the
    # batch's (jaxpar.batch_sum); none where each copy trains alone (parallel.dp_sync=params)
    batch_axes: tuple[str, ...] = ()


_CURRENT: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
    "jaxpar_context", default=None
)
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxpar_target", default=None)
_REPORTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "jaxpar_reports", default=None
)


def current() -> Context | None:
    return _CURRENT.get()


@contextlib.contextmanager
def active(ctx: Context):
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def reporting():
    """Collect what the model reports (`report`) while it computes one micro-batch's loss:
    the dict yielded fills as it does."""
    reports: dict = {}
    token = _REPORTS.set(reports)
    try:
        yield reports
    finally:
        _REPORTS.reset(token)


def report(name: str, value) -> None:
    """A scalar for this step's metrics (`jaxpar.report`); nothing while none are collected."""
    reports = _REPORTS.get()
    if reports is not None:
        reports[name] = value


def combined(name: str, values: list):
    """Several micro-batches' reports of `name` as one: their maximum under MAXIMUM, else
    their sum (the step divides it into their mean)."""
    if name.startswith(MAXIMUM):
        return functools.reduce(jnp.maximum, values)
    return functools.reduce(jnp.add, values)


def platform_of(device: jax.Device) -> str:
    """'cuda' or 'rocm' for a GPU (as `lowering_platforms` names them), else the
    device's platform ('cpu', 'tpu')."""
    if device.platform == "gpu":
        return "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"
    return device.platform


def target(mesh: jax.sharding.Mesh) -> str:
    """The platform steps are built for: this mesh's, unless `building_for` says."""
    return _TARGET.get() or platform_of(mesh.devices.flat[0])


@contextlib.contextmanager
def building_for(platform: str):
    """Build and trace steps for `platform` whatever devices this machine has: to lower
    a GPU program here, `.lower(lowering_platforms=(platform,))`, and read it."""
    token = _TARGET.set(platform)
    try:
        yield platform
    finally:
        _TARGET.reset(token)
