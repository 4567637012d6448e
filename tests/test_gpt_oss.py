"""GPT-OSS (the Llama model with sliding and full attention in turn, a learned sink per
head, biases on every projection, and in every block a mixture of biased experts with
the clamped SwiGLU, under YaRN) against `transformers` itself, on a random checkpoint
with every trait biting: the first step's loss in three layouts; logits after training
and exporting; greedy continuations past the window; the released MXFP4 experts, refused
in one line."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the test extra installs torch (CPU) on 3.11")
transformers = pytest.importorskip("transformers")

from helpers import changed_config, run_logits_error, save_drawn  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar import hf, recipe  # noqa: E402
from jaxpar.cli import main as cli  # noqa: E402
from jaxpar.config import presets, registry  # noqa: E402
from jaxpar.generation import decoding  # noqa: E402
from jaxpar.parallel.axes import AXES  # noqa: E402

pytestmark = pytest.mark.slow  # trains, and runs transformers

WINDOW = 6  # shorter than every sequence trained and generated
# the clamp low enough to bite (the gates reach about 2.5); YaRN from 16 positions, its
# ramp's ends not rounded (GPT-OSS's truncate false)
CONFIG = transformers.GptOssConfig(
    vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
    num_experts_per_tok=2, sliding_window=WINDOW, swiglu_limit=1.0, rms_norm_eps=1e-5,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "rope_theta": 150000.0},
)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random GPT-OSS saved by transformers, every parameter drawn: sinks, biases and
    the router's too."""
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("gpt_oss") / "hf"
    return save_drawn(transformers.GptOssForCausalLM(CONFIG), directory)


def theirs(directory, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def test_the_checkpoint_reads_as_its_traits(checkpoint):
    cfg = presets.resolve_init(presets.load("gpt_oss-tiny", [f"model.init=hf:{checkpoint}"]), set())
    m = cfg.model
    traits = (m.global_every, m.sliding_window, m.window_of(0), m.window_of(1), m.qkv_bias,
              m.o_bias, m.attn_sinks, m.expert_bias, m.activation, m.swiglu_alpha,
              m.swiglu_limit, m.experts, m.experts_per_token, m.router_renormalize)  # fmt: skip
    assert traits == (2, WINDOW, WINDOW, 0, True, True, True, True, "clamped_swiglu", 1.702,
                      1.0, 8, 2, True)  # fmt: skip
    rope = (m.rope_scaling, m.rope_factor, m.rope_original_positions, m.rope_truncate)
    assert rope == ("yarn", 4.0, 16, False)


LAYOUTS = {
    "one device": ("parallel.data=1",),
    # the sinks through context's gathers, the biases through tensor's partial sums and
    # the expert devices (the capacity path, at a capacity that drops nothing)
    "expert=2 x tensor=2 x context=2": (
        "parallel.data=1",
        "parallel.expert=2",
        "parallel.tensor=2",
        "parallel.context=2",
        "model.capacity_factor=4",
    ),  # fmt: skip
    "pipeline=2 x data=2": ("parallel.data=2", "parallel.pipeline=2", "parallel.microbatches=2"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_first_step_loss_is_transformers_loss(checkpoint, layout, devices):
    cfg = presets.load(
        "gpt_oss-tiny",
        [f"model.init=hf:{checkpoint}", *LAYOUTS[layout], "train.steps=1", "train.lr=1e-12"],
    )
    cfg = presets.resolve_init(cfg, {"capacity_factor"})
    n = math.prod(max(getattr(cfg.parallel, a), 1) for a in AXES)
    s = recipe.setup(cfg, devices[:n])
    params = hf.initial_params(registry.get("gpt_oss").hf, cfg.model, checkpoint, s.problem.shapes)
    result = jaxpar.train(s.problem, cfg, s.batches, mesh=s.mesh, params=params, quiet=True)
    tokens = s.batches(0)["tokens"]
    logits = theirs(checkpoint, tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(
        torch.tensor(logits).reshape(-1, 256), torch.tensor(tokens[:, 1:].reshape(-1)).long()
    ).item()
    assert result.losses[0] == pytest.approx(loss, rel=2e-5)


def test_trained_and_exported_logits_are_transformers_logits(checkpoint, tmp_path):
    """Three steps (data=2 x expert=2 x tensor=2, ZeRO-3), `jaxpar export --format hf`,
    loaded back by transformers: its logits within 1e-4 of their scale of jaxpar's, and
    the config as read; read again by jaxpar, the parameters it trained, bitwise."""
    run = tmp_path / "run"
    argv = ["train", "--config", "gpt_oss-tiny", f"model.init=hf:{checkpoint}",
            "parallel.data=2", "parallel.expert=2", "parallel.tensor=2", "parallel.zero=3",
            "train.steps=3", "--out", str(run)]  # fmt: skip
    assert cli.main(argv) == 0
    assert cli.main(["export", str(run), "--to", str(tmp_path / "out"), "--format", "hf"]) == 0
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "out").to_dict()
    read = CONFIG.to_dict()
    kept = ["architectures", "layer_types", "sliding_window", "num_local_experts",
            "num_experts_per_tok", "swiglu_alpha", "swiglu_limit", "attention_bias",
            "head_dim", "intermediate_size", "rope_parameters"]  # fmt: skip
    read["architectures"] = ["GptOssForCausalLM"]
    assert {k: exported.get(k) for k in kept} == {k: read.get(k) for k in kept}
    tokens = np.random.default_rng(0).integers(0, 256, (2, 40))
    want = theirs(tmp_path / "out", tokens)
    err = run_logits_error(run, want, tokens)
    assert err < 1e-4, err
    assert np.abs(want - theirs(checkpoint, tokens)).max() / np.abs(want).max() > 1e-3


@pytest.mark.parametrize("layout", [("parallel.data=1",), ("parallel.tensor=2",)])
def test_greedy_continuations_past_the_window_are_transformers_generate(
    checkpoint, layout, devices
):
    """32 new tokens through the sliding layers' ring caches and the full ones', the
    sinks in every softmax."""
    from test_generate import PROMPTS, transformers_greedy

    model = decoding.load(f"hf:{checkpoint}", list(layout), devices=devices[:2])
    done = decoding.generate(decoding.Decoder(model), PROMPTS, 32, decoding.Sampling(), set())
    assert done.completions == transformers_greedy(checkpoint, PROMPTS, 32)


def test_the_released_mxfp4_experts_are_refused_in_one_line(checkpoint, capsys, tmp_path):
    """The releases' experts are MXFP4 blocks: training from them is refused, naming the
    fix; planning from their config alone is not."""
    mxfp4 = {"quantization_config": {"quant_method": "mxfp4"}}
    changed = changed_config(checkpoint, mxfp4, tmp_path / "hf")
    argv = ["train", "--config", "gpt_oss-tiny", f"model.init=hf:{changed}",
            "--out", str(tmp_path / "r")]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Mxfp4Config(dequantize=True)" in err, err
