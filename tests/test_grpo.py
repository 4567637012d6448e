"""GRPO: the loss and its gradient against an independent NumPy reference (and TRL's
GRPOTrainer), the update in every layout equal to one device given the same completions,
the same completions sampled in every layout, the reshard at its minimum, a resume that
repeats its rollouts and weights bitwise, and bad input refused in one line."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import THREE_D_1F1B, Trained, assert_same_training, one_line_error, script

from jaxpar.cli import main as cli
from jaxpar.config import presets
from jaxpar.config.sections import Grpo
from jaxpar.data import prompts
from jaxpar.data.prepare import prepare
from jaxpar.nn.problem import Problem
from jaxpar.objectives import grpo, rollouts
from jaxpar.parallel.axes import AXES
from jaxpar.parallel.mesh import build_mesh
from jaxpar.recipe import trained_model
from jaxpar.training.export import run_params
from jaxpar.training.trainer import train

VOCAB = 512  # the chat tokenizer's
REWARD = (
    "grpo.reward=jaxpar.objectives.rewards:exact_answer,jaxpar.objectives.rewards:format_reward"
)


@pytest.fixture(scope="module")
def folder(chat_tokenizer, tmp_path_factory):
    """grpo_llama.py's questions (conversations, and every tenth as text), 20 of them."""
    root = tmp_path_factory.mktemp("prompts")
    script("grpo_llama").write_prompts(root / "prompts.jsonl", 20)
    prepare([root / "prompts.jsonl"], chat_tokenizer, root / "tokens", 0.1, "prompts")
    # a reward that varies within each group, whatever the (random) model writes
    (root / "varied.py").write_text(
        "def varied(prompts, completions, **fields):\n"
        "    return [float(len(str(c)) % 5) for c in completions]\n"
    )
    return root / "tokens"


def varied(folder) -> str:
    return f"grpo.reward={folder.parent / 'varied.py'}:varied"


def keys(folder, *more):
    # fmt: off
    return ("model.vocab=512", "data.source=tokens", f"data.path={folder}",
            "train.objective=grpo", REWARD, "train.seq_len=64", "train.batch_size=8",
            "grpo.group=4", "grpo.max_new_tokens=12", "train.log_every=1", *more)
    # fmt: on


def test_prompts_keep_their_fields_and_are_asked_as_the_model_reads_them(folder, chat_tokenizer):
    from jaxpar.data import chat

    held = prompts.load(presets.load("llama-tiny", list(keys(folder))).data, VOCAB)
    lines = [json.loads(x) for x in (folder.parent / "prompts.jsonl").read_text().splitlines()]
    assert len(held) == 18 and {"answer"} == {k for f in held.fields for k in f}
    template, tok = chat.Template(chat_tokenizer), chat.tokenizer(chat_tokenizer)
    for ids, asked, fields in zip(held.ids, held.asked, held.fields, strict=True):
        line = next(x for x in lines if x.get("messages", x.get("prompt")) == asked)
        assert fields == {"answer": line["answer"]}
        text = asked if isinstance(asked, str) else template.render(asked, generation_prompt=True)
        assert ids == tok.encode(text, add_special_tokens=False).ids
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end in held.stop  # a conversation's answer ends at the end of its turn


# -- the loss --------------------------------------------------------------------------


def _toy(rows: int, width: int, vocab: int) -> Problem:
    """Logits as the parameters: the per-token losses a model returns, trained targets only."""

    def loss(params, batch):
        logp = jax.nn.log_softmax(params["logits"], -1)
        picked = jnp.take_along_axis(logp, batch["tokens"][:, 1:, None], -1)[..., 0]
        return jnp.where(batch["loss_mask"][:, 1:] != 0, -picked, 0.0)

    shape = jax.ShapeDtypeStruct((rows, width, vocab), jnp.float32)
    return Problem(init=None, shapes={"logits": shape}, names={"logits": (None,) * 3}, loss=loss)


def _numpy_loss_and_grad(logits, batch, g: Grpo, old, ref):
    """GRPO's loss (TRL's formulas) and its gradient in the logits, in float64 NumPy."""
    x = logits.astype(np.float64)
    soft = np.exp(x - x.max(-1, keepdims=True))
    soft /= soft.sum(-1, keepdims=True)
    targets, mask = batch["tokens"][:, 1:], batch["loss_mask"][:, 1:].astype(np.float64)
    logp = np.log(np.take_along_axis(soft, targets[..., None], -1)[..., 0])
    old = logp if old is None else old
    a = batch[grpo.ADVANTAGES][:, None].astype(np.float64)
    ratio = np.exp(logp - old)
    clipped = np.clip(ratio, 1 - g.epsilon, 1 + g.clip_high)
    token = -np.minimum(ratio * a, clipped * a)
    d_token = np.where(ratio * a <= clipped * a, -a * ratio, 0.0)  # the clipped side: flat
    if g.beta:
        k3 = np.exp(ref - logp) - (ref - logp) - 1
        d_k3 = 1 - np.exp(ref - logp)
        if g.kl_correction:  # times the ratio, whose derivative in logp is itself
            k3, d_k3 = k3 * ratio, d_k3 * ratio + k3 * ratio
        token = token + g.beta * k3
        d_token = d_token + g.beta * d_k3
    rows = len(mask)
    if g.loss == "gspo":
        onehot = np.eye(x.shape[-1])[targets]
        return _numpy_gspo(logp, old, ref, a, mask, g, onehot=onehot, soft=soft)
    if g.loss == "grpo":
        weight = mask / mask.sum(-1, keepdims=True) / rows
    elif g.loss == "dapo":
        weight = mask / mask.sum()
    else:
        weight = mask / (rows * g.max_new_tokens)
    onehot = np.eye(x.shape[-1])[targets]
    return np.sum(token * weight), (weight * d_token)[..., None] * (onehot - soft)


