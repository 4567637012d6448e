"""DeepSeek-V3 and Qwen2-MoE (the Llama model with latent attention, shared experts and
their routers) against `transformers` itself, every trait switched on: the first step's
loss on one device, with expert=4 x tensor=2 and in a pipeline; logits after training
and exporting; greedy continuations through the latent cache, token for token. Then
DeepSeek's balancing bias: it moves by DeepSeek's rule, takes no gradient of the loss,
is the same on every device and is saved as it is."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the test extra installs torch (CPU) on 3.11")
transformers = pytest.importorskip("transformers")

from helpers import changed_config, family_logits, save_drawn  # noqa: E402
from test_mixtral import theirs  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar import hf, recipe  # noqa: E402
from jaxpar.cli import main as cli  # noqa: E402
from jaxpar.config import presets, registry  # noqa: E402
from jaxpar.generation import decoding  # noqa: E402
from jaxpar.nn.layers import unrolled  # noqa: E402
from jaxpar.parallel.axes import AXES  # noqa: E402

pytestmark = pytest.mark.slow  # trains, and runs transformers

BALANCE = 0.02  # Qwen2-MoE's router_aux_loss_coef, on in both
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=8,
              rms_norm_eps=1e-5, max_position_embeddings=512,
              tie_word_embeddings=False)  # fmt: skip
# YaRN as DeepSeek-V3's release sets it (there: factor 40 from 4096 positions, mscale =
# mscale_all_dim = 1); here mscale_all_dim 0.8, so that the rotated q and k are scaled
# (1.025) as well as the softmax (1.234)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,
        "original_max_position_embeddings": 16}  # fmt: skip
FAMILIES = {
    # latent attention with a query latent, values narrower than the keys; the first
    # block dense; 8 experts in 4 groups, 2 a token from the 2 best groups, scaled; two
    # shared experts; a balancing bias drawn away from 0 (it must choose); YaRN, as the
    # releases have it, its attention factor and softmax factor both off 1
    "deepseek_v3": (
        transformers.DeepseekV3ForCausalLM,
        transformers.DeepseekV3Config(
            **COMMON,
            num_key_value_heads=8,
            num_hidden_layers=3,
            moe_intermediate_size=32,
            n_shared_experts=2,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=12,
            v_head_dim=10,
            routed_scaling_factor=2.5,
            rope_parameters=YARN,
        ),  # fmt: skip
        "deepseek-tiny",
    ),
    # a gated shared expert; a mixture in every second block, its experts narrower than
    # the dense blocks' MLP; the k weights renormalized
    "qwen2_moe": (
        transformers.Qwen2MoeForCausalLM,
        transformers.Qwen2MoeConfig(
            **COMMON,
            num_key_value_heads=2,
            num_hidden_layers=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            norm_topk_prob=True,
            router_aux_loss_coef=BALANCE,
            output_router_logits=False,
        ),  # fmt: skip
        "qwen2_moe-tiny",
    ),
}


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(family, its preset, a random tiny checkpoint of it saved by transformers)."""
    model_class, config, preset = FAMILIES[request.param]
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    return request.param, preset, save_drawn(model_class(config), directory)


def test_the_checkpoint_reads_as_its_traits(checkpoint):
    family, preset, directory = checkpoint
    cfg = presets.resolve_init(presets.load(preset, [f"model.init=hf:{directory}"]), set())
    m = cfg.model
    if family == "deepseek_v3":
        traits = (m.kv_rank, m.q_rank, m.rope_dim, m.head_dim, m.v_dim, m.router, m.experts,
                  m.router_groups, m.router_top_groups, m.routed_scaling, m.dense_first,
                  m.expert_mlp, m.shared_mlp, m.kv_heads)  # fmt: skip
        assert traits == (16, 24, 8, 12, 10, "sigmoid", 8, 4, 2, 2.5, 1, 32, 64, 8)
        rope = (m.rope_scaling, m.rope_factor, m.rope_original_positions, m.rope_mscale,
                m.rope_mscale_all_dim, m.rope_beta_fast, m.rope_truncate)  # fmt: skip
        assert rope == ("yarn", 4.0, 16, 1.0, 0.8, 32.0, True)
    else:
        traits = (m.experts, m.moe_every, m.mlp, m.expert_mlp, m.shared_mlp, m.shared_gate)
        assert traits == (4, 2, 96, 32, 48, True)


