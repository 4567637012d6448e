"""Muon (Keller Jordan's momentum orthogonalized by Newton-Schulz; optax.contrib.muon's
update) for the hidden matrices (jaxpar.parallel.matrices: read from the logical names,
each layer's, stage's, expert's and fused part's matrix alone), AdamW for every other
leaf. Newton-Schulz is written as einsums over the named dims, never as a reshape,
so that a sharded momentum stays sharded: XLA contracts each Gram product over the
shards and all-reduces it (Levanter's and MaxText's path; `orthogonalize`)."""

from __future__ import annotations

import math
import string
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config.sections import Muon
from jaxpar.errors import ConfigError
from jaxpar.parallel.matrices import (
    Matrix,
    gram_side,
    groups,
    is_spec,
    matrices,
    matrix,
    owner_dims,
)
from jaxpar.parallel.sharding import LeafSpecs, axes_of

EPS = 1e-8  # optax.contrib.muon's, under the Frobenius norm


def orthogonalize(x, spec: Matrix, coeffs, steps: int, splits: tuple[int, ...] = ()):
    """Newton-Schulz's approximate U V' of each matrix of `x` (dims `spec`, the rest
    stacked), as optax's: Frobenius-normalized, then `steps` quintic iterations with
    the Gram products on `gram_side`."""
    n, letters = x.ndim, string.ascii_letters
    gram = gram_side(x.shape, spec, splits)
    first = {i: letters[n + k] for k, i in enumerate(gram)}  # its second copy of them
    second = {i: letters[n + len(gram) + k] for k, i in enumerate(gram)}  # a third copy
    own = "".join(letters[i] for i in range(n))
    primed = "".join(first.get(i, letters[i]) for i in range(n))  # x, its gram side primed
    s = "".join(letters[i] for i in range(n) if i not in spec.inputs + spec.outputs)
    g, g1, g2 = ("".join(m.get(i, letters[i]) for i in gram) for m in ({}, first, second))
    x = x / (jnp.sqrt(jnp.sum(jnp.square(x), axis=spec.inputs + spec.outputs, keepdims=True)) + EPS)
    a, b, c = (jnp.asarray(v, x.dtype) for v in coeffs)
    for _ in range(steps):
        xx = jnp.einsum(f"{own},{primed}->{s}{g}{g1}", x, x)
        xxxx = jnp.einsum(f"{s}{g}{g1},{s}{g1}{g2}->{s}{g}{g2}", xx, xx)
        x = a * x + jnp.einsum(f"{s}{g}{g1},{primed}->{own}", b * xx + c * xxxx, x)
    return x


def _scaled(update, spec: Matrix, scale: float):
    """The orthogonalized `update` at RMS scale x sqrt(max(fan-in, fan-out)) (Moonlight);
    scale 0: sqrt(max(1, fan-out / fan-in)) (Keller Jordan's)."""
    fan_in, fan_out = (math.prod(update.shape[i] for i in dims) for dims in spec)
    factor = (
        scale * math.sqrt(max(fan_in, fan_out)) if scale else math.sqrt(max(1, fan_out / fan_in))
    )
    return update * factor


class MuonState(NamedTuple):
    count: jax.Array  # steps taken
    mu: optax.Updates  # the momentum of the Muon leaves (fp32)


class OnShards(NamedTuple):
    """A leaf whose matrices Newton-Schulz runs on split (on `splits`: ZeRO's, where no
    stacked dim divides over its ZeRO axes, and tensor's): XLA's Gram products are
    all-reduced over the shards. Where a split falls on the Gram products' side, the
    matrices are gathered whole on that side first (`gathered`), once, and sliced back
    (`stored`) after."""

    splits: tuple[int, ...]
    gathered: NamedSharding | None = None
    stored: NamedSharding | None = None


class Owned(NamedTuple):
    """Where a sharded leaf's matrices are orthogonalized: `stored` is the optimizer's
    split (ZeRO's: a slice of every matrix on each device), `owner` splits the stacked
    dim over the same devices (each device holds whole matrices: its layers' or experts')."""

    stored: NamedSharding
    owner: NamedSharding
    splits: tuple[int, ...] = ()  # the dims a tensor split keeps split there
    gathered: NamedSharding | None = None  # the owner's, its Gram side's split gathered


