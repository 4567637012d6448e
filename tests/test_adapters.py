"""Adapters (LoRA, QLoRA): every layout equal to one device, the same weights as a full
fine-tune that trains only the adapters, step 0 the base model exactly, the NF4 format
as QLoRA publishes it, the frozen base never reduced, and bad keys refused."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    THREE_D_1F1B,
    _setup,
    assert_same_training,
    compile_only,
    prepared,
    trained,
)
from helpers import reference as one_device

from jaxpar import inspection
from jaxpar.adapters import lora, quant
from jaxpar.cli import main as cli
from jaxpar.config import presets
from jaxpar.cost import planner
from jaxpar.nn.problem import registered
from jaxpar.parallel.mesh import resolve_degrees
from jaxpar.training import console

ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
LORA = ("model.layers=2", "adapter.kind=lora", "adapter.rank=4", f"adapter.targets={ALL}")
MIXTRAL = ("adapter.kind=lora", "adapter.rank=4", "adapter.targets=q_proj,v_proj,w1,w2,w3")
STEPS = 3
LAYOUTS = {
    "data8": ("parallel.data=8",),
    "tp4-zero3": ("parallel.data=2", "parallel.tensor=4", "parallel.zero=3"),
    "3d-1f1b": tuple(THREE_D_1F1B),
    "context4": ("parallel.data=2", "parallel.context=4"),
    "offload": ("parallel.data=8", "parallel.zero=1", "parallel.offload=optimizer"),
}
# QLoRA's published NF4 values (bitsandbytes' table; Dettmers et al. 2023, appendix E)
PUBLISHED_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]  # fmt: skip
# head_dim, embed and mlp multiples of NF4's block of 64
NF4_DIMS = ("model.embed=128", "model.heads=2", "model.kv_heads=1", "model.mlp=128")


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_adapters_train_in_every_layout_as_on_one_device(name, devices):
    want = one_device("llama-tiny", LORA, steps=STEPS)
    got = trained("llama-tiny", [*LORA, *LAYOUTS[name]], steps=STEPS)
    assert_same_training(got, want)
    assert got.losses[-1] < got.losses[0]


@pytest.mark.slow
def test_expert_adapters_train_over_the_expert_axis_as_on_one_device(devices):
    want = one_device("mixtral-tiny", MIXTRAL, steps=STEPS)
    got = trained("mixtral-tiny", [*MIXTRAL, "parallel.data=2", "parallel.expert=4"], steps=STEPS)
    assert_same_training(got, want)
    assert "blocks/mlp/w_gate/lora_a" in got.params


def _problems(overrides):
    cfg, s = _setup("llama-tiny", ["parallel.data=1", *overrides])
    return cfg, registered(cfg.model, cfg.train.seq_len), s.problem, s.batches(0)


def test_step_zero_is_the_base_model_exactly(devices):
    cfg, base, adapted, batch = _problems(LORA)
    key = jax.random.key(cfg.train.seed)
    params = adapted.init(key)
    assert sorted(k for k in adapted.names if k not in adapted.frozen) == sorted(
        f"blocks/{w}/lora_{ab}"
        for w in (
            "attn/wq",
            "attn/wk",
            "attn/wv",
            "attn/wo",
            "mlp/w_gate",
            "mlp/w_up",
            "mlp/w_down",
        )
        for ab in "ab"
    )
    assert not np.any(params["blocks/attn/wq/lora_b"]) and np.any(params["blocks/attn/wq/lora_a"])
    np.testing.assert_array_equal(adapted.loss(params, batch), base.loss(base.init(key), batch))


@pytest.mark.slow  # 7 s: out of the fast tier
def test_merged_weights_equal_a_full_fine_tune_of_only_the_adapters(devices):
    steps, overrides = 3, (*LORA, "train.clip_norm=0", "train.weight_decay=0.01")
    cfg, base, adapted, _ = _problems(overrides)
    t = cfg.train
    start = adapted.init(jax.random.key(t.seed))
    frozen = lora.merged(base, cfg.adapter, cfg.model, {k: start[k] for k in adapted.frozen})
    targets = lora.targets_of(cfg.adapter, cfg.model)
    scale = cfg.adapter.alpha / cfg.adapter.rank

    def added(weights, ab):  # W + scale A B, as matrices [layers, in, out]
        out = dict(weights)
        for p in targets:
            w, a, b = weights[p.key], ab[p.a], ab[p.b]
            product = a.reshape(len(a), -1, a.shape[-1]) @ b.reshape(len(b), b.shape[1], -1)
            out[p.key] = w + scale * product.reshape(w.shape)
        return out

    def loss(ab, batch):  # the plain model, autodiff on A and B alone
        return jnp.mean(base.loss(added(frozen, ab), batch))

    lr = optax.warmup_cosine_decay_schedule(
        0.0, t.lr, t.warmup, max(t.steps, t.warmup + 1), t.lr * 0.1
    )
    tx = optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=t.weight_decay)
    ab = {k: v for k, v in start.items() if k not in adapted.frozen}
    opt = tx.init(ab)
    _, s = _setup("llama-tiny", ["parallel.data=1", *overrides])
    for step in range(steps):
        grads = jax.grad(loss)(ab, s.batches(step))
        updates, opt = tx.update(grads, opt, ab)
        ab = optax.apply_updates(ab, updates)
    want = added(frozen, ab)
    run = trained("llama-tiny", ["parallel.data=1", *overrides], steps=steps)
    got = lora.merged(base, cfg.adapter, cfg.model, run.params)
    for k, w in want.items():
        err = np.linalg.norm(np.asarray(got[k]) - np.asarray(w)) / np.linalg.norm(w)
        assert err < 1e-5, (k, err)
    changed = np.linalg.norm(
        np.asarray(got["blocks/attn/wq"]) - np.asarray(frozen["blocks/attn/wq"])
    )
    assert changed > 1e-3  # the adapters moved the weights


def test_the_nf4_code_book_is_qlora_s():
    np.testing.assert_allclose(quant.NF4, PUBLISHED_NF4, rtol=0, atol=2e-7)


def _unpacked_nf4(codes, absmax):
    """NF4 read back as the format says, in numpy: the high nibble first, each value the
    published table's, times its block's absmax."""
    codes = np.asarray(codes)
    idx = np.stack([codes >> 4, codes & 15], -1).reshape(*codes.shape[:-1], -1)
    values = np.asarray(PUBLISHED_NF4, np.float32)[idx]
    blocks = values.reshape(*values.shape[:-1], -1, 64) * np.asarray(absmax)[..., None]
    return blocks.reshape(values.shape)


def test_nf4_stores_each_value_as_its_nearest_code_in_half_a_byte():
    w = jax.random.normal(jax.random.key(1), (2, 8, 128))
    codes, absmax = quant.quantize("nf4", w, (1,))
    assert codes.dtype == jnp.uint8 and codes.shape == (2, 8, 64) and absmax.shape == (2, 8, 2)
    got = _unpacked_nf4(codes, absmax)
    np.testing.assert_allclose(quant.dequantize("nf4", codes, absmax), got, rtol=1e-6, atol=1e-7)
    # the nearest of the 16 values: within half the widest gap, times the block's absmax
    half_gap = np.max(np.diff(PUBLISHED_NF4)) / 2
    blocks_absmax = np.repeat(np.asarray(absmax), 64, -1)
    assert np.all(np.abs(got - np.asarray(w)) <= half_gap * blocks_absmax + 1e-6)


@pytest.mark.slow  # 8 s and 5 s: out of the fast tier
@pytest.mark.parametrize("base", ["nf4", "int8"])
def test_a_quantized_base_trains_as_its_dequantized_fp32_model(base, devices):
    overrides = (*LORA, *NF4_DIMS, f"adapter.base={base}")
    cfg, plain, adapted, batch = _problems(overrides)
    params = adapted.init(jax.random.key(cfg.train.seed))
    stored = {k: v for k, v in params.items() if k in adapted.frozen}
    fp32 = lora.merged(plain, cfg.adapter, cfg.model, stored)
    want = float(jnp.mean(plain.loss(fp32, batch)))
    run = trained("llama-tiny", ["parallel.data=2", "parallel.zero=3", *overrides], steps=1)
    assert abs(run.losses[0] - want) <= 1e-5 * abs(want)
    assert run.params["blocks/attn/wq/codes"].dtype == (np.uint8 if base == "nf4" else np.int8)


@pytest.mark.slow  # 2.9 s: the full suite's (the fast tier's budget, issue 59)
def test_only_the_adapters_cross_the_data_axis(devices):
    full = compile_only("llama-tiny", ("model.layers=2", "parallel.data=8"))
    lora_ = compile_only("llama-tiny", (*LORA, "parallel.data=8"))
    assert 1.0 <= lora_.comm.ratio <= 1.001, lora_.comm
    assert lora_.comm.wire_bytes_per_device < full.comm.wire_bytes_per_device / 5


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_a_qlora_step_over_tensor_sends_at_least_its_minimum(kv_heads, devices):
    """The tensor minimum of an adapter run counts no gradient of the frozen base and the
    adapters' partial ones (wq's A; with 1 kv head over tensor=2, wv's A and B too). It
    held the base's wk and wv gradients and none of the adapters', so the ratio read 0.96.
    With 1 kv head the wire is above it by what jaxpar's LoRA sends instead of A and B's
    gradients: the merged [embed, kv x head_dim] weight's, summed over tensor a layer."""
    overrides = ("adapter.kind=lora", "adapter.base=nf4", "parallel.data=4", "parallel.tensor=2")
    dims = ("model.embed=128", "model.heads=2", f"model.kv_heads={kv_heads}", "model.mlp=128")
    comm = compile_only("llama-tiny", (*overrides, *dims)).comm
    tensor = comm.by_axis["tensor"]
    merged = 4 * 4 * (128 * 64 - (128 * 8 + 8 * 64)) if kv_heads == 1 else 0  # layers x bytes
    assert 0 <= tensor.wire - tensor.minimum - merged <= 0.002 * tensor.minimum, comm
    assert comm.ratio >= 1.0, comm