def _numpy_gspo(logp, old, ref, a, mask, g: Grpo, onehot, soft):
    """GSPO's loss (TRL's, sequence level) and its gradient in the logits: one ratio a
    row, s = exp(mean over its targets of logp - old), whose derivative in a target's
    logp is s / the row's length."""
    rows = len(mask)
    w = mask / mask.sum(-1, keepdims=True)  # each row's mean over its targets
    s = np.exp(np.sum(w * (logp - old), -1, keepdims=True))
    clipped = np.clip(s, 1 - g.epsilon, 1 + g.clip_high)
    loss = np.sum(-np.minimum(s * a, clipped * a)) / rows
    d_logp = np.where(s * a <= clipped * a, -a * s, 0.0) * w / rows
    if g.beta:
        k3 = np.exp(ref - logp) - (ref - logp) - 1
        d_k3 = 1 - np.exp(ref - logp)
        row_kl = np.sum(w * k3, -1, keepdims=True)
        if g.kl_correction:  # the row's KL mean times s, whose derivative is s w
            loss += g.beta * np.sum(row_kl * s) / rows
            d_logp = d_logp + g.beta * (w * d_k3 * s + row_kl * s * w) / rows
        else:
            loss += g.beta * np.sum(row_kl) / rows
            d_logp = d_logp + g.beta * w * d_k3 / rows
    return loss, d_logp[..., None] * (onehot - soft)


