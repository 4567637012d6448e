"""Gemma 2 and Gemma 3 (the Llama model with local and global attention, soft caps,
(1 + w) norms before and after each sub-block, GeGLU, scaled and tied embeddings)
against `transformers` itself, on random checkpoints with a window shorter than the
sequences and every trait switched on: the first step's loss on one device, under
tensor=2 x context=2 and in a pipeline; logits after training and exporting; greedy
continuations past the window through the local layers' ring caches."""

import json
import math

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the test extra installs torch (CPU) on 3.11")
transformers = pytest.importorskip("transformers")

from helpers import changed_config, family_logits, run_logits_error, save_drawn  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar import hf, recipe  # noqa: E402
from jaxpar.cli import main as cli  # noqa: E402
from jaxpar.config import presets, registry  # noqa: E402
from jaxpar.generation import decoding  # noqa: E402
from jaxpar.nn.problem import registered  # noqa: E402
from jaxpar.parallel.axes import AXES  # noqa: E402

pytestmark = pytest.mark.slow  # trains, and runs transformers

WINDOW = 6  # shorter than every sequence trained and generated
# heads of their own size (24, not 64 / 4), scaled by 20^-0.5 (not 24^-0.5); caps low
# enough to bite: the logits reach about 1.6, Gemma 2's scores about 3
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6,
              max_position_embeddings=512, query_pre_attn_scalar=20, sliding_window=WINDOW,
              final_logit_softcapping=2.0, tie_word_embeddings=True)  # fmt: skip
