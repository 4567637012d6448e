"""The Hugging Face adapters of the Llama model (models/llama.py) and its families:
`LlamaForCausalLM`'s config.json keys to and from model.*, and each of our parameter
leaves with its tensor in the checkpoint (name and layout); jaxpar.hf reads and writes
the files with them. Each family is Llama's adapter and its differences:
`MistralForCausalLM` (sliding_window), `Qwen2ForCausalLM` (q/k/v biases),
`Qwen3ForCausalLM` (q/k RMSNorm per head, its own head_dim), `MixtralForCausalLM`
(a sliding window or none, and a mixture of experts in every block: its router and each
expert's w1 (gate), w3 (up) and w2 (down) in the file, stacked over experts in ours) and
`Qwen3MoeForCausalLM` (Qwen3's attention, a mixture in every decoder_sparse_step-th
block, renormalized or not: norm_topk_prob)."""

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
        "qk_norm": family in ("qwen3", "qwen3_moe"),
        "sliding_window": (
            int(hf.get("sliding_window") or 0) if family in ("mistral", "mixtral") else 0
        ),
    }
    if family in ("mixtral", "qwen3_moe"):
        balance = float(hf.get("router_aux_loss_coef", 0.0))
        keys |= {
            "experts": hf.get("num_experts") or hf["num_local_experts"],
            "experts_per_token": hf["num_experts_per_tok"],
            # transformers adds the load-balance loss only with output_router_logits
            "router_aux_loss": balance if hf.get("output_router_logits") else 0.0,
        }
    if family == "qwen3_moe":
        keys |= _qwen3_moe(hf)
    if kind == "llama3":
        keys |= {
            "rope_factor": float(rope["factor"]),
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_positions": int(rope["original_max_position_embeddings"]),
        }
    return keys


def _qwen3_moe(hf: dict) -> dict:
    """Qwen3-MoE's mixture keys: one hidden size for its experts and dense blocks alike
    (jaxpar's model.mlp), sparse blocks by decoder_sparse_step only."""
    step, dense, expert = (
        hf.get("decoder_sparse_step", 1), hf["intermediate_size"], hf["moe_intermediate_size"]
    )  # fmt: skip
    if hf.get("mlp_only_layers"):
        raise CheckpointError(
            f"config.json: mlp_only_layers={hf['mlp_only_layers']} is not supported (jaxpar "
            "places its sparse blocks by decoder_sparse_step alone: model.moe_every)"
        )
    if step > 1 and dense != expert:
        raise CheckpointError(
            f"config.json: decoder_sparse_step={step} with intermediate_size={dense} and "
            f"moe_intermediate_size={expert}: jaxpar's dense blocks and experts share "
            "model.mlp; only decoder_sparse_step=1 (no dense block) or equal sizes are read"
        )
    return {
        "mlp": expert,
        "moe_every": step,
        "router_renormalize": bool(hf.get("norm_topk_prob", False)),
    }


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
        "qwen3_moe": {
            "attention_bias": False,
            "use_sliding_window": False,
            "num_experts": m.experts,
            "num_experts_per_tok": m.experts_per_token,
            "moe_intermediate_size": m.mlp,
            "decoder_sparse_step": m.moe_every,
            "mlp_only_layers": [],
            "norm_topk_prob": m.router_renormalize,
            "router_aux_loss_coef": m.router_aux_loss,
            "output_router_logits": m.router_aux_loss > 0,
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


def hf_tensors(m: LlamaConfig, family: str = "llama") -> list[Tensor]:
    """Each leaf and its tensor: nn.Linear stores [out, in]; q/k/v/o by head, in order.
    With model.moe_every = n > 1 the blocks are stacked by groups of n (models/llama.py's
    Group): a leaf of the group's i-th block holds the file's layers i, n + i, ..."""
    if family == "mixtral" and m.moe_every != 1:
        raise ConfigError(
            f"model.moe_every={m.moe_every}: Mixtral's checkpoints have a mixture in every "
            "block; only model.moe_every=1 reads or writes one"
        )
    if family == "mixtral" and not m.router_renormalize:
        raise ConfigError(
            "model.router_renormalize=false: Mixtral always renormalizes its experts' "
            "weights; drop it, or use model.name=qwen3_moe (norm_topk_prob)"
        )
    out = [Tensor("tokens", "model.embed_tokens.weight", "v e", "v e")]
    n = m.moe_every if m.experts else 1
    if n == 1:
        out += _block("blocks/", m, family, bool(m.experts))
    else:
        for i in range(n - 1):
            out += _block(f"blocks/dense/{i}/", m, family, False, every=n, offset=i)
        out += _block("blocks/sparse/", m, family, True, every=n, offset=n - 1)
    out.append(Tensor("norm/scale", "model.norm.weight", "e", "e"))
    return out if m.tie_embeddings else [*out, Tensor("head", "lm_head.weight", "v e", "e v")]


def _block(
    ours: str, m: LlamaConfig, family: str, sparse: bool, every: int = 1, offset: int = 0
) -> list[Tensor]:
    """One block's leaves (`ours`: their path's prefix) and the file's tensors of them."""
    layer, attn = "model.layers.{layer}.", "model.layers.{layer}.self_attn."
    names = [
        ("attn_norm/scale", layer + "input_layernorm.weight", "e", "e"),
        ("attn/wq", attn + "q_proj.weight", "(h d) e", "e h d"),
        ("attn/wk", attn + "k_proj.weight", "(k d) e", "e k d"),
        ("attn/wv", attn + "v_proj.weight", "(k d) e", "e k d"),
        ("attn/wo", attn + "o_proj.weight", "e (h d)", "h d e"),
        ("mlp_norm/scale", layer + "post_attention_layernorm.weight", "e", "e"),
    ]
    if sparse:  # the router, then each expert's gate, up and down
        moe = layer + ("block_sparse_moe." if family == "mixtral" else "mlp.")
        expert = moe + "experts.{expert}."
        gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else PROJECTIONS
        names += [
            ("mlp/router", moe + "gate.weight", "x e", "e x"),
            ("mlp/w_gate", f"{expert}{gate}.weight", "m e", "e m"),
            ("mlp/w_up", f"{expert}{up}.weight", "m e", "e m"),
            ("mlp/w_down", f"{expert}{down}.weight", "e m", "m e"),
        ]
    else:
        gate, up, down = PROJECTIONS
        names += [
            ("mlp/w_gate", f"{layer}mlp.{gate}.weight", "m e", "e m"),
            ("mlp/w_up", f"{layer}mlp.{up}.weight", "m e", "e m"),
            ("mlp/w_down", f"{layer}mlp.{down}.weight", "e m", "m e"),
        ]
    if m.qkv_bias:
        names += [
            ("attn/bq", attn + "q_proj.bias", "(h d)", "h d"),
            ("attn/bk", attn + "k_proj.bias", "(k d)", "k d"),
            ("attn/bv", attn + "v_proj.bias", "(k d)", "k d"),
        ]
    if m.qk_norm:
        names += [
            ("attn/q_norm/scale", attn + "q_norm.weight", "d", "d"),
            ("attn/k_norm/scale", attn + "k_norm.weight", "d", "d"),
        ]
    return [Tensor(ours + key, *rest, every=every, offset=offset) for key, *rest in names]


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
FAMILIES = {
    family: HFFormat(
        architecture,
        functools.partial(config_from_hf, family=family),
        functools.partial(config_to_hf, family=family),
        functools.partial(hf_tensors, family=family),
        training=("router_aux_loss",),
    )
    for family, (architecture, _) in ARCHITECTURES.items()
}
HF = FAMILIES["llama"]