def fixed_batch(rows: int, width: int, vocab: int, seed: int, iterations: int, beta: float):
    """Rollout rows: prompts of 3-8 ids, completions of 1-24 (lengths 2x apart and more),
    advantages of both signs, and the sampler's and the reference's log-probabilities
    away from the policy's (so that some ratios clip on each side)."""
    rng = np.random.default_rng(seed)
    asked = [list(rng.integers(1, vocab, rng.integers(3, 9))) for _ in range(rows)]
    new = [list(rng.integers(1, vocab, rng.integers(1, min(25, width - 8)))) for _ in range(rows)]
    batch = rollouts.rows_of(asked, new, width)
    batch[grpo.ADVANTAGES] = rollouts.group_advantages(rng.normal(size=(rows // 4, 4)), True)
    spread = {grpo.OLD: iterations > 1, grpo.REF: beta > 0}
    for k, on in spread.items():
        if on:
            batch[k] = rng.normal(-np.log(vocab), 0.4, (rows, width)).astype(np.float32)
    return batch


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo", "gspo"])
@pytest.mark.parametrize(
    "beta, iterations, correction",
    [(0.0, 1, True), (0.04, 1, True), (0.0, 2, True), (0.04, 2, True), (0.04, 2, False)],
)
def test_the_loss_and_its_gradient_are_the_formulas(loss, beta, iterations, correction):
    """With 2 iterations the sampler's log-probabilities are not the policy's, so the
    ratio is not 1 and clips; epsilon_high (DAPO's clip-higher) apart from epsilon; the
    KL with and without its importance ratio."""
    g = Grpo(loss=loss, beta=beta, iterations=iterations, epsilon=0.2, epsilon_high=0.28,
             max_new_tokens=24, kl_correction=correction)  # fmt: skip
    cfg = presets.load("llama-tiny", [])
    cfg = type(cfg)(**{**cfg.__dict__, "grpo": g})
    rows, width, vocab = 8, 32, 16
    batch = fixed_batch(rows, width, vocab, 0, iterations, beta)
    if beta:  # the reference near the policy, as it is in training
        batch[grpo.REF] = batch[grpo.REF] * 0 - np.log(vocab) + 0.1
    logits = np.random.default_rng(1).normal(0, 1.0, (rows, width, vocab)).astype(np.float32)
    if iterations > 1:  # the sampler's log-probabilities: the policy's, moved by up to +-0.5
        soft = jax.nn.log_softmax(jnp.asarray(logits), -1)
        logp = np.asarray(jnp.take_along_axis(soft, batch["tokens"][:, 1:, None], -1)[..., 0])
        batch[grpo.OLD] = logp + np.random.default_rng(2).uniform(-0.5, 0.5, logp.shape)
        if loss == "gspo":  # whole completions apart, as a token's noise averages out
            batch[grpo.OLD] += np.resize([0.45, -0.45, 0.0], rows)[:, None]
    problem = grpo.problem(_toy(rows, width, vocab), cfg.grpo, cfg.adapter)
    params = {k: logits for k in problem.names}  # the reference's copy beside the policy

    def total(p):
        return jnp.sum(problem.loss(p, batch)) / problem.count(batch)

    got, grads = jax.value_and_grad(total)(params)
    want, want_grad = _numpy_loss_and_grad(
        logits, batch, g, batch.get(grpo.OLD), batch.get(grpo.REF)
    )
    # (at 1 iteration the advantages' group means are 0, and so is the loss without KL:
    # the gradient is the proof there)
    np.testing.assert_allclose(float(got), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grads["logits"]), want_grad, rtol=1e-4, atol=1e-8)
    assert np.abs(want_grad).max() > 1e-3
    if iterations > 1:  # the case that matters: some tokens clipped on each side
        soft = jax.nn.log_softmax(jnp.asarray(logits), -1)
        logp = np.asarray(jnp.take_along_axis(soft, batch["tokens"][:, 1:, None], -1)[..., 0])
        mask = batch["loss_mask"][:, 1:] != 0
        r = np.exp(logp - batch[grpo.OLD])
        if loss == "gspo":  # the completions' ratios
            r = np.exp(np.sum((logp - batch[grpo.OLD]) * mask, -1) / mask.sum(-1))
        else:
            r = r[mask]
        assert (r < 0.8).any() and (r > 1.28).any()


def test_advantages_are_normalized_within_each_group():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    scaled = rollouts.group_advantages(rewards, True).reshape(2, 4)
    std = np.std([1, 0, 0, 1], ddof=1)
    np.testing.assert_allclose(scaled[0], (rewards[0] - 0.5) / (std + 1e-4), rtol=1e-6)
    assert not scaled[1].any()  # a group of equal rewards teaches nothing
    np.testing.assert_allclose(
        rollouts.group_advantages(rewards, False).reshape(2, 4)[0], [0.5, -0.5, -0.5, 0.5]
    )
    assert not Grpo(loss="dr_grpo").scaled and Grpo(loss="grpo").scaled
    assert Grpo(loss="dr_grpo", scale_rewards="group").scaled


# -- the update, given the same completions ---------------------------------------------

# fmt: off
UPDATE = ("model.vocab=512", "train.objective=grpo", "train.seq_len=32", "train.batch_size=16",
          "grpo.loss=grpo", "grpo.beta=0.04", "grpo.iterations=2", "train.optimizer=sgd",
          "train.lr=0.5", "train.warmup=0", "train.clip_norm=0", "train.weight_decay=0")
# fmt: on
STEPS = 4


@functools.cache
def updated(more: tuple[str, ...], preset: str = "llama-tiny") -> Trained:
    """`preset` trained by GRPO for STEPS steps on fixed rollout rows (no sampling)."""
    cfg = presets.load(preset, [*UPDATE, f"train.steps={STEPS}", *more])
    problem = grpo.problem(trained_model(cfg.model, cfg.adapter, cfg.train), cfg.grpo, cfg.adapter)
    n = math.prod(max(getattr(cfg.parallel, a), 1) for a in AXES)
    mesh = build_mesh(cfg.parallel, jax.devices()[:n])
    batches = [fixed_batch(16, 32, VOCAB, s, 2, 0.04) for s in range(STEPS)]
    result = train(problem, cfg, lambda step, rows=slice(None): {
        k: v[rows] for k, v in batches[step].items()}, mesh=mesh, quiet=True)  # fmt: skip
    return Trained(list(result.losses), jax.device_get(result.params))


ONE = ("parallel.data=1", "parallel.tensor=1")
UPDATE_LAYOUTS = {
    "data8": (("parallel.data=8",), ()),
    "3d-1f1b": (tuple(THREE_D_1F1B), ()),
    "tensor4-zero3": (("parallel.data=2", "parallel.tensor=4", "parallel.zero=3"), ()),
    "lora-data4-tensor2-zero3": (
        ("parallel.data=4", "parallel.tensor=2", "parallel.zero=3"),
        ("adapter.kind=lora", "train.lr=5"),
    ),
    "context2": (("parallel.data=4", "parallel.context=2"), ()),
    # GSPO: a completion's ratio sums its targets over its context shards; rows accumulated
    "gspo-context2-tensor2": (
        ("parallel.data=2", "parallel.context=2", "parallel.tensor=2", "train.grad_accum=2"),
        ("grpo.loss=gspo",),
    ),
    "mixtral-expert2": (("parallel.data=4", "parallel.expert=2"), ("mixtral-tiny",)),
    # Muon: the policy's matrices orthogonalized, the reference's copy frozen (no state)
    "muon-tensor4-zero3": (
        ("parallel.data=2", "parallel.tensor=4", "parallel.zero=3"),
        ("train.optimizer=muon", "train.lr=0.02"),
    ),
}


@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=pytest.mark.slow) for k in UPDATE_LAYOUTS],  # 5 s and more each,
)
def test_the_update_in_every_layout_equals_one_device(layout):
    """Completions of lengths many times apart (a mean of per-device means would differ),
    the sampler's and the reference's log-probabilities given."""
    degrees, more = UPDATE_LAYOUTS[layout]
    preset = next((m for m in more if m.endswith("-tiny")), "llama-tiny")
    more = tuple(m for m in more if m != preset)
    got = updated((*degrees, *more), preset)
    want = updated((*ONE, *more), preset)
    assert abs(want.losses[-1]) > 1e-3  # it learns something
    assert_same_training(got, want)


# -- rollouts ----------------------------------------------------------------------------