FAMILIES = {
    # local and global blocks in turn; attention scores capped
    "gemma2": (
        transformers.Gemma2ForCausalLM,
        transformers.Gemma2Config(**COMMON, num_hidden_layers=4, attn_logit_softcapping=3.0),
    ),
    # every third block global: two groups and a last local block; q/k norms; the
    # global blocks' rotary base linearly scaled, the local ones' of their own
    "gemma3": (
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig(
            **COMMON,
            num_hidden_layers=7,
            sliding_window_pattern=3,
            attn_logit_softcapping=None,  # transformers' Gemma 3 never applies one
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            },
        ),
    ),
}


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(family, a random tiny checkpoint of it saved by transformers)."""
    model_class, config = FAMILIES[request.param]
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    return request.param, save_drawn(model_class(config), directory)


def theirs(directory, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def test_the_checkpoint_reads_as_its_traits(checkpoint):
    family, directory = checkpoint
    cfg = presets.load(f"{family}-tiny", [f"model.init=hf:{directory}"])
    m = presets.resolve_init(cfg, set()).model
    traits = (m.global_every, m.sliding_window, m.head_dim, m.query_scale, m.logit_softcap,
              m.attn_softcap, m.norm_offset, m.post_norms, m.embed_scale, m.activation,
              m.tie_embeddings, m.qk_norm)  # fmt: skip
    if family == "gemma2":
        assert traits == (2, WINDOW, 24, 20, 2.0, 3.0, True, True, True, "gelu_tanh", True, False)
    else:
        assert traits == (3, WINDOW, 24, 20, 2.0, 0.0, True, True, True, "gelu_tanh", True, True)
        rope = (m.rope_theta, m.rope_scaling, m.rope_factor, m.rope_local_theta, m.tail_size)
        assert rope == (1e5, "linear", 2.0, 500.0, 1)


LAYOUTS = {
    "one device": ("parallel.data=1",),
    # the window's mask by positions, across the balanced reorder of the sequence
    "tensor=2 x context=2": ("parallel.data=1", "parallel.tensor=2", "parallel.context=2"),
    "pipeline=2 x data=2": ("parallel.data=2", "parallel.pipeline=2", "parallel.microbatches=2"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_first_step_loss_is_transformers_loss(checkpoint, layout, devices):
    family, directory = checkpoint
    assert first_step_loss(family, directory, layout, devices) == pytest.approx(
        transformers_loss(directory, first_step_loss.tokens), rel=1e-5
    )


def first_step_loss(family: str, directory, layout: str, devices) -> float:
    """jaxpar's first-step loss of `directory` in `layout`; its batch's tokens kept as
    first_step_loss.tokens."""
    cfg = presets.load(
        f"{family}-tiny",
        [f"model.init=hf:{directory}", *LAYOUTS[layout], "train.steps=1", "train.lr=1e-12"],
    )
    cfg = presets.resolve_init(cfg, set())
    n = math.prod(max(getattr(cfg.parallel, a), 1) for a in AXES)
    s = recipe.setup(cfg, devices[:n])
    params = hf.initial_params(registry.get(family).hf, cfg.model, directory, s.problem.shapes)
    result = jaxpar.train(s.problem, cfg, s.batches, mesh=s.mesh, params=params, quiet=True)
    first_step_loss.tokens = s.batches(0)["tokens"]
    return result.losses[0]


def transformers_loss(directory, tokens: np.ndarray) -> float:
    logits = theirs(directory, tokens[:, :-1])
    return torch.nn.functional.cross_entropy(
        torch.tensor(logits).reshape(-1, 256), torch.tensor(tokens[:, 1:].reshape(-1)).long()
    ).item()


def test_trained_and_exported_logits_are_transformers_logits(checkpoint, tmp_path, capsys):
    """Three steps (data=4 x tensor=2, ZeRO-3), `jaxpar export --format hf`, loaded back
    by transformers: its logits within 1e-4 of their scale of jaxpar's; the config's
    Gemma keys as read. A multimodal layout, with no vision tower to carry, is refused."""
    family, directory = checkpoint
    run = tmp_path / "run"
    argv = ["train", "--config", f"{family}-tiny", f"model.init=hf:{directory}",
            "parallel.data=4", "parallel.tensor=2", "parallel.zero=3", "train.steps=3",
            "--out", str(run)]  # fmt: skip
    assert cli.main(argv) == 0
    assert cli.main(["export", str(run), "--to", str(tmp_path / "out"), "--format", "hf"]) == 0
    argv = ["export", str(run), "--to", str(tmp_path / "mm"), "--format", "hf",
            "--architecture", "Gemma3ForConditionalGeneration"]  # fmt: skip
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--architecture Gemma3ForConditionalGeneration" in err, err
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "out").to_dict()
    read = FAMILIES[family][1].to_dict()
    kept = ["architectures", "model_type", "layer_types", "sliding_window", "head_dim",
            "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
            "hidden_activation", "rope_parameters", "tie_word_embeddings"]  # fmt: skip
    read["architectures"] = [FAMILIES[family][0].__name__]
    assert {k: exported.get(k) for k in kept} == {k: read.get(k) for k in kept}
    tokens = np.random.default_rng(0).integers(0, 256, (2, 40))
    want = theirs(tmp_path / "out", tokens)
    err = run_logits_error(run, want, tokens)
    assert err < 1e-4, err


@pytest.mark.parametrize("layout", [("parallel.data=1",), ("parallel.tensor=2",)])
def test_greedy_continuations_past_the_window_are_transformers_generate(
    checkpoint, layout, devices
):
    """32 new tokens after prompts of 3, 21 and 9 ids, a window of 6: the local layers'
    caches are rings of 6 slots, the global layers' hold every slot."""
    from test_generate import PROMPTS, transformers_greedy

    family, directory = checkpoint
    model = decoding.load(f"hf:{directory}", list(layout), devices=devices[:2])
    done = decoding.generate(decoding.Decoder(model), PROMPTS, 32, decoding.Sampling(), set())
    cache = decoding.Decoder(model).empty(done.rows, done.cache_slots)
    slots = [layer[0].shape[-1] for layer in cache]
    local = [
        WINDOW if model.cfg.model.window_of(i) else done.cache_slots for i in range(len(slots))
    ]
    assert slots == local and WINDOW in slots and done.cache_slots in slots
    per_slot = 2 * 2 * 24 * 4  # k and v, 2 kv heads, 24 dims, fp32
    want = per_slot * sum(slots) / done.cache_slots
    assert decoding.cache_bytes_per_token(model, done.cache_slots) == round(want)
    assert done.completions == transformers_greedy(directory, PROMPTS, 32)


REFUSED = {
    "irregular layer types": (
        {
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "full_attention",
                "sliding_attention",
            ]
        },
        ["layer_types=", "every n-th layer full_attention"],
    ),
    "bidirectional attention": (
        {"use_bidirectional_attention": True},
        ["use_bidirectional_attention=true is not supported"],
    ),
}


