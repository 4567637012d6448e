"""The Hugging Face adapters of the Llama model (models/llama.py) and its families:
`LlamaForCausalLM`'s config.json keys to and from model.*, and each of our parameter
leaves with its tensor in the checkpoint (name and layout); jaxpar.hf reads and writes
the files with them. Each family is Llama's adapter and its differences:
`MistralForCausalLM` (sliding_window), `Qwen2ForCausalLM` (q/k/v biases),
`Qwen3ForCausalLM` (q/k RMSNorm per head, its own head_dim) and `MixtralForCausalLM`
(a sliding window or none, and a mixture of experts in every block: its router and each
expert's w1 (gate), w3 (up) and w2 (down) in the file, stacked over experts in ours)."""

from __future__ import annotations

import functools

from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.hf import HFFormat, Tensor

from . import LlamaConfig, RopeScaling


def config_from_hf(hf: dict, family: str = "llama") -> dict:
    """config.json of a LlamaForCausalLM (or of `family`'s) -> model.* (what jaxpar cannot
    express refused)."""
    heads, embed = hf["num_attention_heads"], hf["hidden_size"]
    rope = hf.get("rope_parameters") or {
        **(hf.get("rope_scaling") or {}),
        "rope_theta": hf.get("rope_theta", 10000.0),
    }
    kind = rope.get("rope_type", rope.get("type", "default"))
    unsupported = {
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(hf.get("attention_bias")),  # Llama's and Qwen3's: o too
        "mlp_bias": bool(hf.get("mlp_bias")),
        "rope_type": kind not in ("default", "llama3"),
        # Qwen2/3 window only the layers from max_window_layers on
        "use_sliding_window": bool(hf.get("use_sliding_window")),
        # noise on the router's input while training: not deterministic, not reproduced
        "router_jitter_noise": bool(hf.get("router_jitter_noise")),
    }
    if any(unsupported.values()):
        key = next(k for k, bad in unsupported.items() if bad)
        raise CheckpointError(
            f"config.json: {key}={hf.get(key, rope.get('rope_type'))!r} is not supported "
            "(jaxpar's Llama family: silu, no biases but Qwen2's on q/k/v, default or llama3 "
            "rope, a sliding window on every layer or none)"
        )
    head_dim = hf.get("head_dim") or embed // heads
    keys = {
        "layers": hf["num_hidden_layers"],
        "embed": embed,
        "heads": heads,
        "kv_heads": hf.get("num_key_value_heads") or heads,
        "mlp": hf["intermediate_size"],
        "vocab": hf["vocab_size"],
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling": RopeScaling.LLAMA3 if kind == "llama3" else RopeScaling.NONE,
        "head_dim": 0 if head_dim * heads == embed else head_dim,
        "qkv_bias": family == "qwen2",
        "qk_norm": family == "qwen3",
        "sliding_window": (
            int(hf.get("sliding_window") or 0) if family in ("mistral", "mixtral") else 0
        ),
    }
    if family == "mixtral":
        balance = float(hf.get("router_aux_loss_coef", 0.0))
        keys |= {
            "experts": hf["num_local_experts"],
            "experts_per_token": hf["num_experts_per_tok"],
            # transformers adds the load-balance loss only with output_router_logits
            "router_aux_loss": balance if hf.get("output_router_logits") else 0.0,
        }
    if kind == "llama3":
        keys |= {
            "rope_factor": float(rope["factor"]),
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_positions": int(rope["original_max_position_embeddings"]),
        }
    return keys


def config_to_hf(m: LlamaConfig, seq_len: int, family: str = "llama") -> dict:
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling is RopeScaling.LLAMA3:
        rope |= {
            "rope_type": "llama3",
            "factor": m.rope_factor,
            "low_freq_factor": m.rope_low_freq_factor,
            "high_freq_factor": m.rope_high_freq_factor,
            "original_max_position_embeddings": m.rope_original_positions,
        }
    architecture, model_type = ARCHITECTURES[family]
    extra = {
        "llama": {"attention_bias": False, "mlp_bias": False},
        "mistral": {"sliding_window": m.sliding_window or None},
        "qwen2": {"use_sliding_window": False},
        "qwen3": {"attention_bias": False, "use_sliding_window": False},
        "mixtral": {
            "sliding_window": m.sliding_window or None,
            "num_local_experts": m.experts,
            "num_experts_per_tok": m.experts_per_token,
            "router_aux_loss_coef": m.router_aux_loss,
            "output_router_logits": m.router_aux_loss > 0,
            "router_jitter_noise": 0.0,
        },
    }[family]
    return {
        **extra,
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": m.embed,
        "intermediate_size": m.mlp,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim or m.embed // m.heads,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        "vocab_size": m.vocab,
        "tie_word_embeddings": m.tie_embeddings,
        "max_position_embeddings": max(seq_len, m.rope_original_positions),
        "rope_parameters": rope,
        "dtype": "float32",
    }