def rolled(folder, out, more: tuple[str, ...], steps: int = 1):
    """A GRPO run of llama-tiny on as many devices as `more`'s degrees ask for, into
    `out`: (its result, its rollouts.jsonl rows, its summary.json)."""
    from jaxpar.recipe import setup

    cfg = presets.load("llama-tiny", [*keys(folder, *more), f"train.steps={steps}"])
    n = math.prod(max(getattr(cfg.parallel, a), 1) for a in AXES)
    s = setup(cfg, jax.devices()[:n])
    result = train(s.problem, cfg, s.batches, mesh=s.mesh, out_dir=out, quiet=True,
                   hooks=s.hooks)  # fmt: skip
    rows = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    return result, rows, json.loads((out / "summary.json").read_text())


ROLLOUT_LAYOUTS = {
    "one": ONE,
    "tensor2": ("parallel.data=1", "parallel.tensor=2"),
    "data2-tensor2": ("parallel.data=2", "parallel.tensor=2"),
    "zero3-tensor2": ("parallel.data=4", "parallel.tensor=2", "parallel.zero=3"),
    "lora-zero3-tensor2": (
        "parallel.data=4",
        "parallel.tensor=2",
        "parallel.zero=3",
        "adapter.kind=lora",
    ),
}


@pytest.mark.slow
def test_the_same_completions_in_every_layout_and_the_reshard_at_its_minimum(folder, tmp_path):
    """Step 1's rollout (the same weights everywhere) samples the same ids under one
    device, tensor=2 and data=2 x tensor=2 (and ZeRO-3 over data=4 x tensor=2, whose
    reshard to the generation layout moves what each device lacks, within 2%; with fresh
    adapters, the same model: only they move)."""
    runs = {name: rolled(folder, tmp_path / name, more) for name, more in ROLLOUT_LAYOUTS.items()}
    ids = {name: [r["completion_ids"] for r in rows] for name, (_, rows, _) in runs.items()}
    assert all(v == ids["one"] for v in ids.values())
    assert len({tuple(c) for c in ids["one"]}) > len(ids["one"]) // 2  # sampled, not greedy
    reshard = runs["zero3-tensor2"][2]["grpo"]["reshard"]
    assert reshard["minimum_bytes_per_device"] > 0 and not reshard["through_host"]
    assert reshard["wire_bytes_per_device"] <= 1.02 * reshard["minimum_bytes_per_device"]
    assert runs["zero3-tensor2"][2]["grpo"]["generate_layout"]["tensor"] == 2
    adapters = runs["lora-zero3-tensor2"][2]["grpo"]["reshard"]
    assert 0 < adapters["wire_bytes_per_device"] <= 1.02 * adapters["minimum_bytes_per_device"]
    assert adapters["minimum_bytes_per_device"] < reshard["minimum_bytes_per_device"] / 5
    row = runs["one"][0].rows[0]
    for column in ("generate_s", "generate_tokens_per_s", "reshard_s", "update_s", "reward",
                   "reward_std", "completions/mean_length", "clip_ratio/region_mean"):  # fmt: skip
        assert column in row, column


@pytest.mark.slow
@pytest.mark.parametrize("iterations", [1, 2])
def test_a_resumed_run_repeats_its_rollouts_and_weights_bitwise(iterations, folder, tmp_path):
    """KL against the reference copy; with two iterations a rollout, the sampler's
    log-probabilities used: 2 + iterations steps at once, against 2 steps, then a resume
    (rollouts.jsonl keeps the rollouts of the steps done, and takes the resumed run's)."""
    more = ("parallel.data=2", f"grpo.iterations={iterations}", "grpo.beta=0.04",
            "train.lr=1e-2", varied(folder))  # fmt: skip
    steps = 2 + iterations
    whole, rows, _ = rolled(folder, tmp_path / "whole", more, steps=steps)
    rolled(folder, tmp_path / "split", more, steps=2)
    again, split, _ = rolled(folder, tmp_path / "split", more, steps=steps)
    assert [r["step"] for r in rows] == [
        s for s in range(1, steps + 1, iterations) for _ in range(8)
    ]
    assert split == rows
    assert whole.losses[2:] == again.losses and abs(whole.losses[-1]) > 1e-4
    for k, v in whole.params.items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(again.params[k]), err_msg=k)


