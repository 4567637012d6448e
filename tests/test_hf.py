"""Hugging Face weights in and out, proven by logits against `transformers` itself: a
small random LlamaForCausalLM (GQA, Llama 3 rope scaling) saved with save_pretrained,
loaded into jaxpar in four layouts, trained, exported, and loaded back."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the test extra installs torch (CPU) on 3.11")
transformers = pytest.importorskip("transformers")

from helpers import changed_config  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar import hf, recipe  # noqa: E402
from jaxpar.cli import main as cli  # noqa: E402
from jaxpar.config import presets, registry  # noqa: E402

pytestmark = pytest.mark.slow  # trains, and runs transformers


LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip
# YaRN from 16 positions (the batches run past them): dims blended on the ramp, q and k
# times 0.1 ln 4 + 1
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}  # fmt: skip


def save_tiny_llama(directory: Path, tie: bool = False, rope: dict = LLAMA3) -> Path:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=tie,
            rope_parameters=rope,
        )  # fmt: skip
    )
    with torch.no_grad():
        # far from the init, so that a wrong mapping shows; the norms' scales near 1, so
        # that each block's output counts in the logits
        for key, p in model.named_parameters():
            p.normal_(1.0 if "norm" in key else 0.0, 0.1)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")


def torch_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    model = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def jaxpar_logits(cfg, params: dict, tokens: np.ndarray) -> np.ndarray:
    spec = registry.get(cfg.model.name)
    model = jaxpar.to_nnx(lambda rngs: spec.build(cfg.model, tokens.shape[1], rngs), params)
    x = jaxpar.scan_layers(model.blocks, model.embed(tokens), lambda block, h: block(h))
    return np.asarray(model.logits(x))


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, f"logits: {err:.2e} of their scale"


def loaded_config(directory: Path, *overrides: str):
    cfg = presets.load("llama-tiny", [f"model.init=hf:{directory}", *overrides])
    return presets.resolve_init(cfg, set())


LAYOUTS = {
    "one-device": ("parallel.data=1",),
    "data8": ("parallel.data=8",),
    "data4-tensor2": ("parallel.data=4", "parallel.tensor=2"),
    "pipeline2": ("parallel.data=4", "parallel.pipeline=2", "parallel.microbatches=2"),
    "context4": ("parallel.data=2", "parallel.context=4"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_loaded_weights_give_transformers_logits_in_every_layout(name, checkpoint_dir, devices):
    """Loaded into the layout's shards (each device reading its own slices), its first
    step's loss is transformers' cross-entropy, and the parameters it holds give
    transformers' logits."""
    _first_step_is_transformers(checkpoint_dir, LAYOUTS[name], devices, "llama3")


@pytest.fixture(scope="module")
def yarn_dir(checkpoint_dir, tmp_path_factory):
    """checkpoint_dir's weights under YaRN's rope parameters."""
    to = tmp_path_factory.mktemp("hf") / "tiny-llama-yarn"
    return changed_config(checkpoint_dir, {"rope_parameters": YARN}, to)


@pytest.mark.parametrize("name", ["one-device", "data4-tensor2", "context4"])
def test_a_yarn_checkpoint_trains_from_transformers_loss(name, yarn_dir, devices):
    """YaRN's frequencies and attention factor (Qwen3's long context, DeepSeek-V3 and
    GPT-OSS set it), with the positions split over context in one layout."""
    _first_step_is_transformers(yarn_dir, LAYOUTS[name], devices, "yarn")


def test_a_yarn_checkpoint_decodes_as_transformers_generate(yarn_dir, devices):
    """Greedy through the KV cache, tensor=2, past the original 16 positions."""
    from test_generate import PROMPTS, transformers_greedy

    from jaxpar.generation import decoding

    model = decoding.load(f"hf:{yarn_dir}", ["parallel.tensor=2"], devices=devices[:2])
    done = decoding.generate(decoding.Decoder(model), PROMPTS, 32, decoding.Sampling(), set())
    assert done.completions == transformers_greedy(yarn_dir, PROMPTS, 32)


def _first_step_is_transformers(directory: Path, layout, devices, rope: str) -> None:
    cfg = loaded_config(directory, *layout, "train.steps=1", "train.lr=1e-12")
    assert (cfg.model.layers, cfg.model.kv_heads, cfg.model.rope_scaling) == (2, 2, rope)
    s = recipe.setup(
        cfg,
        devices[
            : math.prod(getattr(cfg.parallel, a) for a in ("data", "pipeline", "context", "tensor"))
        ],
    )
    params = hf.initial_params(registry.get("llama").hf, cfg.model, directory, s.problem.shapes)
    result = jaxpar.train(s.problem, cfg, s.batches, mesh=s.mesh, params=params, quiet=True)
    tokens = s.batches(0)["tokens"]
    want = torch_logits(directory, tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(
        torch.tensor(want).reshape(-1, 256), torch.tensor(tokens[:, 1:].reshape(-1)).long()
    ).item()
    assert result.losses[0] == pytest.approx(loss, rel=1e-5)
    assert_close(jaxpar_logits(cfg, result.params, tokens[:, :-1]), want)


@pytest.mark.parametrize(
    "tie, rope", [(False, LLAMA3), (True, LLAMA3), (False, YARN)], ids=["untied", "tied", "yarn"]
)
def test_train_export_and_load_in_transformers(tie, rope, tmp_path, devices):
    """HF -> jaxpar (trained 3 steps, data=4 x tensor=2) -> `jaxpar export --format hf`
    -> transformers' from_pretrained: the same logits, and the rope parameters as read."""
    source = save_tiny_llama(tmp_path / "source", tie=tie, rope=rope)
    run = tmp_path / "run"
    # fmt: off
    argv = ["train", "--config", "llama-tiny", f"model.init=hf:{source}", "parallel.data=4",
            "parallel.tensor=2", "train.steps=3", "--out", str(run)]  # no checkpoint key
    # fmt: on
    assert cli.main(argv) == 0
    assert cli.main(["export", str(run), "--to", str(tmp_path / "out"), "--format", "hf"]) == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (
        written["architectures"] == ["LlamaForCausalLM"] and written["tie_word_embeddings"] == tie
    )
    assert {k: written["rope_parameters"].get(k) for k in rope} == rope
    cfg = loaded_config(source)
    params = {
        k: np.asarray(v) for k, v in jaxpar.load_exported(_safetensors(run, tmp_path)).items()
    }
    tokens = recipe.setup(cfg, devices[:1]).batches(0)["tokens"][:, :-1]
    trained = jaxpar_logits(cfg, params, tokens)
    assert np.abs(trained - torch_logits(source, tokens)).max() > 1e-3  # it did train
    assert_close(trained, torch_logits(tmp_path / "out", tokens))


def _safetensors(run: Path, tmp_path: Path) -> Path:
    assert cli.main(["export", str(run), "--to", str(tmp_path / "m.safetensors")]) == 0
    return tmp_path / "m.safetensors"
