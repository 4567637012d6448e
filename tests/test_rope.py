"""YaRN's rotary frequencies and attention factors against transformers' own
(`ROPE_INIT_FUNCTIONS["yarn"]`), for the rope parameters of the releases that set them,
read from their config.json as jaxpar reads it; and its keys refused where YaRN is off."""

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from helpers import one_line_error  # noqa: E402

from jaxpar.cli import main as cli  # noqa: E402
from jaxpar.config import presets  # noqa: E402
from jaxpar.models import llama  # noqa: E402

# (preset, transformers config, its keys): each release's dims that the frequencies read
RELEASES = {
    "Qwen3-8B, YaRN": ("qwen3-tiny", "Qwen3Config", dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
            "original_max_position_embeddings": 32768})),
    "GPT-OSS": ("llama-tiny", "LlamaConfig", dict(
        hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})),
    "DeepSeek-V3": ("deepseek-tiny", "DeepseekV3Config", dict(
        max_position_embeddings=163840, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096})),
    # Kimi K2 (DeepseekV3ForCausalLM): beta_fast = beta_slow, an empty ramp
    "Kimi K2": ("deepseek-tiny", "DeepseekV3Config", dict(
        hidden_size=7168, num_attention_heads=64, num_key_value_heads=64,
        max_position_embeddings=131072, rope_parameters={
            "rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "beta_fast": 1.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096})),
    "a set attention factor": ("llama-tiny", "LlamaConfig", dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=64, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "attention_factor": 0.9, "original_max_position_embeddings": 16})),
}  # fmt: skip


@pytest.mark.parametrize("release", RELEASES)
def test_yarn_is_transformers_frequencies_and_factors(release, tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    preset, kind, keys = RELEASES[release]
    config = getattr(transformers, kind)(**keys)
    config.architectures = [kind.replace("Config", "ForCausalLM")]
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    cfg = presets.resolve_init(presets.load(preset, [f"model.init=hf:{tmp_path}"]), set())
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    got = llama.inverse_frequencies(cfg.model)
    np.testing.assert_allclose(got, want.numpy(), rtol=2e-7)
    assert llama.rope_attention_factor(cfg.model) == pytest.approx(factor, rel=1e-12)
    if kind == "DeepseekV3Config":  # its attention's softmax scale, times mscale squared
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

        scale = yarn_apply_mscale(config.rope_parameters, 1.0)
        assert llama.latent_softmax_factor(cfg.model) == pytest.approx(scale, rel=1e-12)


def test_a_yarn_key_without_yarn_is_one_line(capsys):
    argv = ["train", "--config", "llama-tiny", "model.rope_mscale_all_dim=1"]
    assert cli.main(argv) == 2
    one_line_error(capsys, "model.rope_mscale_all_dim=1.0", "model.rope_scaling=yarn")