def _stale(folder, out, devices: int, more: tuple[str, ...], steps: int):
    """A GRPO run with its rollouts up to grpo.staleness=2 steps behind, on the first
    `devices` devices: (its config, result, rollouts.jsonl rows, summary.json)."""
    from jaxpar.recipe import setup

    more = ("grpo.staleness=2", "parallel.data=2", "parallel.tensor=2", "train.lr=1e-2",
            "train.warmup=0", varied(folder), *more)  # fmt: skip
    cfg = presets.load("llama-tiny", [*keys(folder, *more), f"train.steps={steps}"])
    s = setup(cfg, jax.devices()[:devices])
    result = train(s.problem, cfg, s.batches, mesh=s.mesh, out_dir=out, quiet=True,
                   hooks=s.hooks)  # fmt: skip
    rows = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    return cfg, result, rows, json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_stale_rollouts_apart_train_by_their_samplers_log_probabilities(folder, tmp_path):
    """Rollouts made by the policy up to 2 steps back, 4 steps: made at once on the
    trainer's 4 devices, and on 4 devices of their own beside the steps (8 devices:
    their thread, the weights sent after each update at their minimum bytes). The two
    agree bitwise; each rollout's policy is no older than 2 steps; and the 4th step's
    loss is the clipped ratio against the log-probabilities stored with its rollout,
    recomputed in NumPy from those and the weights after 3 steps."""
    _, here, first, _ = _stale(folder, tmp_path / "here", 4, ("checkpoint.every=3",), 4)
    cfg, apart, rows, summary = _stale(
        folder, tmp_path / "apart", 8, ("grpo.rollout_devices=4",), 4
    )
    assert [(r["step"], r["policy_version"]) for r in rows[::8]] == [(1, 0), (2, 0), (3, 0), (4, 1)]
    assert all(r["step"] - 1 - r["policy_version"] <= 2 for r in rows)
    assert [r["staleness"] for r in apart.rows] == [0, 1, 2, 2]
    assert [r["completion_ids"] for r in rows] == [r["completion_ids"] for r in first]
    assert apart.losses == here.losses
    b = summary["grpo"]
    assert b["rollout_devices"] == [0, 1, 2, 3] and math.prod(b["generate_layout"].values()) == 4
    assert (
        0 < b["reshard"]["wire_bytes_per_device"] <= 1.02 * b["reshard"]["minimum_bytes_per_device"]
    )
    # the 4th step: its rollout (by the policy after 1 step), the weights after 3
    last = rows[24:]
    batch = rollouts.rows_of([r["prompt_ids"] for r in last], [r["completion_ids"] for r in last],
                             cfg.train.seq_len)  # fmt: skip
    mask = batch["loss_mask"][:, 1:] != 0
    params, _ = run_params(tmp_path / "here", 3)
    logp = -np.asarray(trained_model(cfg.model, cfg.adapter, cfg.train).loss(params, batch))
    old = np.zeros_like(logp)
    old[mask] = np.concatenate([r["behaviour_logps"] for r in last])
    a = np.array([r["advantage"] for r in last], np.float64)[:, None]
    ratio = np.exp(logp.astype(np.float64) - old)
    token = -np.minimum(ratio * a, np.clip(ratio, 1 - 0.2, 1 + 0.2) * a)
    assert np.abs(logp - old)[mask].max() > 0.05  # the policy moved: the ratio is not 1
    np.testing.assert_allclose(apart.losses[3], token[mask].sum() / mask.sum(), rtol=1e-5)