LAYOUTS = {
    "one device": ("parallel.data=1", "model.capacity_factor=0"),
    # the capacity path, at a capacity that drops nothing (experts / k)
    "expert=4 x tensor=2": (
        "parallel.data=1",
        "parallel.expert=4",
        "parallel.tensor=2",
        "model.capacity_factor=4",
    ),  # fmt: skip
    "pipeline=2 x data=2": (
        "parallel.data=2",
        "parallel.pipeline=2",
        "parallel.microbatches=2",
        "model.capacity_factor=0",
    ),  # fmt: skip
}


def micro_batches(rows: np.ndarray, data: int, m: int) -> list[np.ndarray]:
    """The rows each of `m` micro-batches holds: its share of every data shard's rows."""
    shards = np.split(rows, max(data, 1))
    return [np.concatenate([np.split(s, m)[i] for s in shards]) for i in range(m)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_first_step_loss_is_transformers_loss(checkpoint, layout, devices):
    family, preset, directory = checkpoint
    on = [f"model.router_aux_loss={BALANCE}"] if family == "qwen2_moe" else []
    cfg = presets.load(
        preset,
        [f"model.init=hf:{directory}", *on, *LAYOUTS[layout], "train.steps=1", "train.lr=1e-12"],
    )
    cfg = presets.resolve_init(cfg, {"router_aux_loss"})
    n = math.prod(max(getattr(cfg.parallel, a), 1) for a in AXES)
    s = recipe.setup(cfg, devices[:n])
    params = hf.initial_params(registry.get(family).hf, cfg.model, directory, s.problem.shapes)
    result = jaxpar.train(s.problem, cfg, s.batches, mesh=s.mesh, params=params, quiet=True)
    tokens = s.batches(0)["tokens"]
    logits, _ = theirs(directory, tokens[:, :-1])
    # a pipeline's balance is each micro-batch's, averaged (as Megatron-LM's: a 1F1B
    # micro-batch runs its backward before the later ones run forward)
    parts = micro_batches(tokens[:, :-1], cfg.parallel.data, cfg.parallel.microbatches)
    balance = np.mean([theirs(directory, part)[1] for part in parts])
    loss = torch.nn.functional.cross_entropy(
        torch.tensor(logits).reshape(-1, 256), torch.tensor(tokens[:, 1:].reshape(-1)).long()
    ).item()
    weight = BALANCE if on else 0.0
    assert result.losses[0] == pytest.approx(loss + weight * balance, rel=1e-5)


def test_trained_and_exported_logits_are_transformers_logits(checkpoint, tmp_path, devices):
    """Three steps (data=4 x tensor=2, ZeRO-3; DeepSeek's bias moving), `jaxpar export
    --format hf`, loaded back by transformers: its logits within 1e-4 of their scale of
    jaxpar's, and the config as read."""
    family, preset, directory = checkpoint
    run = tmp_path / "run"
    argv = ["train", "--config", preset, f"model.init=hf:{directory}", "model.capacity_factor=0",
            "parallel.data=4", "parallel.tensor=2", "parallel.zero=3", "train.steps=3",
            "--out", str(run)]  # fmt: skip
    assert cli.main(argv) == 0
    assert cli.main(["export", str(run), "--to", str(tmp_path / "out"), "--format", "hf"]) == 0
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "out").to_dict()
    read = FAMILIES[family][1].to_dict()
    kept = ["architectures", "n_routed_experts", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "n_shared_experts", "shared_expert_intermediate_size",
            "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace",
            "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
            "v_head_dim", "decoder_sparse_step", "norm_topk_prob", "intermediate_size"]  # fmt: skip
    assert {k: exported.get(k) for k in kept} == {k: read.get(k) for k in kept}
    rope = exported["rope_parameters"]
    assert {k: rope.get(k) for k in read["rope_parameters"]} == read["rope_parameters"]
    params, meta = jaxpar.training.checkpoint.saved_params(run / "checkpoints")
    cfg = presets.from_dict(meta["config"])
    tokens = np.random.default_rng(0).integers(0, 256, (2, 40))
    want, _ = theirs(tmp_path / "out", tokens)
    err = np.abs(family_logits(cfg, params, tokens) - want).max() / np.abs(want).max()
    assert err < 1e-4, err


