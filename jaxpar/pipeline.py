"""Pipeline parallelism over the `pipeline` axis: which layers each stage holds.

The layer stack [layers, ...] is cut into p * v contiguous chunks (v = virtual stages),
balanced by cost with the embedding counted on the first chunk and the head on the
last; chunk c lives on device c % p. Each leaf is stored as [p, v * slots, ...]
(logical names `stage`, `layers`), padding short chunks with skipped slots. The
schedules that run the chunks are in jaxpar.schedules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.problem import Problem
from jaxpar.sharding import LAYERS, STAGE


@dataclass(frozen=True)
class Layout:
    stages: int  # p: devices along `pipeline`
    virtual: int  # v: chunks per device
    chunks: tuple[tuple[int, ...], ...]  # layers of chunk c (pipeline order), c = k*p + s
    slots: int  # layer slots per chunk (the longest chunk)

    @property
    def slot_layer(self) -> np.ndarray:
        """[p, v*slots]: which layer each device's slot holds (-1 = padding)."""
        table = -np.ones((self.stages, self.virtual * self.slots), dtype=np.int64)
        for c, layers in enumerate(self.chunks):
            s, k = c % self.stages, c // self.stages
            table[s, k * self.slots : k * self.slots + len(layers)] = layers
        return table

    def device_layers(self) -> list[list[int]]:
        """The layers each device holds, in order."""
        return [[int(x) for x in row if x >= 0] for row in self.slot_layer]


@functools.cache  # (the planner asks again for every layout of the same depth)
def assign(layers: int, stages: int, virtual: int, costs: tuple[float, float, float]) -> Layout:
    """Contiguous chunks minimising the largest chunk cost (pre on the first, post on the
    last chunk). Raises ConfigError when there are more chunks than layers."""
    n = stages * virtual
    if n > layers:
        raise ConfigError(
            f"parallel.pipeline={stages} * parallel.virtual_stages={virtual} = {n} chunks but "
            f"the model has {layers} layers; use at most {layers} chunks, or more layers"
        )
    pre, layer, post = costs

    def cost(c: int, a: int, b: int) -> float:
        return (b - a) * layer + (pre if c == 0 else 0) + (post if c == n - 1 else 0)

    inf = float("inf")
    best = [[inf] * (layers + 1) for _ in range(n + 1)]
    cut = [[0] * (layers + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for c in range(1, n + 1):
        for b in range(c, layers - (n - c) + 1):
            for a in range(c - 1, b):
                value = max(best[c - 1][a], cost(c - 1, a, b))
                if value < best[c][b] - 1e-9:
                    best[c][b], cut[c][b] = value, a
    bounds, b = [], layers
    for c in range(n, 0, -1):
        bounds.append((cut[c][b], b))
        b = cut[c][b]
    chunks = tuple(tuple(range(a, b)) for a, b in reversed(bounds))
    return Layout(stages, virtual, chunks, max(len(c) for c in chunks))


def layout_for(problem: Problem, stages: int, virtual: int) -> Layout | None:
    """The stage assignment of `problem`'s layer stack (None without a pipeline)."""
    if stages == 1:
        return None
    if problem.parts is None:
        raise ConfigError(
            f"parallel.pipeline={stages}: this model has no pipeline stages; build it with "
            "jaxpar.from_nnx(..., stages=jaxpar.Stages(...)), or use parallel.pipeline=1"
        )
    layers = problem.shapes[problem.parts.stack_keys[0]].shape[0]
    return assign(layers, stages, virtual, problem.parts.costs)


def to_stages(layout: Layout, x: jax.Array) -> jax.Array:
    """A stacked leaf [layers, ...] -> [p, v*slots, ...] (padding slots hold zeros)."""
    idx = layout.slot_layer
    mask = (idx >= 0).reshape(idx.shape + (1,) * (x.ndim - 1))
    return jnp.where(mask, x[np.maximum(idx, 0)], 0).astype(x.dtype)


def from_stages(layout: Layout, y: jax.Array) -> jax.Array:
    """Inverse of to_stages."""
    flat = y.reshape((-1,) + y.shape[2:])
    where = {int(layer): i for i, layer in enumerate(layout.slot_layer.reshape(-1)) if layer >= 0}
    return flat[np.array([where[layer] for layer in sorted(where)])]


def in_stages(problem: Problem, stages: int, virtual: int = 1) -> Problem:
    """The problem as a `stages`-device pipeline trains it (itself for one stage)."""
    layout = layout_for(problem, stages, virtual)
    return staged(problem, layout) if layout else problem


def staged(problem: Problem, layout: Layout) -> Problem:
    """The problem with its layer stack in pipeline layout."""
    keys = set(problem.parts.stack_keys)
    rows = (layout.stages, layout.virtual * layout.slots)

    def init(key):
        params = problem.init(key)
        return {k: to_stages(layout, v) if k in keys else v for k, v in params.items()}

    shapes = {
        k: jax.ShapeDtypeStruct(rows + s.shape[1:], s.dtype) if k in keys else s
        for k, s in problem.shapes.items()
    }
    names = {k: (STAGE, *n) if k in keys else n for k, n in problem.names.items()}
    for k in keys:
        if problem.names[k][0] != LAYERS:
            raise ConfigError(f"{k}: a stacked parameter's first logical name must be {LAYERS}")
    return replace(problem, init=init, shapes=shapes, names=names)


def unstaged(problem: Problem, layout: Layout, params: dict) -> dict:
    keys = set(problem.parts.stack_keys)
    return {k: from_stages(layout, v) if k in keys else v for k, v in params.items()}


# --- schedules ---------------------------------------------------------------------
