"""Muon (train.optimizer=muon, jaxpar.step.muon): which leaves it orthogonalizes, its update
equal to optax.contrib.muon's on one device with the same per-matrix split, and every
layout equal to one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import _shipped, assert_same_training, compile_only, prepared, reference, trained
from optax.contrib import MuonDimensionNumbers

from jaxpar.config import presets
from jaxpar.config.sections import Muon
from jaxpar.cost import newton_schulz
from jaxpar.errors import ConfigError
from jaxpar.parallel.matrices import groups, is_spec, matrices
from jaxpar.recipe import setup, trained_model
from jaxpar.step import muon
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
        pytest.param(
            "deepseek-tiny",  # experts, latent attention, balancing biases
            ("muon.nesterov=false", "muon.scale=0", "muon.ns_steps=4"),
            marks=pytest.mark.slow,
        ),
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


# eight layers: each of the eight ZeRO shards owns a layer's whole matrices (muon.owners)
OWNED = ("model.layers=8", *MUON)

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


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_equals_one_device(name):
    """On the shards (gpt-tiny's four layers do not divide over eight devices: XLA's
    Gram products), and offloaded to the host."""
    preset, layout = LAYOUTS[name]
    got = trained(preset, (*layout, *MUON))
    assert_same_training(got, reference(preset, MUON), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.data=8", "parallel.zero=1"),
        ("parallel.data=4", "parallel.tensor=2", "parallel.zero=3"),
    ],
)
def test_owned_matrices_equal_one_device_at_the_minimum_bytes(layout):
    """Each layer's matrices orthogonalized whole on the device that owns the layer: equal
    to one device, and the step's all-to-alls (its only ones) move each Muon leaf's
    shard there and back: 2 (n-1)/n of its bytes over the ZeRO axes, no more."""
    got = trained("llama-tiny", (*layout, *OWNED))
    assert_same_training(got, reference("llama-tiny", OWNED), rtol=1e-5)
    report = compile_only("llama-tiny", (*layout, *OWNED))
    cfg = presets.load("llama-tiny", [*layout, *OWNED])
    n, tensor = cfg.parallel.data, cfg.parallel.tensor
    names = trained_model(cfg.model, cfg.adapter, cfg.train).names
    shapes = trained_model(cfg.model, cfg.adapter, cfg.train).shapes
    muon_bytes = sum(
        4 * np.prod(shapes[k].shape) for k, s in matrices(names).items() if s is not None
    )
    minimum = 2 * (n - 1) / n * muon_bytes / (n * tensor)
    moved = report.collectives["all-to-all"]
    assert moved.count == 2 * len(groups(names)["muon"])
    assert minimum <= moved.wire_bytes <= 1.02 * minimum


def test_muon_keys_without_muon_and_muon_without_a_matrix_are_one_line(devices):
    """muon.* set for AdamW is refused, not ignored; Muon on leaves with no hidden matrix
    (norms and biases only) is refused, not AdamW under another name."""
    cfg = presets.load("llama-tiny", ["muon.ns_steps=3"])
    with pytest.raises(ConfigError, match=r"^muon.ns_steps=3 with train.optimizer=adamw: .*"):
        setup(cfg, devices)
    names = {"norm/scale": ("embed",), "blocks/bias": ("layers", "mlp")}
    schedule = optax.constant_schedule(1e-3)
    with pytest.raises(ConfigError, match="no trained leaf is a hidden matrix.*norm/scale"):
        muon.muon(Muon(), names, schedule, optax.adamw(schedule))


@pytest.mark.slow  # 4 s, several programs compiled: out of the fast tier
def test_newton_schulz_flops_are_xlas_and_the_owners_split_them(devices):
    """The planner's and inspect's count (jaxpar.cost.newton_schulz) against XLA's own
    count of each leaf's orthogonalize on one device, and on the owners' path (8 layers
    over data=8) an eighth of it each. A matrix of one dim by one (the MLP's) is XLA's
    count but for one elementwise pass of the first iteration (0.06%). Where a side
    spans two dims (heads x head_dim) XLA's program counts 10 more FLOPs an element an
    iteration than the math (its contraction over two dims), so the total is 0.99 of
    XLA's: within 1%."""
    one = prepared("llama-tiny", ("model.layers=8", *MUON, "parallel.data=1"))
    owned = compile_only(
        "llama-tiny", ("model.layers=8", *MUON, "parallel.data=8", "parallel.zero=1")
    )
    cfg, problem, leaves = one.cfg, one.engine.problem, one.engine.leaves
    steps, total = cfg.muon.ns_steps, one.report.newton_schulz["flops"]
    xla = 0.0
    for key, spec in matrices(problem.names).items():
        if spec is None:
            continue
        f = lambda x, spec=spec: muon.orthogonalize(x, spec, cfg.muon.coeffs, steps)  # noqa: E731
        counted = jax.jit(f).lower(problem.shapes[key]).compile().cost_analysis()["flops"]
        xla += counted
        if len(spec.inputs) == len(spec.outputs) == 1:
            mine = newton_schulz.cost({key: leaves[key]}, {key: problem.names[key]}, steps)
            assert mine.flops == pytest.approx(counted, rel=1e-3), key
    assert total == pytest.approx(xla, rel=0.01)
    assert owned.newton_schulz["flops"] == pytest.approx(total / 8)
    assert owned.newton_schulz["temp_bytes"] < one.report.newton_schulz["temp_bytes"] / 4