@pytest.mark.parametrize("layout", [("parallel.data=1",), ("parallel.tensor=2",)])
def test_greedy_continuations_are_transformers_generate(checkpoint, layout, devices):
    """DeepSeek's through the latent cache (the latent and the rotated key alone)."""
    from test_generate import PROMPTS, transformers_greedy

    family, _, directory = checkpoint
    model = decoding.load(f"hf:{directory}", list(layout), devices=devices[:2])
    if family == "deepseek_v3":  # 3 layers x (8 rotated key + 16 latent dims) x 4 bytes
        assert decoding.cache_bytes_per_token(model) == 3 * (8 + 16) * 4
    done = decoding.generate(decoding.Decoder(model), PROMPTS, 32, decoding.Sampling(), set())
    assert done.completions == transformers_greedy(directory, PROMPTS, 32)


REFUSED = {
    "rotated dims not interleaved": (
        {"rope_interleave": False},
        ["rope_interleave=false is not supported"],
    ),
    "YaRN without its original length": (
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0}},
        ["rope_type='yarn' without original_max_position_embeddings", "add it"],
    ),
    "LongRoPE": (
        {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}},
        ["rope_type='longrope' is not supported", "yarn"],
    ),
}


@pytest.mark.parametrize("checkpoint", ["deepseek_v3"], indirect=True)
@pytest.mark.parametrize("case", REFUSED)
def test_a_checkpoint_jaxpar_cannot_express_is_refused(checkpoint, case, capsys, tmp_path):
    _, preset, directory = checkpoint
    change, needles = REFUSED[case]
    changed = changed_config(directory, change, tmp_path / "hf")
    argv = ["train", "--config", preset, f"model.init=hf:{changed}", "--out", str(tmp_path / "r")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(n in err for n in needles), err


# DeepSeek's balancing bias, on deepseek-tiny itself (random weights)

STEP = 0.01


def _bias_run(devices, *overrides, steps=1, out_dir=None):
    cfg = presets.load(
        "deepseek-tiny",
        ["model.capacity_factor=0", f"train.steps={steps}", "train.batch_size=8", *overrides],
    )
    n = math.prod(max(getattr(cfg.parallel, a), 1) for a in AXES)
    s = recipe.setup(cfg, devices[:n])
    first = s.problem.init(jax.random.key(cfg.train.seed))
    result = jaxpar.train(s.problem, cfg, s.batches, mesh=s.mesh, quiet=True, out_dir=out_dir)
    return cfg, s, first, result


def _counts(cfg, params, batch) -> np.ndarray:
    """[layers, experts] each sparse layer's choices of the batch's trained tokens, by a
    plain forward pass on one device (compiled once for the model, not run op by op)."""
    params = jax.device_get(params)
    return np.asarray(_counting(cfg.model)(params, jax.device_get(batch)))


@functools.cache
def _counting(model_cfg):
    from jaxpar.nn import documents
    from jaxpar.nn.problem import registered

    @jax.jit
    def counts(params, batch):
        tokens = documents.inputs(batch)
        model = registered(model_cfg, tokens.shape[1]).module(params)
        docs, trained = documents.of_inputs(batch), documents.target_weights(batch)
        layers = model.blocks.attn_norm.scale.shape[0]
        _, loads = unrolled(
            model.blocks,
            model.embed(tokens, docs),
            [None] * layers,
            lambda block, x, _: block.routed(x, docs, trained),
        )
        return jnp.stack([load.trained.sum(0) for load in loads])

    return counts


def test_the_balancing_bias_moves_by_deepseeks_rule_on_every_device_alike(devices, tmp_path):
    """One step over data=2 x expert=2 x tensor=2: each layer's bias moves by STEP toward
    the mean load of the whole batch's choices (up below it, down above, 0 at it), the
    same bits on every device; a bias that does not move is not trained by the loss."""
    layout = ("parallel.data=2", "parallel.expert=2", "parallel.tensor=2")
    cfg, s, first, result = _bias_run(devices, f"model.router_bias_update={STEP}", *layout)
    counts = _counts(cfg, first, s.batches(0))
    want = first["blocks/mlp/bias"] + STEP * np.sign(counts.mean(-1, keepdims=True) - counts)
    bias = result.params["blocks/mlp/bias"]
    np.testing.assert_array_equal(np.asarray(bias), np.asarray(want, np.float32))
    assert np.abs(np.asarray(bias)).max() == pytest.approx(STEP)
    shards = [np.asarray(x.data) for x in bias.addressable_shards]
    assert len(shards) == 8 and all(np.array_equal(x, shards[0]) for x in shards)
    # no update step: the bias stays as it was, whatever the learning rate
    _, _, first, fixed = _bias_run(
        devices[:1], "model.router_bias_update=0", "train.lr=0.1", steps=2
    )
    np.testing.assert_array_equal(fixed.params["blocks/mlp/bias"], first["blocks/mlp/bias"])


def test_the_balancing_bias_evens_the_load_and_is_saved(devices, tmp_path):
    """With the weights held (a learning rate of 1e-12), 30 steps of the bias alone (at
    DeepSeek's step, 0.001) even each layer's load on batches it has not seen: the
    busiest expert's share over the mean's, from 1.18, 1.07, 1.33 to 1.10, 1.06, 1.13
    (a step of 0.01 overshoots: 1.27, 1.39, 1.35). The checkpoint holds the bias as
    trained."""
    cfg, s, first, result = _bias_run(
        devices, "model.router_bias_update=0.001", "train.lr=1e-12", "train.warmup=0",
        "parallel.data=-1", "data.source=synthetic", steps=30, out_dir=tmp_path / "run",
    )  # fmt: skip

    def busiest_over_mean(params):
        counts = np.mean([_counts(cfg, params, s.batches(i)) for i in range(30, 34)], 0)
        return counts.max(-1) / counts.mean(-1)

    before, after = busiest_over_mean(first), busiest_over_mean(result.params)
    assert after.mean() < before.mean() - 0.05 and (after < before + 0.01).all(), (before, after)
    params, _ = jaxpar.training.checkpoint.saved_params(tmp_path / "run" / "checkpoints")
    np.testing.assert_array_equal(params["blocks/mlp/bias"], result.params["blocks/mlp/bias"])


# deepseek-tiny's every trait (latent attention, groups, shared experts, the bias moving
# each step, the first block dense), dropless and at a capacity, in layouts of every axis
DEEPSEEK_LAYOUTS = {
    "expert4-tp2": (
        "parallel.data=1", "parallel.expert=4", "parallel.tensor=2", "model.capacity_factor=0"
    ),
    "expert2-dp2-tp2-zero3-capacity": (
        "parallel.expert=2", "parallel.data=2", "parallel.tensor=2", "parallel.zero=3",
        "model.capacity_factor=4",
    ),
    "ctx2-expert2-dp2": (
        "parallel.context=2", "parallel.expert=2", "parallel.data=2", "model.capacity_factor=0"
    ),
    "ctx2-ulysses-tp2-dp2": (
        "parallel.context=2", "parallel.context_strategy=ulysses", "parallel.tensor=2",
        "parallel.data=2", "model.capacity_factor=0",
    ),
    "pp3-1f1b-m2": (
        "parallel.data=1", "parallel.pipeline=3", "parallel.microbatches=2",
        "parallel.schedule=1f1b", "model.capacity_factor=0",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", DEEPSEEK_LAYOUTS)
def test_deepseek_trains_in_every_layout_as_on_one_device(name):
    from helpers import assert_same_training, trained
    from helpers import reference as shared_reference

    overrides = DEEPSEEK_LAYOUTS[name]
    capacity = tuple(o for o in overrides if o.startswith("model.capacity_factor"))
    want = shared_reference("deepseek-tiny", capacity)
    assert_same_training(trained("deepseek-tiny", overrides), want)


@pytest.mark.parametrize(
    "layout",
    [("parallel.context=2", "parallel.data=4"),
     ("parallel.context=2", "parallel.tensor=2", "parallel.data=2", "parallel.remat=full")],
)  # fmt: skip
def test_context_gathers_the_latent_at_the_textbook_minimum(layout, devices):
    """Under context's all_gather, latent attention gathers each token's latent and
    rotated key (32 + 8 values a layer), not the keys and values they expand to (2 x 8
    heads x 24): comm.by_axis.context at the ledger's minimum, which counts that."""
    from helpers import compile_only

    comm = compile_only("deepseek-tiny", ("model.capacity_factor=0", *layout)).comm
    context = comm.by_axis["context"]
    assert context.wire == pytest.approx(context.minimum, rel=0.02)


LATENT_TARGETS = "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj"
SHARED_TARGETS = "shared_experts.gate_proj,shared_experts.up_proj,shared_experts.down_proj"


def _adapted_run(directory, tmp_path, targets: str):
    """(config, merged parameters, the run) of 3 LoRA steps over data=4 x tensor=2."""
    from jaxpar.adapters import lora
    from jaxpar.nn.problem import registered
    from jaxpar.training import export

    run = tmp_path / "run"
    keys = ["adapter.kind=lora", "adapter.rank=4", f"adapter.targets={targets}",
            "model.capacity_factor=0"]  # fmt: skip
    argv = ["train", "--config", "deepseek-tiny", f"model.init=hf:{directory}", *keys,
            "parallel.data=4", "parallel.tensor=2", "train.steps=3", "train.lr=1e-2",
            "--out", str(run)]  # fmt: skip
    assert cli.main(argv) == 0
    cfg = presets.load("deepseek-tiny", [f"model.init=hf:{directory}", *keys])
    cfg = presets.resolve_init(cfg, set())
    params, _ = export.run_params(run)
    merged = lora.merged(registered(cfg.model, cfg.train.seq_len), cfg.adapter, cfg.model, params)
    return cfg, params, {k: np.asarray(v) for k, v in merged.items()}, run


@pytest.mark.parametrize("checkpoint", ["deepseek_v3"], indirect=True)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_adapters_on_latent_attention_and_the_shared_expert(checkpoint, tmp_path, devices):
    """LoRA on the latent attention's projections and the shared expert's (by the dotted
    end of its path: not the dense block's), trained over data=4 x tensor=2: exported
    merged (--format hf), transformers gives jaxpar's logits; latent attention's exported
    with --format peft, PEFT's model on transformers' does. (PEFT 0.21 on transformers 5
    reads a target ending in gate_proj, up_proj or down_proj of DeepSeek as the routed
    experts' fused parameters alone, and adapts no shared expert.)"""
    peft = pytest.importorskip("peft")
    _, _, directory = checkpoint
    tokens = np.random.default_rng(0).integers(0, 256, (2, 40))
    targets = f"{LATENT_TARGETS},{SHARED_TARGETS}"
    cfg, params, merged, run = _adapted_run(directory, tmp_path / "both", targets)
    shared = sorted(k for k in params if k.startswith("blocks/shared/") and k.endswith("lora_a"))
    assert shared == [f"blocks/shared/w_{w}/lora_a" for w in ("down", "gate", "up")]
    assert not any(k.startswith("first/mlp/") and "lora" in k for k in params)
    assert cli.main(["export", str(run), "--to", str(tmp_path / "hf"), "--format", "hf"]) == 0
    want, _ = theirs(tmp_path / "hf", tokens)
    assert np.abs(family_logits(cfg, merged, tokens) - want).max() / np.abs(want).max() < 1e-5

    cfg, _, merged, run = _adapted_run(directory, tmp_path / "latent", LATENT_TARGETS)
    assert cli.main(["export", str(run), "--to", str(tmp_path / "peft"), "--format", "peft"]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    model = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    with torch.no_grad():
        want = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(family_logits(cfg, merged, tokens) - want).max() / np.abs(want).max() < 1e-5
