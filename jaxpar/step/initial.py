"""The step-0 state an Engine starts from: `key -> params` (the model's init) then
`params -> state` (optimizer state and the rest), placed in the state's shardings.

A model whose parameters fit in ONE_DEVICE_BYTES is made by one program on one device,
the same program whatever the mesh (a pipeline's stages aside, which order the layers:
so a second layout of the model reads it from jax's compilation cache, and at any rate
it compiles sooner than the program split over the mesh), brought to the host, and
placed shard by shard; only the small `params -> state` program is the layout's own. The
values are the one device's, bit for bit, in every layout. A program split over the
mesh gives the same random bits (jax's threefry is partitionable: each shard's are
those of its slice of the whole), but not always the same floats from them: under
offload and parameter averaging XLA rounded five of gpt-tiny's leaves apart. A larger
model is made straight into its shards, never whole on one device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

ONE_DEVICE_BYTES = 2**30  # parameters up to this size are made whole on one device first


def initializer(params: Callable, fresh: Callable, shardings, shapes: dict):
    """key -> the step-0 state in `shardings` (a TrainState of shardings); `params`: key
    -> the model's parameters, `fresh`: parameters -> the state, `shapes`: the
    parameters' ShapeDtypeStructs."""
    whole = jax.jit(lambda key: fresh(params(key)), out_shardings=shardings)
    size = sum(np.prod(s.shape) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))
    if size > ONE_DEVICE_BYTES:
        return whole
    mesh = jax.tree.leaves(shardings.params)[0].device_set  # the mesh's devices
    device = min((d for d in mesh if d.process_index == jax.process_index()), key=lambda d: d.id)
    fresh = jax.jit(fresh, out_shardings=shardings)
    return OneDevice(whole, jax.jit(params), fresh, shardings, device)


@dataclass(frozen=True)
class OneDevice:
    """The initializer of a small model (the module's docstring): called as a key ->
    state function, as the jitted whole program was; `eval_shape`, `lower` and a call
    under a transformation are the whole program's (traced, never compiled)."""

    whole: Any  # jitted: key -> state, split over the mesh
    params: Any  # jitted: key -> params, on one device
    fresh: Any  # jitted: params -> state, in the state's shardings
    shardings: Any
    device: Any  # this process's first device of the mesh (its platform's arithmetic)

    def __call__(self, key):
        if isinstance(key, jax.core.Tracer):  # under jax.eval_shape or jit: traced whole
            return self.whole(key)
        made = jax.device_get(self.params(jax.device_put(key, self.device)))
        placed = jax.tree.map(_placed, made, self.shardings.params)
        return self.fresh(placed)

    def eval_shape(self, key):
        return self.whole.eval_shape(key)

    def lower(self, key):
        return self.whole.lower(key)


def _placed(host: np.ndarray, sharding) -> jax.Array:
    """`host` (the whole array, on every process) as a global array in `sharding`, each
    device given its slice: also across processes, where `device_put` of one process's
    array cannot reach the others' devices. The device's memory (not the host's, where
    offload keeps the master weights): `fresh` puts it where the state keeps it."""
    device = sharding.with_memory_kind("device")
    return jax.make_array_from_callback(host.shape, device, lambda index: host[index])