@pytest.mark.parametrize(
    "more, needle",
    [
        (("grpo.reward=/nowhere/r.py:f",), "no such file"),
        (
            ("grpo.reward=jaxpar.objectives.rewards:nope",),
            "has no function nope; its reward functions are exact_answer, format_reward",
        ),
        (("grpo.reward=",), "grpo.reward is empty"),
        (("grpo.reward_weights=1,2,3",), "give 2 finite numbers"),
        (("grpo.group=1",), "grpo.group=1"),
        (("grpo.max_new_tokens=5000",), "grpo.max_new_tokens=5000"),
        (("data.source=corpus", "model.vocab=256"), "holds no prompts"),
        (("train.batch_size=24", "grpo.group=16"), "a multiple of 16"),
        (("train.eval_every=2",), "no held-out"),
        (("grpo.iterations=2", "checkpoint.every=3"), "a multiple of 2"),
        (("grpo.generate_layout=pipeline=2",), "grpo.generate_layout"),
        (("grpo.generate_layout=tensor=3",), "data=2 x tensor=3 = 6 devices"),
        (("train.objective=lm",), "train.objective=grpo"),
        (("grpo.staleness=10",), "grpo.staleness < train.steps"),
        (("grpo.staleness=1", "grpo.iterations=2"), "give grpo.iterations=1 with staleness"),
        (("grpo.rollout_devices=8",), "grpo.rollout_devices=8: the run has 8 devices"),
    ],
)
def test_bad_grpo_runs_are_refused(more, needle, folder, tmp_path, capsys):
    argv = ["train", "--config", "llama-tiny", *keys(folder, *more), "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    one_line_error(capsys, needle)


@pytest.mark.parametrize(
    "line, needle",
    [
        ({"text": "1 + 1"}, "no string `prompt`"),
        ({"prompt": ""}, "an empty `prompt`"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "role 'robot'"),
        ("", "no prompt in it"),
    ],
)
def test_bad_prompts_are_refused_before_anything_is_written(
    line, needle, chat_tokenizer, tmp_path, capsys
):
    good = json.dumps({"prompt": "1 + 1 = ", "answer": 2}) + "\n"
    (tmp_path / "p.jsonl").write_text(good + json.dumps(line) + "\n" if line else "\n")
    argv = ["prepare-data", str(tmp_path / "p.jsonl"), "--tokenizer", str(chat_tokenizer),
            "--out", str(tmp_path / "out"), "--format", "prompts"]  # fmt: skip
    assert cli.main(argv) == 2
    one_line_error(capsys, needle)
    assert not (tmp_path / "out").exists()  # nothing left that blocks the retry


def test_a_binary_prompt_file_and_a_damaged_prompt_folder_are_named(
    folder, chat_tokenizer, tmp_path, capsys
):
    import shutil

    (tmp_path / "p.jsonl").write_bytes(b'{"prompt": "1 + 1 = "}\n\xff\xfe\x00\x01\n')
    argv = ["prepare-data", str(tmp_path / "p.jsonl"), "--tokenizer", str(chat_tokenizer),
            "--out", str(tmp_path / "out"), "--format", "prompts"]  # fmt: skip
    assert cli.main(argv) == 2
    one_line_error(capsys, "p.jsonl:2", "not UTF-8")
    damaged = tmp_path / "tokens"
    shutil.copytree(folder, damaged)
    (damaged / "train.prompts.jsonl").write_text('{"ids": [1, 2]}\n')  # no prompt, fields
    argv = ["train", "--config", "llama-tiny", *keys(damaged), "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    one_line_error(capsys, "train.prompts.jsonl:1 is not what", "prepare the prompts again")


@pytest.mark.parametrize(
    "returns, needle",
    [
        (ValueError("no answer here"), "raised ValueError: no answer here"),
        ([1.0], "returned 1 values for 2 completions"),
        ("1.0 1.0", "returned not a list for 2 completions"),
        ([float("nan"), 0.0], "returned nan for completion 0 of prompt '3 + 4 ='"),
    ],
)
def test_a_reward_s_failure_names_the_function_and_the_prompt(returns, needle):
    from jaxpar.objectives import rewards

    def mine(prompts, completions, **fields):
        if isinstance(returns, Exception):
            raise returns
        return returns

    with pytest.raises(rewards.RewardFailed) as e:
        rewards.score([rewards.Reward("mine.py:mine", mine, 1.0)], ["3 + 4 = "] * 2,
                      ["7", "8"], {})  # fmt: skip
    assert needle in str(e.value) and "mine.py:mine" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_a_reward_that_fails_stops_the_run_in_one_line_and_keeps_the_last_state(
    folder, tmp_path, capsys
):
    """It raises at the second rollout: exit 3, one line, and step 1's state saved."""
    (tmp_path / "mine.py").write_text(
        "calls = []\n\ndef bad(prompts, completions, **fields):\n    calls.append(1)\n"
        "    if len(calls) > 1:\n        raise ValueError('no answer here')\n"
        "    return [0.0] * len(completions)\n"
    )
    more = (f"grpo.reward={tmp_path / 'mine.py'}:bad", "train.steps=3", "parallel.data=8")
    argv = ["train", "--config", "llama-tiny", *keys(folder, *more), "--out", str(tmp_path / "r")]
    assert cli.main(argv) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("jaxpar: stopped: step 2: grpo.reward ") and "mine.py:bad" in err
    assert "raised ValueError: no answer here" in err and "first prompt" in err
    assert (tmp_path / "r" / "checkpoints" / "1").is_dir() and "checkpoints/1" in err


ECHO = """
class Echo:
    def reset(self, prompt, answer=None, **fields):
        self.turns = 0

    def step(self, text):
        self.turns += 1
        return f"heard {len(text)} characters", float(self.turns), self.turns == 2
"""


def test_the_calculator_answers_calls_and_rewards_the_right_answer():
    from jaxpar.objectives.episodes import Calculator

    env = Calculator()
    env.reset([{"role": "user", "content": "What is 3 plus 4?"}], answer=7)
    assert env.step("Let me see. calc: 3 + 4") == ("= 7", 0.0, False)
    assert env.step("calc: (2 - 5) * 4 / 2") == ("= -6", 0.0, False)
    assert env.step("calc: 1 / 0") == ("= error", 0.0, False)
    assert env.step("calc: __import__('os')") == ("= error", 0.0, False)
    assert env.step("So 3 plus 4 is 7.") == (None, 1.0, True)
    env.reset("What is 3 plus 4?", answer=7)
    assert env.step("It is 8.") == (None, 0.0, True)


def test_the_calculator_walk_throughs_data_is_what_the_calculator_answers(tmp_path):
    """docs/grpo.md's calculator walk-through: each fine-tuning conversation that calls
    the calculator is told what the shipped Calculator answers and ends on an answer it
    rewards; the others answer outright, right; a quarter call. The GRPO questions'
    answers are their products, and the script counts a step's calls from rollouts."""
    from jaxpar.objectives.episodes import Calculator

    script("finetune_llama").write_calculator_conversations(tmp_path / "chat.jsonl", 40)
    rows = [json.loads(x)["messages"] for x in (tmp_path / "chat.jsonl").read_text().splitlines()]
    calls = [m for m in rows if len(m) == 4]
    assert len(calls) == 10 and all(len(m) == 2 for m in rows if len(m) != 4)
    for messages in rows:
        a, b = map(
            int, messages[0]["content"].removeprefix("What is ").rstrip("?").split(" times ")
        )
        env = Calculator()
        env.reset(messages[:1], answer=a * b)
        if len(messages) == 4:
            assert env.step(messages[1]["content"]) == (messages[2]["content"], 0.0, False)
        assert env.step(messages[-1]["content"]) == (None, 1.0, True)
    grpo_llama = script("grpo_llama")
    grpo_llama.write_products(tmp_path / "prompts.jsonl", 20)
    for line in (tmp_path / "prompts.jsonl").read_text().splitlines():
        row = json.loads(line)
        a, b = map(int, row["messages"][0]["content"][8:-1].split(" times "))
        assert row["answer"] == a * b
    episodes = [{"step": 1, "turns": [{"observation": "= 6"}, {"observation": None}]},
                {"step": 1, "turns": [{"observation": None}]},
                {"step": 2, "turns": [{"observation": "= 6"}, {"observation": None}]}]  # fmt: skip
    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in episodes))
    assert grpo_llama.called(tmp_path / "rollouts.jsonl", 2) == [0.5, 1.0]
    assert grpo_llama.fifths([0.0, 1.0, 0.5, 0.5, 1.0]) == "0.00 -> 1.00 -> 0.50 -> 0.50 -> 1.00"


