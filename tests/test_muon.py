"""Muon (train.optimizer=muon, jaxpar.step.muon): which leaves it orthogonalizes, its update
equal to optax.contrib.muon's on one device with the same per-matrix split, and every
layout equal to one device."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
    ONE_DEVICE,
    _shipped,
    assert_same_training,
    compile_only,
    prepared,
    reference,
    trained,
)
from optax.contrib import MuonDimensionNumbers

from jaxpar.config import presets
from jaxpar.config.sections import Muon
from jaxpar.cost import newton_schulz
from jaxpar.errors import ConfigError
from jaxpar.models import gpt as gpt_model
from jaxpar.models import latent as latent_model
from jaxpar.models import llama as llama_model
from jaxpar.names import HEAD_DIM, HEADS, QKV
from jaxpar.nn import attention, logits
from jaxpar.nn.logits import Scaled
from jaxpar.nn.scope import KEY
from jaxpar.parallel.matrices import groups, is_spec, matrices
from jaxpar.recipe import setup, trained_model
from jaxpar.step import muon, qk_clip
from jaxpar.step import optimizer as optim
from jaxpar.step.build import build

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
        pytest.param(  # fused q/k/v, biases, learned positions
            "gpt-tiny", ("muon.weight_decay=0.1",), marks=pytest.mark.slow
        ),
        pytest.param(
            "deepseek-tiny",  # experts, latent attention, balancing biases
            ("muon.nesterov=false", "muon.scale=0", "muon.ns_steps=4"),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_muon_equals_optax_contrib_muon(preset, keys):
    """Three steps on the same gradients for both (drawn at random for each leaf, of a
    model gradient's size: the update alone is the claim, and the model's forward and
    backward would be a third program): jaxpar's Muon (einsums over named dims) against
    optax.contrib.muon (reshape and vmap), the same per-matrix split."""
    cfg, _, problem, _ = _shipped(preset, ["parallel.data=1", *MUON, "train.warmup=1", *keys])
    tx, schedule = optim.optimizer(cfg.train, problem.names, 0.0, cfg.muon)
    adam = optim.adamw(schedule, cfg.train.weight_decay, optim.decayed(problem.names))
    ref_tx = _reference_tx(cfg, problem.names, schedule, adam)
    params = ref_params = jax.jit(problem.init)(jax.random.key(0))
    state, ref_state = jax.jit(tx.init)(params), jax.jit(ref_tx.init)(params)
    applied = jax.jit(optax.apply_updates)

    @jax.jit  # one program, not an op at a time
    def gradients(step):
        keys = jax.random.split(jax.random.fold_in(jax.random.key(1), step), len(params))
        return {
            k: 1e-2 * jax.random.normal(key, x.shape, x.dtype)
            for key, (k, x) in zip(keys, sorted(params.items()), strict=True)
        }

    for step in range(3):
        grads = gradients(step)  # both take the same, each its own state
        updates, state = jax.jit(tx.update)(grads, state, params)
        params = applied(params, updates)
        ref_updates, ref_state = jax.jit(ref_tx.update)(grads, ref_state, ref_params)
        ref_params = applied(ref_params, ref_updates)
    balance = optim.balancing(problem.names)  # moved by their own rule: not an optimizer's
    for key, got in params.items():
        if balance[key]:
            continue
        np.testing.assert_allclose(got, ref_params[key], atol=1e-5, rtol=0, err_msg=key)


# llama-tiny's Muon leaves, 4 layers each: wq and wo 64 x 64 (heads 8 x 8), wk and wv
# 64 x 16 (2 key heads), w_gate, w_up and w_down 64 x 128; 5 iterations. Each entry: its
# least bytes a step per device, by hand: owners' all-to-alls 2 (w-1)/w of the device's
# momentum slice; Gram products (m^2 = 64^2 for all but wk and wv's 16^2) and norms (one
# a matrix) all-reduced, 2 (T-1)/T, over the T devices splitting the contracted side.
GRAM_BYTES = {
    # 4 layers don't divide over 8: on the shards; every matrix's (rows split 8 ways)
    "dp8 zero1": 2 * 7 / 8 * 4 * (5 * 4 * (5 * 64**2 + 2 * 16**2) + 7 * 4),
    # owners (2 layers each), 20,480 momentum elements a device; tensor splits heads
    # and mlp (not the 2 key heads): 5 matrices' Grams of 2 layers over T = 4
    "dp2 tp4 zero1": 2 * 1 / 2 * 4 * 20_480 + 2 * 3 / 4 * 4 * (5 * 2 * 5 * 64**2 + 5 * 2),
    "tp8": 2 * 7 / 8 * 4 * (5 * 4 * 5 * 64**2 + 5 * 4),  # 5 matrices, all 4 layers
    # owners (1 layer each), 17,408 momentum elements a device; wk and wv split on their
    # Gram side (2 key heads over 2): gathered once, 512 elements each; the other 5
    # matrices' Grams of 1 layer over T = 2
    "dp4 tp2 zero1": 2 * 3 / 4 * 4 * 17_408 + 2 * 4 * 512 + 2 * 1 / 2 * 4 * 5 * (5 * 64**2 + 1),
}
GRAM_LAYOUTS = {
    "dp8 zero1": ("parallel.data=8", "parallel.zero=1"),
    "dp2 tp4 zero1": ("parallel.data=2", "parallel.tensor=4", "parallel.zero=1"),
    "tp8": ("parallel.data=1", "parallel.tensor=8"),
    "dp4 tp2 zero1": ("parallel.data=4", "parallel.tensor=2", "parallel.zero=1"),
}


@pytest.mark.slow  # two steps compiled each, 3 s
@pytest.mark.parametrize("name", GRAM_LAYOUTS)
def test_newton_schulz_moves_its_paths_least_bytes(name, devices):
    """What Muon's step adds to AdamW's in the compiled program: the owners' all-to-alls
    and each iteration's all-reduce of the small Gram products alone (a square matrix's
    taken on the side that contracts the shards; a matrix split on its Gram side
    gathered once), at most 1.02x the least bytes by hand; the report's figure the
    same."""
    layout = GRAM_LAYOUTS[name]
    muon_run = compile_only("llama-tiny", (*layout, *MUON))
    adamw = compile_only("llama-tiny", layout)
    added = {
        kind: muon_run.collectives[kind].wire_bytes
        - (adamw.collectives[kind].wire_bytes if kind in adamw.collectives else 0)
        for kind in muon_run.collectives
    }
    gathered = 2 * 4 * 512 if name == "dp4 tp2 zero1" else 0
    assert added.get("all-gather", 0) == gathered and added.get("reduce-scatter", 0) == 0
    minimum = GRAM_BYTES[name]
    assert minimum <= sum(added.values()) <= 1.02 * minimum
    assert muon_run.newton_schulz["wire_bytes"] == pytest.approx(minimum)


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
    # the programs the layouts' table trains (QK-clip on; it leaves the figures alone)
    keys = ("model.layers=8", *MUON, f"muon.qk_clip={TAU}", "train.steps=2")
    one = prepared("llama-tiny", (*ONE_DEVICE, *keys))
    owned = compile_only("llama-tiny", (*keys, *LAYOUTS["llama-8-layers-dp8-zero1"][1]))
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


FULL_RATE = ("train.warmup=0",)  # the first step at the full learning rate
# QK-clip (muon.qk_clip, jaxpar.step.qk_clip). The tiny models' first logits are 0.09-0.16:
# at 0.12 about half their heads pass it.
TAU = 0.12
TAUS = {"deepseek-tiny": 0.075}  # its first logits are 0.062-0.084
# the weights each model's clip scales: (leaf, its qkv part or None, power of tau / max,
# its head_dim span or None), in each layer stack (its name: the rows of the model's
# layers it holds)
CLIPPED = {
    "llama-tiny": [("attn/wq", None, 1.0, None)],  # heads share keys (GQA): q alone
    "gpt-tiny": [("attn/wqkv", 0, 0.5, None), ("attn/wqkv", 1, 0.5, None)],  # q and k alike
    # latent attention (Kimi K2's rule): q's and k's 16 unrotated dims by the square root,
    # q's 8 rotated dims by the whole, the shared rotated key (wkv_a's) not at all
    "deepseek-tiny": [("attn/wq_b", None, 0.5, (0, 16)), ("attn/wq_b", None, 1.0, (16, 24)),
                      ("attn/wkv_b", None, 0.5, (0, 16))],
}  # fmt: skip
STACKS = {"deepseek-tiny": {"first": slice(0, 1), "blocks": slice(1, None)}}


def _largest(q, k, segments, scale: float, window: int = 0) -> np.ndarray:
    """[heads] the largest visible q . k x scale, in float64."""
    q, k, s = np.asarray(q, np.float64), np.asarray(k, np.float64), q.shape[1]
    scores = np.einsum("bshd,bthd->bhst", q, k) * scale
    back = np.arange(s)[:, None] - np.arange(s)[None, :]
    visible = ((back >= 0) & ((back < window) if window else True))[None]
    if segments is not None:
        segments = np.asarray(segments)
        visible = visible & (segments[:, :, None] == segments[:, None, :])
    return np.where(visible[:, None], scores, -np.inf).max(axis=(0, 2, 3))


def test_the_attention_forms_hand_on_each_heads_largest_logit():
    """The direct form and the blocked one (query blocks of 16), with documents and a
    sliding window: each head's largest visible score, before the soft cap; and the
    blocked form by positions, as context parallelism runs it on a GPU; and the pass of
    the scores alone that runs beside cuDNN's kernel, which hands on none."""
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 64, 4, 8)) * 3
    segments = jnp.asarray(np.repeat([[0] * 20 + [1] * 30 + [2] * 14], 2, axis=0))
    positions = jnp.broadcast_to(jnp.arange(64), (2, 64))
    for window in (0, 5):
        want = _largest(q, k, segments, 8**-0.5, window)
        scores = attention.Scores(8**-0.5, softcap=2.0, maxima=True)
        _, direct = attention._direct(q, k, v, 0, segments, window, scores)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(attention, "BLOCK", 16)
            _, blocked = attention._blocked(q, k, v, segments, window, scores)
            at = (positions, positions, segments, segments, window, scores)
            _, by_positions = attention._positioned(attention.Form.BLOCKED, q, k, v, *at)
            alone = attention.largest_by_blocks(q, k, *at[:5], 8**-0.5)
        np.testing.assert_allclose(alone, want, rtol=1e-6)
        np.testing.assert_allclose(direct, want, rtol=1e-6)
        np.testing.assert_allclose(blocked, want, rtol=1e-6)
        np.testing.assert_allclose(by_positions, want, rtol=1e-6)