@pytest.mark.parametrize("checkpoint", ["gemma2"], indirect=True)
@pytest.mark.parametrize("case", REFUSED)
def test_a_checkpoint_jaxpar_cannot_express_is_refused(checkpoint, case, capsys, tmp_path):
    family, directory = checkpoint
    change, needles = REFUSED[case]
    changed = changed_config(directory, change, tmp_path / "hf")
    argv = ["train", "--config", f"{family}-tiny", f"model.init=hf:{changed}",
            "--out", str(tmp_path / "r")]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(n in err for n in needles), err


@pytest.mark.parametrize("checkpoint", ["gemma3"], indirect=True)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_on_gemmas_projections_loads_into_peft(checkpoint, tmp_path):
    """LoRA on every projection (data=4 x tensor=2), exported with --format peft: PEFT's
    Gemma3ForCausalLM with it gives jaxpar's logits within 1e-4 of their scale, and it
    trained. (This checkpoint is ill-conditioned for fp32: transformers' own fp32
    logits are 1.4e-5 of their scale from its fp64 ones, jaxpar's 1.6e-5.)"""
    peft = pytest.importorskip("peft")
    from jaxpar.adapters import lora
    from jaxpar.nn.problem import registered
    from jaxpar.training import export

    family, directory = checkpoint
    run = tmp_path / "run"
    targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    lora_keys = ["adapter.kind=lora", "adapter.rank=4", f"adapter.targets={targets}"]
    argv = ["train", "--config", f"{family}-tiny", f"model.init=hf:{directory}", *lora_keys,
            "parallel.data=4", "parallel.tensor=2", "train.steps=3", "--out", str(run)]  # fmt: skip
    assert cli.main(argv) == 0
    assert cli.main(["export", str(run), "--to", str(tmp_path / "peft"), "--format", "peft"]) == 0
    cfg = presets.load(f"{family}-tiny", [f"model.init=hf:{directory}", *lora_keys])
    cfg = presets.resolve_init(cfg, set())
    params, _ = export.run_params(run)
    merged = lora.merged(registered(cfg.model, cfg.train.seq_len), cfg.adapter, cfg.model, params)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 40))
    ours = family_logits(cfg, {k: np.asarray(v) for k, v in merged.items()}, tokens)
    base = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    model = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    with torch.no_grad():
        got = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    scale = np.abs(got).max()
    assert np.abs(ours - got).max() / scale < 1e-4
    assert np.abs(got - theirs(directory, tokens)).max() / scale > 1e-3  # it trained


def test_the_stack_compiles_once_for_both_kinds():
    """gemma3-tiny's loss: one scan over the 2 groups (each 2 local blocks and a global
    one, the kinds side by side in its body) and one over the last local block; no
    block unrolled outside them."""
    import jax

    from jaxpar.nn.problem import registered

    cfg = presets.load("gemma3-tiny", [])
    problem = registered(cfg.model, cfg.train.seq_len)
    batch = {"tokens": jax.ShapeDtypeStruct((2, cfg.train.seq_len + 1), np.int32)}
    jaxpr = jax.make_jaxpr(problem.loss)(problem.shapes, batch).jaxpr
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scans] == [2, 1]
    # the [S, S] products of each block, in the bodies: a group's three blocks', the
    # tail's one
    scores = [
        sum(1 for e in s.params["jaxpr"].jaxpr.eqns if e.primitive.name == "dot_general"
            and e.outvars[0].aval.shape[-2:] == (cfg.train.seq_len,) * 2)
        for s in scans
    ]  # fmt: skip
    assert scores[0] == 3 * scores[1] > 0


# gemma3-tiny (groups, a last block after them, every trait) trained in more layouts
GEMMA_LAYOUTS = {
    "dp2-tp2-zero3-remat": (
        "parallel.data=2", "parallel.tensor=2", "parallel.zero=3", "parallel.remat=full"
    ),
    "pp2-1f1b-m4-dp2": (
        "parallel.data=2", "parallel.pipeline=2", "parallel.microbatches=4",
        "parallel.schedule=1f1b",
    ),
    "dp4-tp2-sp": ("parallel.data=4", "parallel.tensor=2", "parallel.sequence_parallel=true"),
}  # fmt: skip


