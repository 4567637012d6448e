"""Muon (train.optimizer=muon, jaxpar.step.muon): which leaves it orthogonalizes, its update
equal to optax.contrib.muon's on one device with the same per-matrix split, and every
layout equal to one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import _shipped, assert_same_training, reference, trained
from optax.contrib import MuonDimensionNumbers

from jaxpar.config import presets
from jaxpar.parallel.matrices import groups, is_spec, matrices
from jaxpar.recipe import trained_model
from jaxpar.step import optimizer as optim

MUON = ("train.optimizer=muon",)
LAYERS = "blocks/attn/wk blocks/attn/wo blocks/attn/wq blocks/attn/wv".split()
MLP = "blocks/mlp/w_down blocks/mlp/w_gate blocks/mlp/w_up".split()
NORMS = ["blocks/attn_norm/scale", "blocks/mlp_norm/scale", "head", "norm/scale", "tokens"]
LATENT = "attn/wkv_a attn/wkv_b attn/wo attn/wq_a attn/wq_b".split()


def _groups(preset: str) -> dict[str, list[str]]:
    cfg = presets.load(preset, list(MUON))
    return groups(trained_model(cfg.model, cfg.adapter, cfg.train).names)


def test_each_leaf_is_in_the_group_its_kind_asks_for():
    """No leaf falls to AdamW for want of a rule: hidden matrices (attention, MLP, experts,
    routers, latent projections) are Muon's; embeddings, the head, norms and the balancing
    biases are AdamW's."""
    assert _groups("llama-tiny") == {"muon": LAYERS + MLP, "adamw": NORMS}
    assert _groups("mixtral-tiny") == {"muon": [*LAYERS, "blocks/mlp/router", *MLP], "adamw": NORMS}
    ds = _groups("deepseek-tiny")
    mlp = ["mlp/w_down", "mlp/w_gate", "mlp/w_up"]
    shared = ["shared/w_down", "shared/w_gate", "shared/w_up"]
    blocks = [*LATENT, "mlp/router", *mlp, *shared]
    assert ds["muon"] == [f"blocks/{k}" for k in blocks] + [f"first/{k}" for k in LATENT + mlp]
    norms = ["attn/kv_norm/scale", "attn/q_norm/scale", "attn_norm/scale"]
    assert ds["adamw"] == [
        *(f"blocks/{k}" for k in [*norms, "mlp/bias", "mlp_norm/scale"]),
        *(f"first/{k}" for k in [*norms, "mlp_norm/scale"]),
        "head",
        "norm/scale",
        "tokens",
    ]


def _reference_tx(cfg, names, schedule, adam):
    """optax.contrib.muon on the Muon leaves, each with its inputs and outputs as optax's
    dimension numbers (stacked dims: optax's batch axes); `adam` on the others."""
    specs = matrices(names)
    dims = jax.tree.map(
        lambda s: None if s is None else MuonDimensionNumbers(s.inputs, s.outputs),
        specs,
        is_leaf=is_spec,
    )
    keys = cfg.muon
    reference = optax.contrib.muon(
        schedule,
        ns_coeffs=keys.coeffs,
        ns_steps=keys.ns_steps,
        beta=keys.momentum,
        weight_decay=keys.weight_decay,
        nesterov=keys.nesterov,
        muon_weight_dimension_numbers=dims,
        consistent_rms=keys.scale or None,
    )
    labels = {k: "adamw" if v is None else "muon" for k, v in specs.items()}
    return optax.partition({"muon": reference, "adamw": adam}, labels)


@pytest.mark.parametrize(
    "preset, keys",
    [
        ("gpt-tiny", ("muon.weight_decay=0.1",)),  # fused q/k/v, biases, learned positions
        ("deepseek-tiny", ("muon.nesterov=false", "muon.scale=0", "muon.ns_steps=4")),
    ],
)
def test_muon_equals_optax_contrib_muon(preset, keys):
    """Three steps on the model's own gradients (the same ones for both, so that AdamW's
    leaves, with gradients near zero, do not amplify float rounding through the loss):
    jaxpar's Muon (einsums over named dims) against optax.contrib.muon (reshape and
    vmap), the same per-matrix split."""
    cfg, _, problem, batches = _shipped(preset, ["parallel.data=1", *MUON, "train.warmup=1", *keys])
    tx, schedule = optim.optimizer(cfg.train, problem.names, 0.0, cfg.muon)
    adam = optim.adamw(schedule, cfg.train.weight_decay, optim.decayed(problem.names))
    ref_tx = _reference_tx(cfg, problem.names, schedule, adam)
    loss = lambda p, b: jnp.mean(problem.loss(p, b))  # noqa: E731
    params = ref_params = problem.init(jax.random.key(0))
    state, ref_state = tx.init(params), ref_tx.init(params)
    for step in range(3):
        batch = batches(step)
        grads = jax.grad(loss)(params, batch)  # both take the same, each its own state
        updates, state = jax.jit(tx.update)(grads, state, params)
        params = optax.apply_updates(params, updates)
        ref_updates, ref_state = jax.jit(ref_tx.update)(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, ref_updates)
    balance = optim.balancing(problem.names)  # moved by their own rule: not an optimizer's
    for key, got in params.items():
        if balance[key]:
            continue
        np.testing.assert_allclose(got, ref_params[key], atol=1e-5, rtol=0, err_msg=key)


LAYOUTS = {
    "dp8-zero1": ("gpt-tiny", ("parallel.data=8", "parallel.zero=1")),
    "dp8-zero2": ("gpt-tiny", ("parallel.data=8", "parallel.zero=2")),
    "dp8-zero3": ("gpt-tiny", ("parallel.data=8", "parallel.zero=3")),
    "dp4-tp2-zero3": ("gpt-tiny", ("parallel.data=4", "parallel.tensor=2", "parallel.zero=3")),
    "pp2-tp2": ("gpt-tiny", ("parallel.data=2", "parallel.pipeline=2", "parallel.tensor=2")),
    # orthogonalized once per step: four orthogonalized micro-batches would not sum to it
    "accumulate4": ("gpt-tiny", ("parallel.data=1", "train.grad_accum=4")),
    "offload": ("gpt-tiny", ("parallel.data=8", "parallel.zero=1", "parallel.offload=optimizer")),
    "ep2-dp4": ("mixtral-tiny", ("parallel.data=4", "parallel.expert=2", "parallel.zero=1")),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_equals_one_device(name):
    preset, layout = LAYOUTS[name]
    got = trained(preset, (*layout, *MUON))
    assert_same_training(got, reference(preset, MUON), rtol=1e-5)
