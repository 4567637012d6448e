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

from jaxpar.config.sections import Muon
from jaxpar.errors import ConfigError
from jaxpar.parallel.matrices import Matrix, groups, is_spec, matrices

EPS = 1e-8  # optax.contrib.muon's, under the Frobenius norm


def orthogonalize(x, spec: Matrix, coeffs, steps: int):
    """Newton-Schulz's approximate U V' of each matrix of `x` (dims `spec`, the rest
    stacked), as optax's: Frobenius-normalized, then `steps` quintic iterations with
    the Gram products on the smaller side."""
    n, letters = x.ndim, string.ascii_letters
    inputs, outputs = (math.prod(x.shape[i] for i in dims) for dims in spec)
    gram = spec.outputs if inputs > outputs else spec.inputs  # the Gram product's side
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


def scale_by_muon(specs, cfg: Muon) -> optax.GradientTransformation:
    """The momentum (Nesterov's if muon.nesterov, bias-corrected as optax's), each of its
    matrices orthogonalized (`specs`: `matrices`; a None leaf is another group's)."""
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

        def one(spec, m):
            if spec is None:
                return m
            ortho = orthogonalize(m, spec, cfg.coeffs, cfg.ns_steps)
            return _scaled(ortho, spec, cfg.scale)

        updates = jax.tree.map(one, specs, mu_hat, is_leaf=is_spec)
        return updates, MuonState(count, mu)

    return optax.GradientTransformation(init, update)


def muon(cfg: Muon, names, schedule, adamw: optax.GradientTransformation):
    """Muon on the hidden matrices of the leaves `names` at `schedule`'s learning rate;
    `adamw` on the others."""
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
        scale_by_muon(specs, cfg),
        optax.add_decayed_weights(cfg.weight_decay),
        optax.scale_by_learning_rate(schedule),
    )
    return optax.partition({"muon": orthogonalized, "adamw": adamw}, labels)
