"""The frozen base of an adapter run, outside the checkpoint.

A checkpoint of a run with frozen parameters (jaxpar.nn.problem.Problem.frozen) holds the
trained leaves, their optimizer state and a reference to the base: where it came from
(`model.init`'s hf:DIR, or the model's own init from `train.seed`) and a fingerprint of
the base as stored (after adapter.base's quantization). A resume, an export or a decode
makes the base again from there and checks it against the fingerprint, so a base whose
files changed since is named, never silently trained on.

The fingerprint is a sum over every element of its bits times a weight of its position,
in uint32 (wrapping): integer sums are exact in any order, so it is the same whatever
the layout that computes it.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import hf
from jaxpar.adapters import lora
from jaxpar.config.sections import Model, Train
from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.nn.problem import Problem

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
_GOLDEN = 2654435761  # Knuth's multiplicative hash: positions weigh differently


@jax.jit
def leaf_sum(x: jax.Array) -> jax.Array:
    """One leaf's fingerprint: sum of bits * (position * golden + 1), mod 2**32."""
    bits = jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)
    position = jnp.zeros(x.shape, jnp.uint32)
    for dim in range(x.ndim):  # the flat index, dim by dim
        position = position * jnp.uint32(x.shape[dim]) + jax.lax.broadcasted_iota(
            jnp.uint32, x.shape, dim
        )
    return jnp.sum(bits * (position * jnp.uint32(_GOLDEN) + jnp.uint32(1)), dtype=jnp.uint32)


def fingerprint(sums: dict[str, jax.Array | int], shapes: dict) -> str:
    """The base's fingerprint from each leaf's leaf_sum (by key), its shape and dtype."""
    h = hashlib.sha256()
    for k in sorted(sums):
        s = shapes[k]
        h.update(f"{k} {tuple(s.shape)} {np.dtype(s.dtype).name} {int(sums[k])}\n".encode())
    return h.hexdigest()[:16]


def of(params: dict) -> str:
    """The fingerprint of `params` (global arrays in the model's own layout)."""
    return fingerprint({k: leaf_sum(v) for k, v in params.items()}, params)


def source(model: Model, train: Train, given: bool) -> str:
    """Where a run's base comes from, as its checkpoints name it."""
    if model.init:
        return model.init
    return "the params given to jaxpar.train" if given else f"train.seed={train.seed}"


def required(reference: dict | None, where) -> dict:
    """A checkpoint's reference to its base, refused if it has none."""
    if reference is None:
        raise CheckpointError(
            f"checkpoint {where}: holds no parameters of the frozen base nor a reference to "
            "it, so it was saved by a run without frozen parameters; resume it with its own "
            "adapter.* keys (its config is in the checkpoint's meta), or --restart"
        )
    return reference


def check(reference: dict | None, found: str, where) -> None:
    """Refuse a base whose fingerprint is not the one a checkpoint was saved with."""
    if required(reference, where)["hash"] != found:
        raise CheckpointError(
            f"checkpoint {where}: its frozen base ({reference['from']}) had fingerprint "
            f"{reference['hash']}, but the base made now has {found}: the base changed since "
            "(other files, another train.seed or adapter.base); restore the base it was "
            "trained on (or, to train afresh on this one, `jaxpar train ... --restart`)"
        )


def rebuilt(
    model: Model, train: Train, problem: Problem, trained: dict, reference: dict | None, where
) -> dict:
    """An adapter run's stored parameters (host arrays): the `trained` leaves a checkpoint
    holds, and its frozen base made again from `reference` (checked by its fingerprint),
    on one device."""
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {
        k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one) for k, s in problem.shapes.items()
    }
    frozen = problem.frozen
    if required(reference, where)["from"].startswith(hf.SCHEME):
        directory = hf.directory_of(reference["from"])
        if not directory.is_dir():
            raise ConfigError(
                f"checkpoint {where}: its frozen base is {reference['from']}, which is not a "
                "directory now; put the base back there to export or decode this run"
            )
        params = lora.from_files(model, train, problem, directory)(targets)
        base = {k: params[k] for k in frozen}
    elif reference["from"].startswith("train.seed="):
        seed = int(reference["from"].removeprefix("train.seed="))
        init = jax.jit(lambda key: {k: v for k, v in problem.init(key).items() if k in frozen})
        base = init(jax.random.key(seed))
    else:
        raise ConfigError(
            f"checkpoint {where}: its frozen base came from {reference['from']}, which only "
            "the Python program that trained it can give again; restore it there"
        )
    check(reference, of(base), where)
    return {**{k: np.asarray(v) for k, v in base.items()}, **trained}