def nf4_base_bytes(cfg, plain) -> float:
    """An NF4 base's bytes: each quantized weight of n elements n/2 bytes of codes and a
    fp32 scale per 64, the rest bf16."""
    quantized = {p.key for p in lora.quantized_of(cfg.adapter, cfg.model, plain.shapes)}
    return sum(
        s.size * (0.5 + 4 / 64) if k in quantized else 2 * s.size for k, s in plain.shapes.items()
    )


@pytest.mark.slow  # 5 s: out of the fast tier
def test_a_device_s_base_bytes_are_the_formula_s_and_the_planner_s(devices):
    """QLoRA's base on one device is nf4_base_bytes. Split (tensor=2, ZeRO-3 over
    data=4), the compiled base is the planner's; `jaxpar inspect`'s start-up says it."""
    nf4 = (*LORA, *NF4_DIMS, "adapter.base=nf4")
    cfg, plain, adapted, _ = _problems(nf4)
    want = nf4_base_bytes(cfg, plain)
    assert compile_only("llama-tiny", (*nf4, "parallel.data=1")).memory_per_device.base == want
    split = ("parallel.data=4", "parallel.tensor=2", "parallel.zero=3")
    run = prepared("llama-tiny", (*nf4, *split))
    compiled = run.report
    rows = {r["path"]: r for r in inspection.leaves(run)}  # jaxpar inspect's leaf table
    assert rows["blocks/attn/wq/codes"]["grad"] is None is rows["blocks/attn/wq/codes"]["opt"]
    assert "data" in tuple(rows["blocks/attn/wq/lora_a"]["opt"])  # ZeRO-3 splits A's state
    cfg = presets.load("llama-tiny", [*nf4, *split])
    mesh = resolve_degrees(cfg.parallel, 8)
    machine = planner.machine(8, "80GB")
    guess = planner.predict(cfg, mesh, machine, adapted, planner.of_config(cfg))
    assert compiled.memory_per_device.base == guess.base < want / 4  # 1/8 but norms
    assert "of them the frozen base" in console.startup(compiled, 1, "cpu", "synthetic")