@pytest.mark.parametrize("name", GEMMA_LAYOUTS)
def test_gemma3_trains_in_every_layout_as_on_one_device(name):
    from helpers import assert_same_training, trained
    from helpers import reference as shared_reference

    assert_same_training(
        trained("gemma3-tiny", GEMMA_LAYOUTS[name]), shared_reference("gemma3-tiny")
    )


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """A random Gemma3ForConditionalGeneration, as Gemma 3 4B-27B are released: gemma3's
    text config above (its logits' cap set, which this class never applies) under
    language_model., beside a one-layer SigLIP tower and its projector."""
    _, text = FAMILIES["gemma3"]
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48,
        num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        boi_token_index=253, eoi_token_index=254, image_token_index=255,
    )  # fmt: skip
    torch.manual_seed(1)
    model = transformers.Gemma3ForConditionalGeneration(config)
    return save_drawn(model, tmp_path_factory.mktemp("multimodal") / "hf")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_multimodal_release_trains_from_transformers_loss(multimodal, layout, devices):
    """Its text model read as model.name=gemma3 (the vision tower skipped): the first
    step's loss is Gemma3ForConditionalGeneration's on the same ids, in three layouts."""
    loss = first_step_loss("gemma3", multimodal, layout, devices)
    assert loss == pytest.approx(transformers_loss(multimodal, first_step_loss.tokens), rel=1e-5)


def test_a_multimodal_release_exports_as_released_or_as_text_alone(multimodal, tmp_path, capsys):
    """Trained 3 steps (data=4 x tensor=2), the summary says what was skipped; `export
    --format hf` writes it back as released, its vision tensors bitwise those read and its
    config's other keys kept; `--architecture Gemma3ForCausalLM`, the text model alone;
    transformers gives both the same logits, which are jaxpar's, and jaxpar reads the
    release it wrote back to the parameters it trained, bitwise."""
    from safetensors.numpy import load_file

    run = tmp_path / "run"
    argv = ["train", "--config", "gemma3-tiny", f"model.init=hf:{multimodal}",
            "parallel.data=4", "parallel.tensor=2", "train.steps=3", "--out", str(run)]  # fmt: skip
    assert cli.main(argv) == 0
    assert (
        "its 34 other tensors (the vision tower and its projector) skipped"
        in capsys.readouterr().out
    )
    released, text = tmp_path / "released", tmp_path / "text"
    assert cli.main(["export", str(run), "--to", str(released), "--format", "hf"]) == 0
    argv = ["export", str(run), "--to", str(text), "--format", "hf",
            "--architecture", "Gemma3ForCausalLM"]  # fmt: skip
    assert cli.main(argv) == 0
    read, wrote = (
        load_file(multimodal / "model.safetensors"),
        load_file(released / "model.safetensors"),
    )
    assert read.keys() == wrote.keys()
    vision = [k for k in read if not k.startswith("language_model.")]
    assert len(vision) == 34 and all(np.array_equal(read[k], wrote[k]) for k in vision)
    before, after = (json.loads((d / "config.json").read_text()) for d in (multimodal, released))
    assert {k for k in before if before[k] != after[k]} == {"text_config"}
    assert after["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert json.loads((text / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    params, meta = jaxpar.training.checkpoint.saved_params(run / "checkpoints")
    cfg = presets.from_dict(meta["config"])
    tokens = np.random.default_rng(0).integers(0, 250, (2, 40))
    want = theirs(released, tokens)
    assert np.array_equal(theirs(text, tokens), want)
    err = np.abs(family_logits(cfg, params, tokens) - want).max() / np.abs(want).max()
    assert err < 1e-4, err
    again = presets.resolve_init(presets.load("gemma3-tiny", [f"model.init=hf:{released}"]), set())
    problem = registered(again.model, again.train.seq_len)
    fill = hf.initial_params(registry.get("gemma3").hf, again.model, released, problem.shapes)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {
        k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one) for k, s in problem.shapes.items()
    }
    back = fill(targets)
    assert all(np.array_equal(np.asarray(back[k]), np.asarray(params[k])) for k in params)


def test_a_multimodal_release_decodes_as_transformers_generate(multimodal, devices):
    """Greedy continuations of its text model (one device, 32 new tokens past the
    window) equal Gemma3ForConditionalGeneration.generate's on text alone."""
    from test_generate import PROMPTS, transformers_greedy

    model = decoding.load(f"hf:{multimodal}", ["parallel.data=1"], devices=devices[:1])
    done = decoding.generate(decoding.Decoder(model), PROMPTS, 32, decoding.Sampling(), set())
    assert done.completions == transformers_greedy(multimodal, PROMPTS, 32)