@pytest.mark.slow
def test_episodes_keep_the_policys_turns_as_sampled_and_never_train_on_the_tools(
    folder, chat_tokenizer, tmp_path, capsys
):
    """grpo.env: two turns an episode, the tool's answer between them. The row holds the
    policy's turns as sampled, and between them ChatML's tool turn (a text prompt: the
    observation on its line) with loss mask 0, the turns' 1; the rewards are the
    environment's, summed; a second run plays the same episodes (keys of (seed, step,
    prompt, sample, turn)); an environment that raises stops the run in one line."""
    from jaxpar.data import chat

    (tmp_path / "echo.py").write_text(ECHO)
    more = (f"grpo.env={tmp_path / 'echo.py'}:Echo", "grpo.reward=", "grpo.max_new_tokens=8",
            "grpo.max_turns=3", "parallel.data=8")  # fmt: skip
    run = ["train", "--config", "llama-tiny", *keys(folder, *more), "--out"]
    assert cli.main([*run, str(tmp_path / "a")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "a" / "rollouts.jsonl").read_text().splitlines()]
    tok = chat.tokenizer(chat_tokenizer)
    told = 0
    for r in rows:
        turns = r["turns"]
        assert [t["reward"] for t in turns] == [1.0, 2.0][: len(turns)]
        assert r["rewards"]["env"] == sum(t["reward"] for t in turns) == r["reward"]
        ids, mask = np.array(r["completion_ids"]), np.array(r["loss_mask"])
        tools = tok.decode(ids[mask == 0].tolist(), skip_special_tokens=False)
        if len(turns) == 2:  # ChatML's tool turn, after the policy's end of turn or its own
            told += 1
            heard = f"heard {len(turns[0]['completion'])} characters"
            chatml = f"\n<|im_start|>tool\n{heard}<|im_end|>\n<|im_start|>assistant\n"
            text = isinstance(r["prompt"], str)
            assert tools in ((f"\n{heard}\n",) if text else (chatml, "<|im_end|>" + chatml))
            first = ids[: np.argmin(mask)]  # the first turn, as sampled
            assert "heard" not in tok.decode(first.tolist(), skip_special_tokens=False)
            assert mask[len(first) + len(tok.encode(tools, add_special_tokens=False).ids) :].all()
    assert told > 0
    assert cli.main([*run, str(tmp_path / "b")]) == 0
    again = [json.loads(x) for x in (tmp_path / "b" / "rollouts.jsonl").read_text().splitlines()]
    assert [r["completion_ids"] for r in again] == [r["completion_ids"] for r in rows]
    (tmp_path / "bad.py").write_text(ECHO.replace("self.turns += 1", "1 / 0"))
    bad = [a.replace("echo.py", "bad.py") for a in run]
    assert cli.main([*bad, str(tmp_path / "c")]) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "grpo.env " in err and "step raised ZeroDivisionError" in err
    assert not (tmp_path / "c" / "rollouts.jsonl").exists()
    assert cli.main([*run[:-1], "grpo.env=jaxpar.objectives.episodes:Nope", "--out", "x"]) == 2
    one_line_error(capsys, "grpo.env=jaxpar.objectives.episodes:Nope", "no class Nope")


torch = pytest.importorskip("torch", reason="the test extra installs torch (CPU) on 3.11")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                            "ignore::UserWarning")  # fmt: skip
@pytest.mark.parametrize("loss, beta, iterations, correction",
                         [("grpo", 0.0, 1, True), ("grpo", 0.04, 1, True),
                          ("dapo", 0.04, 2, True), ("dr_grpo", 0.04, 2, False),
                          ("gspo", 0.04, 2, True)])  # fmt: skip