def _head_maxima(problem, params_list, batch) -> list[np.ndarray]:
    """[layers, heads] each head's largest logit for each params, computed here in float64
    from the q and k the model hands its attention (a second pass; not the step's)."""
    seen = []

    def spy(q, k, v, segments=None, window=0, *, scale=None, **kw):
        at = q.shape[-1] ** -0.5 if scale is None else scale
        host = lambda q, k, s: seen.append(_largest(q, k, s, at, window))  # noqa: E731
        jax.debug.callback(host, q, k, segments, ordered=True)
        return attention.causal_attention(q, k, v, segments, window, scale=scale, **kw)

    loss, out = jax.jit(problem.loss), []
    with pytest.MonkeyPatch.context() as patch:
        for module in (llama_model, gpt_model, latent_model):
            patch.setattr(module, "causal_attention", spy)
        for params in params_list:
            seen.clear()
            jax.block_until_ready(loss(params, batch))
            jax.effects_barrier()
            out.append(np.stack(seen))
    return out


def _along(names: tuple[str, ...], name: str, w: np.ndarray) -> np.ndarray:
    """Each index of w's dim `name`, shaped to broadcast against w."""
    return np.arange(w.shape[names.index(name)]).reshape([-1 if n == name else 1 for n in names])


def _one_step(preset: str, extra: tuple[str, ...]):
    """(problem, the parameters before and after one Muon step at the full learning rate,
    its metrics, the batch) on one device: with QK-clip on, the first step of the
    layouts' table's reference (the same program)."""
    keys = [*ONE_DEVICE, *MUON, *FULL_RATE, "train.steps=2", *extra]
    cfg = presets.load(preset, keys)
    s = setup(cfg, jax.devices()[:1])
    engine = build(s.problem, cfg, s.mesh)
    state, batch = engine.init(jax.random.key(0)), s.batches(0)
    before = jax.device_get(state.params)
    state, metrics = engine.step(state, jax.device_put(batch, engine.batch_sharding))
    return s.problem, before, jax.device_get(state.params), jax.device_get(metrics), batch


