"""Mistral, Qwen2 and Qwen3 as the Llama model with their keys, proven against
`transformers` itself: the first step's loss in two layouts, logits after training and
exporting, and greedy continuations token for token."""

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the test extra installs torch (CPU) on 3.11")
transformers = pytest.importorskip("transformers")

from helpers import family_logits, save_drawn  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar import hf, recipe  # noqa: E402
from jaxpar.cli import main as cli  # noqa: E402
from jaxpar.config import presets, registry  # noqa: E402
from jaxpar.generation import decoding  # noqa: E402

pytestmark = pytest.mark.slow  # trains, and runs transformers

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5,
              tie_word_embeddings=False, max_position_embeddings=512)  # fmt: skip
FAMILIES = {
    # a window shorter than the sequences trained and generated: it matters
    "mistral": (
        transformers.MistralForCausalLM, transformers.MistralConfig, {"sliding_window": 12}
    ),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, {}),
    # its own head size (16, not 64 / 8)
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, {"head_dim": 16}),
}  # fmt: skip


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(family, a random tiny checkpoint of it saved by transformers)."""
    name = request.param
    model_class, config_class, extra = FAMILIES[name]
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp(name) / "hf"
    return name, save_drawn(model_class(config_class(**COMMON, **extra)), directory)


def their_logits(directory, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def loaded(name, directory, *overrides):
    cfg = presets.load(f"{name}-tiny", [f"model.init=hf:{directory}", *overrides])
    return presets.resolve_init(cfg, set())


@pytest.mark.parametrize("layout", [("parallel.data=1",), ("parallel.data=4", "parallel.tensor=2")])
def test_first_step_loss_is_transformers_loss(family, layout, devices):
    name, directory = family
    cfg = loaded(name, directory, *layout, "train.steps=1", "train.lr=1e-12")
    n = math.prod((cfg.parallel.data, cfg.parallel.tensor))
    s = recipe.setup(cfg, devices[:n])
    params = hf.initial_params(registry.get(name).hf, cfg.model, directory, s.problem.shapes)
    result = jaxpar.train(s.problem, cfg, s.batches, mesh=s.mesh, params=params, quiet=True)
    tokens = s.batches(0)["tokens"]
    logits = their_logits(directory, tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(
        torch.tensor(logits).reshape(-1, 256), torch.tensor(tokens[:, 1:].reshape(-1)).long()
    ).item()
    assert result.losses[0] == pytest.approx(loss, rel=1e-5)


def test_trained_and_exported_logits_are_transformers_logits(family, tmp_path, devices):
    """Three steps (data=4 x tensor=2), `jaxpar export --format hf`, loaded back by
    transformers: its logits within 1e-4 of their scale of jaxpar's."""
    name, directory = family
    run = tmp_path / "run"
    argv = ["train", "--config", f"{name}-tiny", f"model.init=hf:{directory}",
            "parallel.data=4", "parallel.tensor=2", "train.steps=3", "--out", str(run)]  # fmt: skip
    assert cli.main(argv) == 0
    assert cli.main(["export", str(run), "--to", str(tmp_path / "out"), "--format", "hf"]) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == [FAMILIES[name][0].__name__]
    params, meta = jaxpar.training.checkpoint.saved_params(run / "checkpoints")
    cfg = presets.from_dict(meta["config"])
    tokens = np.random.default_rng(0).integers(0, 256, (2, 40))
    want = their_logits(tmp_path / "out", tokens)
    err = np.abs(family_logits(cfg, params, tokens) - want).max() / np.abs(want).max()
    assert err < 1e-4, err


def test_greedy_continuations_are_transformers_generate(family, devices):
    from test_generate import PROMPTS, transformers_greedy

    name, directory = family
    model = decoding.load(f"hf:{directory}", ["parallel.data=1"], devices=devices[:2])
    done = decoding.generate(decoding.Decoder(model), PROMPTS, 32, decoding.Sampling(), set())
    assert done.completions == transformers_greedy(directory, PROMPTS, 32)


def test_a_family_refuses_the_keys_of_another(devices, capsys):
    assert cli.main(["train", "--config", "llama-tiny", "model.qkv_bias=true"]) == 2
    assert "model.qkv_bias=True is qwen2's, not llama's; set model.name=qwen2" in (
        capsys.readouterr().err
    )