def test_grpo_equals_trl(loss, beta, iterations, correction, chat_tokenizer, tmp_path):
    """TRL's GRPOTrainer._compute_loss on a random Hugging Face Llama, eight completions
    (two to each of four prompts, of 1 to 12 ids) with their advantages, and the
    sampler's and the reference's log-probabilities apart from the policy's: the loss and
    its gradient's norm, then the loss after one SGD step on each side, against jaxpar's
    objective on the same checkpoint. gspo is TRL's importance_sampling_level="sequence"
    with loss_type="grpo" (its docs' GSPO). (The prompts are of one length: TRL left-pads
    them, and the model then counts positions from the padding.)"""
    from datasets import Dataset

    from jaxpar import hf
    from jaxpar.config import registry

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=2, tie_word_embeddings=False,
                                      rms_norm_eps=1e-5)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.normal_(1.0 if "norm" in key else 0.0, 0.1)
    model.save_pretrained(tmp_path / "hf")
    rng = np.random.default_rng(0)
    asked = [list(rng.integers(3, VOCAB, 6)) for _ in range(4) for _ in range(2)]
    new = [list(rng.integers(3, VOCAB, n)) for n in (1, 12, 3, 9, 12, 2, 5, 7)]
    rewards = np.array([[1.0, 0.0], [0.0, 0.5], [1.0, 1.0], [0.2, 0.9]])
    advantages = rollouts.group_advantages(rewards, loss != "dr_grpo")
    width, most = 6 + 12, 12

    # jaxpar
    over = [f"model.init=hf:{tmp_path / 'hf'}", "train.objective=grpo", f"grpo.loss={loss}",
            f"grpo.beta={beta}", f"grpo.iterations={iterations}", "grpo.epsilon_high=0.28",
            f"grpo.max_new_tokens={most}", f"train.seq_len={width}", "train.batch_size=8",
            "grpo.group=2", f"grpo.kl_correction={str(correction).lower()}"]  # fmt: skip
    cfg = presets.resolve_init(presets.load("llama-tiny", over))
    own = trained_model(cfg.model, cfg.adapter, cfg.train)
    fill = hf.initial_params(registry.hf_format(cfg.model.name, "model.init"), cfg.model,
                             tmp_path / "hf", own.shapes)  # fmt: skip
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one)
               for k, s in own.shapes.items()}  # fmt: skip
    params = jax.device_get(fill(targets))
    batch = {**rollouts.rows_of(asked, new, width), grpo.ADVANTAGES: advantages}
    logp = -np.asarray(own.loss(params, batch))  # the policy's, per target
    noise = np.random.default_rng(1).uniform(-0.4, 0.4, (2, *logp.shape)).astype(np.float32)
    if iterations > 1:
        batch[grpo.OLD] = logp + noise[0]
    if beta:
        batch[grpo.REF] = logp + noise[1]
    problem = grpo.problem(own, cfg.grpo, cfg.adapter)
    full = {**params, **{k: params[k.removeprefix("reference/")] for k in problem.reference}}

    def total(p):
        return jnp.sum(problem.loss({**full, **p}, batch)) / problem.count(batch)

    ours, grads = jax.value_and_grad(total)(params)
    our_norm = float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))))
    lr = 0.5 / our_norm  # a step that moves the ratios by some 10%: step 2 is not step 1
    ours_2 = total(jax.tree.map(lambda p, g: p - lr * g, params, grads))

    # TRL
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, num_generations=2,
        max_completion_length=most, loss_type="grpo" if loss == "gspo" else loss, beta=beta,
        num_iterations=iterations, epsilon=0.2, epsilon_high=0.28,
        use_bias_correction_kl=correction, report_to=[], use_cpu=True, bf16=False,
        importance_sampling_level="sequence" if loss == "gspo" else "token",
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf"),
        reward_funcs=lambda prompts, completions, **_: [0.0] * len(completions), args=args,
        processing_class=transformers.AutoTokenizer.from_pretrained(chat_tokenizer),
        train_dataset=Dataset.from_list([{"prompt": "1 + 1 = "}] * 8),
    )  # fmt: skip
    ids = np.zeros((8, most), np.int64)
    mask = np.zeros((8, most), np.int64)
    for i, c in enumerate(new):
        ids[i, : len(c)], mask[i, : len(c)] = c, 1
    # target 5 + k of a row (of the ids after its 6 prompt ids) is its completion's id k
    per_target = [np.asarray(batch[k])[:, 5 : 5 + most] if k in batch else None
                  for k in (grpo.OLD, grpo.REF)]  # fmt: skip
    inputs = {
        "prompt_ids": torch.tensor(np.array(asked)),
        "prompt_mask": torch.ones(8, 6, dtype=torch.long),
        "completion_ids": torch.tensor(ids),
        "completion_mask": torch.tensor(mask),
        "advantages": torch.tensor(advantages),
        "num_items_in_batch": torch.tensor(float(mask.sum())),
        **({"old_per_token_logps": torch.tensor(per_target[0])} if iterations > 1 else {}),
        **({"ref_per_token_logps": torch.tensor(per_target[1])} if beta else {}),
    }
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    theirs = trainer._compute_loss(trainer.model, inputs)
    theirs.backward()
    their_norm = math.sqrt(sum(float((p.grad**2).sum()) for p in trainer.model.parameters()
                               if p.grad is not None))  # fmt: skip
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
        theirs_2 = trainer._compute_loss(trainer.model, inputs)
    # without KL the loss is a mean of +-|A| ratio whose group means cancel: it is ~1e-2
    # of its terms, so 1e-5 of the terms' scale (mean |A|) is float32's bound on it
    scale = float(np.mean(np.abs(advantages)))
    assert math.isclose(float(ours), float(theirs), rel_tol=1e-5, abs_tol=1e-5 * scale)
    assert math.isclose(our_norm, their_norm, rel_tol=1e-5)
    assert math.isclose(float(ours_2), float(theirs_2), rel_tol=1e-5, abs_tol=1e-5 * scale)
    if iterations > 1 or beta:  # (on-policy without KL the loss is ~0 at any weights)
        assert abs(float(ours_2) - float(ours)) > 100 * 1e-5 * max(scale, abs(float(ours)))