@pytest.mark.slow  # 10 s a model: two programs compiled
@pytest.mark.parametrize("preset", CLIPPED)
def test_qk_clip_scales_each_head_over_tau_back_and_no_other(preset):
    """One step with and without muon.qk_clip from the same weights and batch. Each head
    whose largest logit (computed here) passed tau has its weights the plain step's times
    (tau / max)^power; every other weight is the plain step's (within 1e-5, the layouts'
    tolerance: each step is its own program, and AdamW's near-zero gradients amplify a
    rounding of the update; a head clipped wrongly is 1e-2 off). So the first layer's
    logits (its inputs the same) are the plain step's times tau / max for those heads: a
    head's logit ends at tau but for what the update itself moved it (Kimi K2's rule: the
    maximum is the forward pass's, before the update). The step reports the largest logit."""
    tau = TAUS.get(preset, TAU)
    problem, before, plain, _, batch = _one_step(preset, ())
    _, _, clipped, metrics, _ = _one_step(preset, (f"muon.qk_clip={tau}",))
    top, after_plain, after = _head_maxima(problem, [before, plain, clipped], batch)
    eta_LxH = np.where(top > tau, tau / top, 1.0)
    assert 0 < np.mean(eta_LxH < 1) < 1  # some heads clipped, some not
    np.testing.assert_allclose(metrics.reports["attn/max_logit"], top.max(), rtol=1e-6)
    expected = {k: np.asarray(v) for k, v in plain.items()}
    for (stack, rows), (leaf, part, power, span) in itertools.product(
        STACKS.get(preset, {"blocks": slice(None)}).items(), CLIPPED[preset]
    ):
        key, eta = f"{stack}/{leaf}", eta_LxH[rows]
        names = problem.names[key]
        shape = [len(eta) if n == "layers" else 1 for n in names]
        shape[names.index(HEADS)] = eta.shape[1]
        factor = (eta**power).reshape(shape)
        if part is not None:
            factor = np.where(_along(names, QKV, expected[key]) == part, factor, 1.0)
        if span is not None:
            at = _along(names, HEAD_DIM, expected[key])
            factor = np.where((at >= span[0]) & (at < span[1]), factor, 1.0)
        expected[key] = expected[key] * factor
    for key, want in expected.items():  # two programs: the update's rounding may differ
        err = np.linalg.norm(clipped[key] - want) / np.linalg.norm(want)
        assert err <= 1e-5, f"{key}: relative error {err:.1e}"
    np.testing.assert_allclose(after[0], eta_LxH[0] * after_plain[0], rtol=1e-5)