def owners(mesh, specs, names, shapes):
    """Per Muon leaf of the plan `specs` (LeafSpecs), its Owned placement (DistMuon's and
    Megatron's path: one all-to-all over the ZeRO axes to whole matrices, Newton-Schulz
    on their owners, one all-to-all back), where ZeRO splits it and a stacked dim divides
    over the ZeRO axes (a tensor split stays: its dims in Owned.splits); OnShards where
    ZeRO splits it on another dim, or tensor alone splits it: Newton-Schulz on the
    shards, XLA's Gram products over them; None elsewhere (and for AdamW's leaves)."""

    def one(leaf: LeafSpecs, n: tuple, shape) -> Owned | OnShards | None:
        if (m := matrix(n)) is None:
            return None
        zero = [a for a in axes_of(leaf.opt) if a not in axes_of(leaf.compute)]
        ways = math.prod(mesh.shape[a] for a in zero)
        free = owner_dims(shape.shape, m, ways, lambda i: leaf.compute[i] is None)
        tensor = tuple(i for i, a in enumerate(leaf.compute) if a is not None)
        if not free:  # none where ZeRO leaves it whole (ways 1)
            dims = tuple(sorted({*tensor, leaf.dim} - {None})) if ways > 1 else tensor
            gathered, dims = _gram_gathered(mesh, leaf.opt, shape.shape, m, dims)
            return (
                OnShards(dims, gathered, NamedSharding(mesh, leaf.opt))
                if dims or gathered
                else None
            )
        owner = list(leaf.compute) + [None] * (len(n) - len(leaf.compute))
        owner[free[0]] = tuple(zero)
        stored, owned = (NamedSharding(mesh, s) for s in (leaf.opt, PartitionSpec(*owner)))
        gathered, tensor = _gram_gathered(mesh, PartitionSpec(*owner), shape.shape, m, tensor)
        return Owned(stored, owned, tensor, gathered)

    return jax.tree.map(one, specs, names, shapes, is_leaf=lambda x: isinstance(x, LeafSpecs))


def _gram_gathered(mesh, spec: PartitionSpec, shape, m: Matrix, splits: tuple[int, ...]):
    """(the sharding `spec` with the Gram side's dims whole, or None where no split falls
    there; the splits left)."""
    gram = gram_side(shape, m, splits)
    if not any(d in gram for d in splits):
        return None, splits
    whole = [None if i in gram else a for i, a in enumerate(spec)]
    return NamedSharding(mesh, PartitionSpec(*whole)), tuple(d for d in splits if d not in gram)


def _on_owner(place: Owned | OnShards | None, fn, x):
    """fn(x), run where `place` says: x moved to its owner and the result back (each
    pinned, so that XLA moves x once each way, not fn's operands); a split Gram side
    gathered once before and sliced back after."""
    pin = jax.lax.with_sharding_constraint
    if place is None or (isinstance(place, OnShards) and place.gathered is None):
        return fn(x)
    if isinstance(place, OnShards):
        x = jax.lax.optimization_barrier(pin(x, place.gathered))
        return pin(jax.lax.optimization_barrier(pin(fn(x), place.gathered)), place.stored)
    x = pin(jax.lax.optimization_barrier(pin(x, place.stored)), place.owner)
    if place.gathered is not None:
        x = pin(x, place.gathered)
    y = jax.lax.optimization_barrier(pin(fn(x), place.gathered or place.owner))
    return pin(y, place.stored)


def scale_by_muon(specs, cfg: Muon, placed=None) -> optax.GradientTransformation:
    """The momentum (Nesterov's if muon.nesterov, bias-corrected as optax's), each of its
    matrices orthogonalized (`specs`: `matrices`; a None leaf is another group's), where
    `placed` (`owners`; None: on the shards) says."""
    beta = cfg.momentum

    def init(params):
        return MuonState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params))

    def update(grads, state, params=None):
        del params
        mu = optax.tree.update_moment(grads, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        if cfg.nesterov:
            ahead = optax.tree.bias_correction(mu, beta, optax.safe_increment(count))
            now = optax.tree.bias_correction(grads, beta, count)
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g, ahead, now)
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)

        def one(spec, m, place=None):
            if spec is None:
                return m
            splits = place.splits if place else ()
            run = lambda x: orthogonalize(x, spec, cfg.coeffs, cfg.ns_steps, splits)  # noqa: E731
            ortho = _on_owner(place, run, m)
            return _scaled(ortho, spec, cfg.scale)

        places = (
            placed if placed is not None else jax.tree.map(lambda _: None, specs, is_leaf=is_spec)
        )
        updates = jax.tree.map(one, specs, mu_hat, places, is_leaf=is_spec)
        return updates, MuonState(count, mu)

    return optax.GradientTransformation(init, update)


def muon(cfg: Muon, names, schedule, adamw: optax.GradientTransformation, placed=None):
    """Muon on the hidden matrices of the leaves `names` at `schedule`'s learning rate
    (orthogonalized where `placed`, `owners`, says); `adamw` on the others."""
    specs = matrices(names)
    if all(s is None for s in jax.tree.leaves(specs, is_leaf=is_spec)):
        trained = groups(names)["adamw"]
        raise ConfigError(
            f"train.optimizer=muon: no trained leaf is a hidden matrix to orthogonalize (the "
            f"trained leaves: {', '.join(trained[:6])}{', ...' if len(trained) > 6 else ''}); "
            "use train.optimizer=adamw"
        )
    labels = jax.tree.map(lambda s: "adamw" if s is None else "muon", specs, is_leaf=is_spec)
    orthogonalized = optax.chain(
        scale_by_muon(specs, cfg, placed),
        optax.add_decayed_weights(cfg.weight_decay),
        optax.scale_by_learning_rate(schedule),
    )
    return optax.partition({"muon": orthogonalized, "adamw": adamw}, labels)
