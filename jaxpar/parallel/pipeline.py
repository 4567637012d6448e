"""Pipeline parallelism over the `pipeline` axis: which layers each stage holds.

The layer stack [layers, ...] is cut into p * v contiguous chunks (v = virtual stages),
balanced by cost with the embedding counted on the first chunk and the head on the
last; chunk c lives on device c % p, or in a V (zbv: two chunks a device) on device c
for the first p and 2p - 1 - c for the rest, so device 0 holds the first and the last
chunk. Each leaf is stored as [p, v * slots, ...]
(logical names `stage`, `layers`), padding short chunks with skipped slots. The
schedules that run the chunks are in jaxpar.parallel.schedules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    stages: int  # p: devices along `pipeline`
    virtual: int  # v: chunks per device
    chunks: tuple[tuple[int, ...], ...]  # layers of chunk c (pipeline order), c = k*p + s
    slots: int  # layer slots per chunk (the longest chunk)
    vee: bool = False  # two chunks a device in a V: chunk c = k*p + s on device s, or 2p-1-s

    @property
    def slot_layer(self) -> np.ndarray:
        """[p, v*slots]: which layer each device's slot holds (-1 = padding)."""
        table = -np.ones((self.stages, self.virtual * self.slots), dtype=np.int64)
        for c, layers in enumerate(self.chunks):
            s, k = c % self.stages, c // self.stages
            if self.vee and k:
                s = self.stages - 1 - s
            table[s, k * self.slots : k * self.slots + len(layers)] = layers
        return table

    def device_layers(self) -> list[list[int]]:
        """The layers each device holds, in order."""
        return [[int(x) for x in row if x >= 0] for row in self.slot_layer]


@functools.cache  # (the planner asks again for every layout of the same depth)
def assign(
    layers: int, stages: int, virtual: int, costs: tuple[float, float, float], vee: bool = False
) -> Layout:
    """Contiguous chunks minimising the largest chunk cost (pre on the first, post on the
    last chunk), placed round-robin or, `vee`, in a V. Raises ConfigError when there are
    more chunks than layers."""
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
    return Layout(stages, virtual, chunks, max(len(c) for c in chunks), vee)


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