def hf_tensors(m: LlamaConfig) -> list[Tensor]:
    """Each leaf and its tensor: nn.Linear stores [out, in]; q/k/v/o by head, in order."""
    if m.experts and m.moe_every != 1:
        raise ConfigError(
            f"model.moe_every={m.moe_every}: Mixtral's checkpoints have a mixture in every "
            "block; only model.moe_every=1 reads or writes one"
        )
    layer = "model.layers.{layer}."
    out = [
        Tensor("tokens", "model.embed_tokens.weight", "v e", "v e"),
        Tensor("blocks/attn_norm/scale", layer + "input_layernorm.weight", "e", "e"),
        Tensor("blocks/attn/wq", layer + "self_attn.q_proj.weight", "(h d) e", "e h d"),
        Tensor("blocks/attn/wk", layer + "self_attn.k_proj.weight", "(k d) e", "e k d"),
        Tensor("blocks/attn/wv", layer + "self_attn.v_proj.weight", "(k d) e", "e k d"),
        Tensor("blocks/attn/wo", layer + "self_attn.o_proj.weight", "e (h d)", "h d e"),
        Tensor("blocks/mlp_norm/scale", layer + "post_attention_layernorm.weight", "e", "e"),
        *(_experts(layer) if m.experts else _mlp(layer)),
        Tensor("norm/scale", "model.norm.weight", "e", "e"),
    ]
    if m.qkv_bias:
        attn = layer + "self_attn."
        out += [
            Tensor("blocks/attn/bq", attn + "q_proj.bias", "(h d)", "h d"),
            Tensor("blocks/attn/bk", attn + "k_proj.bias", "(k d)", "k d"),
            Tensor("blocks/attn/bv", attn + "v_proj.bias", "(k d)", "k d"),
        ]
    if m.qk_norm:
        out += [
            Tensor("blocks/attn/q_norm/scale", layer + "self_attn.q_norm.weight", "d", "d"),
            Tensor("blocks/attn/k_norm/scale", layer + "self_attn.k_norm.weight", "d", "d"),
        ]
    return out if m.tie_embeddings else [*out, Tensor("head", "lm_head.weight", "v e", "e v")]


def _mlp(layer: str) -> list[Tensor]:
    return [
        Tensor("blocks/mlp/w_gate", layer + "mlp.gate_proj.weight", "m e", "e m"),
        Tensor("blocks/mlp/w_up", layer + "mlp.up_proj.weight", "m e", "e m"),
        Tensor("blocks/mlp/w_down", layer + "mlp.down_proj.weight", "e m", "m e"),
    ]


def _experts(layer: str) -> list[Tensor]:
    """Mixtral's router and experts (one tensor per layer and expert in the file)."""
    moe = layer + "block_sparse_moe."
    expert = moe + "experts.{expert}."
    return [
        Tensor("blocks/mlp/router", moe + "gate.weight", "x e", "e x"),
        Tensor("blocks/mlp/w_gate", expert + "w1.weight", "m e", "e m"),
        Tensor("blocks/mlp/w_up", expert + "w3.weight", "m e", "e m"),
        Tensor("blocks/mlp/w_down", expert + "w2.weight", "e m", "m e"),
    ]


ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
}
FAMILIES = {
    family: HFFormat(
        architecture,
        functools.partial(config_from_hf, family=family),
        functools.partial(config_to_hf, family=family),
        hf_tensors,
        training=("router_aux_loss",),
    )
    for family, (architecture, _) in ARCHITECTURES.items()
}
HF = FAMILIES["llama"]