@pytest.mark.slow
def test_qlora_plans_llama3_8b_on_one_24gb_device(capsys):
    """The issue's plan: it fits, and shows the base, the adapters, their optimizer state
    and the activations apart; the base is what NF4 makes of 8B parameters."""
    argv = ["plan", "--config", "llama3-8b", "adapter.kind=lora", "adapter.base=nf4",
            "train.seq_len=4096", "--devices", "1", "--device-memory", "24GB"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    ranked = next(p for p in out.split("\n\n") if "device GiB" in p)  # the table
    header, _, best = ranked.splitlines()[:3]

    def cell(name: str) -> str:  # the table's columns are right-aligned under their names
        return best[: header.index(name) + len(name)].split()[-1]

    cfg = presets.load("llama3-8b", ["adapter.kind=lora", "adapter.base=nf4"])
    plain = registered(cfg.model, 4096)
    base = nf4_base_bytes(cfg, plain)
    assert float(cell("frozen")) == round(base / 2**30, 1) == 5.6
    assert float(cell("device GiB")) <= 24e9 / 2**30
    assert float(cell("activations")) > 0 and 0 < int(cell("opt state MiB")) < 100
    assert "recommended: dp1 pp1 tp1" in out


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (
            ["adapter.kind=lora", "adapter.targets=q_proj,x_proj"],
            ["adapter.targets", "x_proj", "o_proj"],
        ),
        (["adapter.kind=lora", "adapter.rank=0"], ["adapter.rank", "out of range"]),
        (
            ["adapter.kind=lora", "adapter.base=nf4"],
            ["adapter.base=nf4", "blocks of 64", "head_dim"],
        ),
        (["adapter.kind=lora", "adapter.dropout=0.1"], ["adapter.dropout=0.1"]),
        (["adapter.rank=16"], ["adapter.rank=16", "adapter.kind=lora"]),
        (["--config", "gpt-tiny", "adapter.kind=lora"], ["model.name=gpt", "no projections"]),
        (["adapter.kind=lora", "parallel.dp_sync=params"], ["parallel.dp_sync=params"]),
        (["adapter.kind=lora", "adapter.init=peft:/x"], ["adapter.init=peft:/x", "peft:DIR"]),
        (["adapter.kind=lora", "adapter.init=peft:."], ["adapter.init=peft:.", "model.init=hf:"]),
    ],
    # fmt: off
    ids=[
        "unknown-target",
        "rank-0",
        "nf4-block",
        "dropout",
        "no-kind",
        "gpt",
        "dp-sync",
        "init",
        "init-no-base",
    ],
    # fmt: on
)
def test_bad_adapter_keys_are_one_line(overrides, needles, capsys, tmp_path):
    config = [] if "--config" in overrides else ["--config", "llama-tiny"]
    argv = ["train", *config, *overrides, "train.steps=1", "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    from helpers import one_line_error

    one_line_error(capsys, *needles)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_adapter_checkpoint_holds_the_adapters_and_a_reference_to_its_base(
    tmp_path, devices, capsys
):
    """A QLoRA run in 3D with 1F1B saves its adapters, their optimizer state and a
    reference to its base (no base leaf); it resumes bitwise, restores into another
    layout, refuses another base (a restore, a PEFT export), exports merged and as PEFT,
    and decodes."""
    import shutil

    import jaxpar
    from jaxpar.errors import CheckpointError
    from jaxpar.generation import decoding
    from jaxpar.training import checkpoint, export

    def run_in(layout, *more):
        cfg, s = _setup("llama-tiny", [*LORA, *NF4_DIMS, "adapter.base=nf4", *layout, *more])
        return cfg, s

    steps = ["train.steps=3", "checkpoint.every=2"]
    cfg, s = run_in(THREE_D_1F1B, *steps)
    out = tmp_path / "run"
    straight = jaxpar.train(s.problem, cfg, s.batches, mesh=s.mesh, out_dir=out, quiet=True)
    saved, meta = checkpoint.saved_params(out / "checkpoints")
    assert set(saved) == {k for p in lora.targets_of(cfg.adapter, cfg.model) for k in (p.a, p.b)}
    assert meta["base"]["from"] == "train.seed=0" and len(meta["base"]["hash"]) == 16
    tree = checkpoint.Checkpoints(out / "checkpoints", create=False).saved_tree(3)
    held = {"/".join(map(str, p)) for p, _ in jax.tree_util.tree_leaves_with_path(tree)}
    assert not [k for k in held if "codes" in k or "norm" in k or "embed" in k]  # no base leaf

    shutil.move(out / "checkpoints" / "3", tmp_path / "3")  # resume from step 2
    resumed = jaxpar.train(s.problem, cfg, s.batches, mesh=s.mesh, out_dir=out, quiet=True)
    assert len(resumed.losses) == 1 and resumed.losses[-1] == straight.losses[-1]
    for k, v in straight.params.items():
        np.testing.assert_array_equal(np.asarray(resumed.params[k]), np.asarray(v), err_msg=k)

    cfg2, s2 = run_in(["parallel.data=4", "parallel.context=2"], *steps)
    state = jaxpar.restore(out / "checkpoints", s2.problem, cfg2, s2.mesh)
    for k, v in straight.params.items():
        np.testing.assert_array_equal(np.asarray(state.params[k]), np.asarray(v), err_msg=k)
    cfg3, s3 = run_in(["parallel.data=4", "parallel.context=2"], *steps, "train.seed=1")
    with pytest.raises(CheckpointError, match="train.seed=0.*fingerprint.*changed"):
        jaxpar.restore(out / "checkpoints", s3.problem, cfg3, s3.mesh)

    params, meta = export.run_params(out)
    want = lora.merged(registered(cfg.model, cfg.train.seq_len), cfg.adapter, cfg.model, params)
    loaded = decoding.load(str(out), [], devices=devices[:2])
    for k, w in want.items():
        np.testing.assert_array_equal(np.asarray(loaded.params[k]), np.asarray(w))
    out_tokens = decoding.generate(
        decoding.Decoder(loaded), [[1, 2, 3]], 4, decoding.Sampling(temperature=0.0), set()
    )
    assert len(out_tokens.completions[0]) == 4
    assert cli.main(["export", str(out), "--to", str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert cli.main(["export", str(out), "--to", str(tmp_path / "peft"), "--format", "peft"]) == 0
    assert (tmp_path / "peft" / "adapter_model.safetensors").is_file()

    # a base that changed since: PEFT would load the adapters onto it without a word
    saved_meta = out / "checkpoints" / "3" / "meta" / "metadata"
    saved_meta.write_text(saved_meta.read_text().replace(meta["base"]["hash"], "0" * 16))
    capsys.readouterr()
    to = tmp_path / "peft-changed"
    assert cli.main(["export", str(out), "--to", str(to), "--format", "peft"]) == 2
    err = capsys.readouterr().err
    assert "fingerprint 0000000000000000" in err and "--restart`)" in err and not to.exists()


def test_the_start_up_summary_counts_what_trains_as_peft_does():
    """Trainable: the adapters' A and B alone (found by their names), of all the model's
    parameters (the frozen base included); the adapters and the base's storage named."""
    from jaxpar.training import trainer

    cfg = presets.load("llama-tiny", ["adapter.kind=lora", "adapter.base=bf16"])
    problem = lora.adapted(registered(cfg.model, cfg.train.seq_len), cfg.adapter, cfg.model)
    total, trainable = trainer._counts(problem)
    names = {k for p in lora.targets_of(cfg.adapter, cfg.model) for k in (p.a, p.b)}
    sizes = {k: int(np.prod(s.shape)) for k, s in problem.shapes.items()}
    assert trainable == sum(sizes[k] for k in names) and total == sum(sizes.values())
    lines = console._trains(presets.to_dict(cfg), total, trainable)
    assert "LoRA rank 8 on q_proj,v_proj, its base frozen (bf16)" in lines[0], lines
    assert f"trainable params: {trainable:,} || all params: {total:,}" in lines[1], lines


def test_a_finished_adapter_run_names_its_peft_export(tmp_path):
    from jaxpar.training.console import next_steps, typed

    def steps(cfg):
        return next_steps(tmp_path, cfg.model.name, cfg.adapter, cfg.data)

    lora = steps(presets.load("llama-tiny", ["adapter.kind=lora"]))
    jaxpar = typed()  # as the shell runs it here: the venv's path, or `jaxpar` on the PATH
    assert f"{jaxpar} export {tmp_path} --to {tmp_path / 'peft'} --format peft" in lora
    assert not any("peft" in s for s in steps(presets.load("llama-tiny")))


def test_the_base_fingerprint_is_its_formula_in_any_layout(devices):
    """The sum a checkpoint's base reference is made of: every element's bits times
    (position * 2654435761 + 1), mod 2**32, whatever the sharding computing it."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxpar.adapters.base import leaf_sum

    x = jax.random.normal(jax.random.key(0), (8, 6, 4)).astype(jnp.bfloat16)
    bits = np.asarray(x).view(np.uint16).astype(np.uint64).ravel()
    weights = (np.arange(bits.size, dtype=np.uint64) * 2654435761 + 1) % 2**32
    want = int((bits * weights).sum() % 2**32)
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    split = jax.device_put(x, NamedSharding(mesh, PartitionSpec("b", None, "a")))
    assert int(leaf_sum(x)) == int(leaf_sum(split)) == want
    assert int(leaf_sum(x.at[3, 2, 1].add(1))) != want