# Every layout with QK-clip on (so each proves Muon's update and the clip alike), two
# steps (the second reads the first's momentum and moments). gpt-tiny's four layers do not
# divide over eight devices: Newton-Schulz on the shards (XLA's Gram products); over fewer,
# on each layer's owner. The maxima over `data` with the heads split over `tensor` and
# ZeRO-3's shards scaled; over `context`, each device's queries' (all_gather, balanced)
# and Ulysses' heads gathered back, with GQA's q alone scaled; through a pipeline's stages,
# each stage's layers' maxima gathered over `pipeline`; offloaded, the master weights
# scaled on the host and their compute copy made again from them
LAYOUTS = {
    # eight layers: each ZeRO shard owns whole layers (Muon's owners), whose bytes are
    # checked too
    "llama-8-layers-dp8-zero1": (
        "llama-tiny", ("model.layers=8", "parallel.data=8", "parallel.zero=1")
    ),
    "dp8-zero2": ("gpt-tiny", ("parallel.data=8", "parallel.zero=2")),
    "dp8-zero3": ("gpt-tiny", ("parallel.data=8", "parallel.zero=3")),
    "llama-8-layers-dp4-tp2-zero3": (
        "llama-tiny", ("model.layers=8", "parallel.data=4", "parallel.tensor=2", "parallel.zero=3")
    ),
    # orthogonalized once per step: four orthogonalized micro-batches would not sum to it
    "accumulate4": ("gpt-tiny", ("parallel.data=1", "train.grad_accum=4")),
    # experts over expert (on the shards: their stacked dim is expert's), latent attention's
    # matrices gathered on their split side, its parts clipped over tensor; the bytes Muon
    # adds to AdamW's step checked too
    "deepseek-dp2-tp2-ep2-zero1": (
        "deepseek-tiny",
        ("parallel.data=2", "parallel.tensor=2", "parallel.expert=2", "parallel.zero=1",
         *FULL_RATE),
    ),
    "dp8-zero1-offload": (
        "gpt-tiny", ("parallel.data=8", "parallel.zero=1", "parallel.offload=optimizer")
    ),
    "cp4-dp2": ("gpt-tiny", ("parallel.context=4", "parallel.data=2")),
    "llama-cp2-ulysses-tp2-dp2": (
        "llama-tiny",
        ("parallel.context=2", "parallel.context_strategy=ulysses", "parallel.tensor=2",
         "parallel.data=2"),
    ),
    "pp2-tp2-dp2-1f1b": (
        "gpt-tiny",
        ("parallel.pipeline=2", "parallel.tensor=2", "parallel.data=2",
         "parallel.microbatches=4"),
    ),
    "llama-pp2-interleaved-dp4": (
        "llama-tiny",
        ("parallel.pipeline=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
         "parallel.data=4", "parallel.microbatches=2"),
    ),
    "pp2-zb-h1-dp2-zero1": (
        "gpt-tiny",
        ("parallel.pipeline=2", "parallel.schedule=zb-h1", "parallel.data=2", "parallel.zero=1",
         "parallel.microbatches=4"),
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_equals_one_device(name):
    """Muon with QK-clip: the maxima are the whole batch's, whichever axes split its
    rows, tokens, heads and layers, and the clip scales each layout's shards: equal to
    one device, the reported largest logit too. Where each ZeRO shard owns whole
    layers, Muon's all-to-alls are at their minimum; over data x tensor x expert, the
    bytes it adds to AdamW's are the report's figure."""
    preset, layout = LAYOUTS[name]
    clip = (*MUON, f"muon.qk_clip={TAUS.get(preset, TAU)}")
    kept = tuple(k for k in layout if not k.startswith("parallel."))  # layers, rate
    got = trained(preset, (*layout, *clip), steps=2)
    want = reference(preset, (*kept, *clip), steps=2)
    assert_same_training(got, want, rtol=1e-5)
    assert len(want.max_logits) == 2 and max(want.max_logits) > TAUS.get(preset, TAU)
    np.testing.assert_allclose(got.max_logits, want.max_logits, rtol=1e-5)
    if name.startswith("llama-8-layers-dp"):
        _owners_move_the_least_bytes(preset, (*layout, *clip), got.report)
    if preset == "deepseek-tiny":
        _newton_schulz_adds_the_reports_bytes(preset, layout, got.report)


def _newton_schulz_adds_the_reports_bytes(preset: str, layout: tuple, muon_run) -> None:
    """What Muon (and the clip's maxima, [layers, heads] floats) adds to AdamW's step, on
    the trained program, is the report's figure (the cost model's count of each path's
    least bytes: latent attention's matrices gathered on their split side, the experts'
    on the shards, the shared experts' and the first dense layer's), within 1.02x."""
    adamw = compile_only(preset, (*layout, "train.steps=2"))
    added = sum(
        muon_run.collectives[kind].wire_bytes
        - (adamw.collectives[kind].wire_bytes if kind in adamw.collectives else 0)
        for kind in muon_run.collectives
    )
    figure = muon_run.newton_schulz["wire_bytes"]
    assert figure <= added <= 1.02 * figure


def _owners_move_the_least_bytes(preset: str, keys: tuple[str, ...], report) -> None:
    """Each layer's matrices orthogonalized whole on the device that owns the layer: the
    step's all-to-alls (its only ones) move each Muon leaf's shard there and back,
    2 (n-1)/n of its bytes over the ZeRO axes, no more (the trained program's report)."""
    cfg = presets.load(preset, list(keys))
    n, tensor = cfg.parallel.data, cfg.parallel.tensor
    model = trained_model(cfg.model, cfg.adapter, cfg.train)
    muon_bytes = sum(
        4 * np.prod(model.shapes[k].shape)
        for k, s in matrices(model.names).items()
        if s is not None
    )
    minimum = 2 * (n - 1) / n * muon_bytes / (n * tensor)
    moved = report.collectives["all-to-all"]
    assert moved.count == 2 * len(groups(model.names)["muon"])
    assert minimum <= moved.wire_bytes <= 1.02 * minimum


@pytest.mark.slow
def test_qk_clip_under_parameter_averaging_clips_each_copy_by_its_own_rows():
    """dp_sync=params: each copy is clipped by its own rows' logits, as a lone trainer
    would be. One copy (averaged at the last step) equals the gradient mode; over two
    copies, the first step's reported largest logit is the whole batch's."""
    clip = (*MUON, f"muon.qk_clip={TAU}", "parallel.dp_sync=params", "parallel.sync_every=2")
    want = reference("gpt-tiny", clip[:2], steps=2)
    one = trained("gpt-tiny", ("parallel.data=1", *clip), steps=2)
    assert_same_training(one, want, rtol=1e-5)
    np.testing.assert_allclose(one.max_logits, want.max_logits, rtol=1e-5)
    two = trained("gpt-tiny", ("parallel.data=2", *clip), steps=2)
    np.testing.assert_allclose(two.max_logits[0], want.max_logits[0], rtol=1e-5)


def test_qk_clip_where_no_logit_comes_out_is_one_line(devices):
    """A model whose weights do not scale its logits (qk_norm) is refused when the step
    is built; so is a pipelined model with attention outside its staged stack (its
    logits would go unwatched), and adapters (the clip scales the weights, frozen there)."""
    with pytest.raises(ConfigError, match=r"^muon.qk_clip=100: the model hands on no trained"):
        _one_step("qwen3-tiny", ("muon.qk_clip=100",))
    wq = nnx.Param(jnp.ones(2), **{KEY: "pre/wq"})

    def pre(params, mb):  # attention in the embedding's stage
        if logits.wanted():
            logits.seen(jnp.zeros(2), (wq, 1.0))
        return jnp.zeros(3)

    parts = SimpleNamespace(pre=pre, post=lambda params, y, mb: jnp.sum(y))
    with pytest.raises(ConfigError, match=r"^muon.qk_clip with a pipeline: .*\(pre/wq\)"):
        qk_clip.outside_stack(parts, {}, None)
    qk_clip.outside_stack(SimpleNamespace(pre=lambda p, mb: jnp.zeros(3), post=parts.post), {}, 0)
    cfg = presets.load("llama-tiny", [*MUON, "muon.qk_clip=100", "adapter.kind=lora"])
    with pytest.raises(ConfigError, match=r"^muon.qk_clip=100 with adapter.kind=lora"):
        setup(cfg, devices[:1])


def test_qk_clip_leaves_a_frozen_copys_attention_alone():
    """DPO's reference (frozen) hands on its logits too: its weights are not scaled, nor
    its maximum reported; the trained copy's are."""
    names = {k: ("layers", "embed", "heads", "head_dim") for k in ("a/wq", "reference/a/wq")}
    params = {k: jnp.ones((1, 2, 2, 3)) for k in names}
    reports = {
        f"{qk_clip.PREFIX}0": jnp.array([[2.0, 0.5]]),
        f"{qk_clip.PREFIX}1": jnp.array([[4.0, 4.0]]),
    }
    rules = [(Scaled("a/wq", 1.0),), (Scaled("reference/a/wq", 1.0),)]
    got, rest = qk_clip.clip(params, reports, rules, 1.0, names, {"a/wq"})
    np.testing.assert_array_equal(got["a/wq"][0, :, 0], 0.5)  # head 0: 2 -> 1
    np.testing.assert_array_equal(got["a/wq"][0, :, 1], 1.0)  # head 1: under tau
    np.testing.assert_array_equal(got["reference/a/wq"], params["reference/a/wq"])
    assert float(rest["attn/max_logit"]) == 2.0 and set(rest) == {"attn/max_logit"}
