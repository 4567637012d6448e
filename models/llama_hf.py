"""The Hugging Face adapter of the Llama model (models/llama.py) and its families:
`LlamaForCausalLM`'s config.json keys to and from model.*, and each of our parameter
leaves with its tensor in the checkpoint (name and layout); jaxpar.hf reads and writes
the files with them. Where a family differs (Mistral's window, Qwen2's q/k/v biases,
Qwen3's q/k norms, Mixtral's and Qwen3-MoE's experts) its record in models/families.py
says so; nothing here names a family."""

from __future__ import annotations

import functools

from jaxpar.errors import CheckpointError
from jaxpar.hf import HFFormat, Tensor

from . import Activation, LlamaConfig, RopeScaling, Router
from .families import BY_NAME, FAMILIES, LLAMA_PROJECTIONS, Family

MTP_MOST = 64  # model.mtp_depth's bound: prediction layers past it are not looked for
# config.json's hidden_act (Gemma's hidden_activation) -> model.activation
ACTIVATIONS = {"silu": Activation.SILU, "gelu_pytorch_tanh": Activation.GELU_TANH}


def config_from_hf(hf: dict, family: Family = BY_NAME["llama"]) -> dict:
    """config.json of a LlamaForCausalLM (or of `family`'s) -> model.* (what jaxpar cannot
    express refused; keys it leaves out at the family's defaults)."""
    hf = family.defaults | hf
    heads, embed = hf["num_attention_heads"], hf["hidden_size"]
    rope = hf.get("rope_parameters") or {
        **(hf.get("rope_scaling") or {}),
        "rope_theta": hf.get("rope_theta", 10000.0),
    }
    rope = rope.get("full_attention", rope)  # Gemma 3's: per kind of layer
    kind = rope.get("rope_type", rope.get("type", "default"))
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    unsupported = {
        "hidden_act": act not in ACTIVATIONS,
        # Llama's and Qwen3's: o too (GPT-OSS reads its own)
        "attention_bias": bool(hf.get("attention_bias")) and not family.owns("o_bias"),
        "mlp_bias": bool(hf.get("mlp_bias")),
        "rope_type": kind not in ("default", "llama3", "linear", "yarn"),
        # Qwen2/3 window only the layers from max_window_layers on
        "use_sliding_window": bool(hf.get("use_sliding_window")),
        # noise on the router's input while training: not deterministic, not reproduced
        "router_jitter_noise": bool(hf.get("router_jitter_noise")),
    }
    if any(unsupported.values()):
        key = next(k for k, bad in unsupported.items() if bad)
        raise CheckpointError(
            f"config.json: {key}={hf.get(key, rope.get('rope_type'))!r} is not supported "
            "(jaxpar's Llama family: silu or gelu_pytorch_tanh, no biases but Qwen2's on "
            "q/k/v, default, llama3, linear or yarn rope, a sliding window on every layer or none, "
            "or Gemma's local and global layers)"
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
        "rope_scaling": RopeScaling(kind if kind != "default" else "none"),
        "activation": ACTIVATIONS[act],
        "head_dim": 0 if head_dim * heads == embed else head_dim,
        "qkv_bias": False,
        "qk_norm": False,
        "sliding_window": 0,
        **family.fixed,
        **family.from_hf(hf),
    }
    if kind == "llama3":
        keys |= {
            "rope_factor": float(rope["factor"]),
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_positions": int(rope["original_max_position_embeddings"]),
        }
    if kind == "linear":
        keys["rope_factor"] = float(rope["factor"])
    if kind == "yarn":
        keys |= _yarn_from_hf(hf, rope)
    return keys


def _yarn_from_hf(hf: dict, rope: dict) -> dict:
    """YaRN's rope parameters -> model.rope_* (unset ones at transformers' defaults; no
    factor: max_position_embeddings over the original, as transformers reads it)."""
    original = rope.get("original_max_position_embeddings") or hf.get(
        "original_max_position_embeddings"
    )
    if not original:
        raise CheckpointError(
            "config.json: rope_type='yarn' without original_max_position_embeddings: YaRN "
            "scales from the length the model was first trained at; add it to the rope "
            "parameters"
        )
    factor = rope.get("factor") or hf["max_position_embeddings"] / original
    return {
        "rope_factor": float(factor),
        "rope_original_positions": int(original),
        "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
        "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
        "rope_mscale": float(rope.get("mscale") or 0.0),
        "rope_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
        "rope_attention_factor": float(rope.get("attention_factor") or 0.0),
        "rope_truncate": bool(rope.get("truncate", True)),
    }


def _yarn_to_hf(m: LlamaConfig) -> dict:
    """model.rope_* -> YaRN's rope parameters (the unset ones left out)."""
    rope = {
        "rope_type": "yarn",
        "factor": m.rope_factor,
        "original_max_position_embeddings": m.rope_original_positions,
        "beta_fast": m.rope_beta_fast,
        "beta_slow": m.rope_beta_slow,
        "truncate": m.rope_truncate,
    }
    optional = {"mscale": m.rope_mscale, "mscale_all_dim": m.rope_mscale_all_dim,
                "attention_factor": m.rope_attention_factor}  # fmt: skip
    return rope | {k: v for k, v in optional.items() if v}


def _extended(m: LlamaConfig) -> int:
    """The positions the model takes: YaRN's original length times its factor."""
    if m.rope_scaling is RopeScaling.YARN:
        return int(m.rope_original_positions * m.rope_factor)
    return m.rope_original_positions


def config_to_hf(m: LlamaConfig, seq_len: int, family: Family = BY_NAME["llama"]) -> dict:
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling is RopeScaling.LLAMA3:
        rope |= {
            "rope_type": "llama3",
            "factor": m.rope_factor,
            "low_freq_factor": m.rope_low_freq_factor,
            "high_freq_factor": m.rope_high_freq_factor,
            "original_max_position_embeddings": m.rope_original_positions,
        }
    if m.rope_scaling is RopeScaling.LINEAR:
        rope |= {"rope_type": "linear", "factor": m.rope_factor}
    if m.rope_scaling is RopeScaling.YARN:
        rope |= _yarn_to_hf(m)
    if family.owns("rope_local_theta"):  # Gemma 3: the local layers' own, unscaled
        local = {"rope_type": "default", "rope_theta": m.rope_local_theta}
        rope = {"full_attention": rope, "sliding_attention": local if m.rope_local_theta else rope}
    return {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": m.embed,
        "intermediate_size": m.mlp,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim or m.embed // m.heads,
        "hidden_act": next((k for k, v in ACTIVATIONS.items() if v == m.activation), None),
        "rms_norm_eps": m.norm_eps,
        "vocab_size": m.vocab,
        "tie_word_embeddings": m.tie_embeddings,
        "max_position_embeddings": max(seq_len, _extended(m)),
        "rope_parameters": rope,
        "dtype": "float32",
        **({"num_nextn_predict_layers": m.mtp_depth} if m.mtp_depth else {}),
        **family.to_hf(m),  # its own keys, over Llama's where they differ (DeepSeek's head_dim)
    }


def hf_tensors(m: LlamaConfig, family: Family = BY_NAME["llama"]) -> list[Tensor]:
    """Each leaf and its tensor: nn.Linear stores [out, in]; q/k/v/o by head, in order.
    With model.moe_every = n > 1 the blocks are stacked by groups of n (models/llama.py's
    Group): a leaf of the group's i-th block holds the file's layers i, n + i, ..."""
    family.check(m)
    out = [Tensor("tokens", "model.embed_tokens.weight", "v e", "v e")]
    n, k = m.unit_size, m.dense_first
    if k:  # the first dense blocks: the file's first layers
        out += _block("first/", m, family, False)
    if n == 1:
        out += _block("blocks/", m, family, bool(m.experts), offset=k)
    else:
        every_block = bool(m.experts) and m.moe_every == 1  # a mixture in each (GPT-OSS)
        for i in range(n - 1):
            out += _block(f"blocks/head/{i}/", m, family, every_block, every=n, offset=k + i)
        out += _block("blocks/last/", m, family, bool(m.experts), every=n, offset=k + n - 1)
    if m.tail_size:  # the last local blocks, beyond whole groups
        out += _block("tail/", m, family, False, offset=m.layers - m.tail_size)
    if m.mtp_depth:  # DeepSeek's layers num_hidden_layers.. (models/mtp.py)
        out += _predictors(m, family)
    out.append(Tensor("norm/scale", "model.norm.weight", "e", "e"))
    return out if m.tie_embeddings else [*out, Tensor("head", "lm_head.weight", "v e", "e v")]


def _block(
    ours: str, m: LlamaConfig, family: Family, sparse: bool, every: int = 1, offset: int = 0
) -> list[Tensor]:
    """One block's leaves (`ours`: their path's prefix) and the file's tensors of them."""
    layer = "model.layers.{layer}."
    attn = layer + "self_attn."
    names = [
        ("attn_norm/scale", layer + "input_layernorm.weight", "e", "e"),
        *(_latent(attn, m) if m.kv_rank else _attention(attn)),
    ]
    if m.post_norms:  # Gemma: post_attention_layernorm is the attention's output's
        names += [
            ("attn_out_norm/scale", layer + "post_attention_layernorm.weight", "e", "e"),
            ("mlp_norm/scale", layer + "pre_feedforward_layernorm.weight", "e", "e"),
            ("mlp_out_norm/scale", layer + "post_feedforward_layernorm.weight", "e", "e"),
        ]
    else:
        names.append(("mlp_norm/scale", layer + "post_attention_layernorm.weight", "e", "e"))
    if sparse and family.experts:
        names += family.experts(m, layer)
    elif sparse:  # the router, then each expert's gate, up and down
        moe = layer + family.moe_prefix
        expert = moe + "experts.{expert}."
        gate, up, down = family.expert_projections
        names += [
            ("mlp/router", moe + "gate.weight", "x e", "e x"),
            ("mlp/w_gate", f"{expert}{gate}.weight", "m e", "e m"),
            ("mlp/w_up", f"{expert}{up}.weight", "m e", "e m"),
            ("mlp/w_down", f"{expert}{down}.weight", "e m", "m e"),
        ]
        if m.router is Router.SIGMOID:
            names.append(("mlp/bias", moe + "gate.e_score_correction_bias", "x", "x"))
        if m.shared_mlp:
            names += _mlp("shared/", layer + family.shared_prefix)
        if m.shared_gate:
            gate_name = layer + family.shared_prefix.rstrip(".") + "_gate.weight"
            names.append(("shared_gate", gate_name, "o e", "e o"))
    else:
        names += _mlp("mlp/", layer + "mlp.")
    if m.qkv_bias:
        names += [
            ("attn/bq", attn + "q_proj.bias", "(h d)", "h d"),
            ("attn/bk", attn + "k_proj.bias", "(k d)", "k d"),
            ("attn/bv", attn + "v_proj.bias", "(k d)", "k d"),
        ]
    if m.o_bias:
        names.append(("attn/bo", attn + "o_proj.bias", "e", "e"))
    if m.attn_sinks:
        names.append(("attn/sinks", attn + "sinks", "h", "h"))
    if m.qk_norm:
        names += [
            ("attn/q_norm/scale", attn + "q_norm.weight", "d", "d"),
            ("attn/k_norm/scale", attn + "k_norm.weight", "d", "d"),
        ]
    return [
        Tensor(ours + key, name, file, mine, every, offset, part[0] if part else None)
        for key, name, file, mine, *part in names
    ]


def _predictors(m: LlamaConfig, family: Family) -> list[Tensor]:
    """The multi-token prediction modules' leaves, as DeepSeek lays them out: module k in
    layer num_hidden_layers + k (eh_proj's input: the embedding's dims, then the hidden
    state's), its block as a layer's."""
    layer = "model.layers.{layer}."
    names = [
        ("mtp/enorm/scale", layer + "enorm.weight", "e", "e"),
        ("mtp/hnorm/scale", layer + "hnorm.weight", "e", "e"),
        ("mtp/eh_proj", layer + "eh_proj.weight", "f (t e)", "t e f"),
        ("mtp/norm/scale", layer + "shared_head.norm.weight", "e", "e"),
    ]
    out = [Tensor(key, *rest, offset=m.layers) for key, *rest in names]
    return out + _block("mtp/block/", m, family, bool(m.experts), offset=m.layers)


def unread(m: LlamaConfig) -> str:
    """The tensors of a checkpoint the model does not read: layers past its own and its
    prediction modules' (DeepSeek's, when model.mtp_depth is less; transformers drops
    them all), and the copies each module's layer holds of the embedding and head."""
    past = "|".join(map(str, range(m.layers + m.mtp_depth, m.layers + MTP_MOST + 1)))
    return rf"^model\.layers\.(({past})\.|\d+\.(embed_tokens|shared_head\.head)\.weight$)"


def copies(m: LlamaConfig) -> dict:
    """Each prediction module's layer's copies of the embedding and the head, as
    DeepSeek's checkpoints hold them (its readers look there)."""
    head = "model.embed_tokens.weight" if m.tie_embeddings else "lm_head.weight"
    out = {}
    for layer in range(m.layers, m.layers + m.mtp_depth):
        out[f"model.layers.{layer}.embed_tokens.weight"] = "model.embed_tokens.weight"
        out[f"model.layers.{layer}.shared_head.head.weight"] = head
    return out


def _attention(attn: str) -> list[tuple]:
    return [
        ("attn/wq", attn + "q_proj.weight", "(h d) e", "e h d"),
        ("attn/wk", attn + "k_proj.weight", "(k d) e", "e k d"),
        ("attn/wv", attn + "v_proj.weight", "(k d) e", "e k d"),
        ("attn/wo", attn + "o_proj.weight", "e (h d)", "h d e"),
    ]


def _latent(attn: str, m: LlamaConfig) -> list[tuple]:
    """Latent attention's leaves (models/latent.py) as DeepSeek names them."""
    if m.q_rank:
        query = [
            ("attn/wq_a", attn + "q_a_proj.weight", "q e", "e q"),
            ("attn/q_norm/scale", attn + "q_a_layernorm.weight", "q", "q"),
            ("attn/wq_b", attn + "q_b_proj.weight", "(h d) q", "q h d"),
        ]
    else:
        query = [("attn/wq", attn + "q_proj.weight", "(h d) e", "e h d")]
    return [
        *query,
        ("attn/wkv_a", attn + "kv_a_proj_with_mqa.weight", "l e", "e l"),
        ("attn/kv_norm/scale", attn + "kv_a_layernorm.weight", "l", "l"),
        ("attn/wkv_b", attn + "kv_b_proj.weight", "(h d) l", "l h d"),
        ("attn/wo", attn + "o_proj.weight", "e (h d)", "h d e"),
    ]


def _mlp(ours: str, theirs: str) -> list[tuple]:
    gate, up, down = LLAMA_PROJECTIONS
    return [
        (ours + "w_gate", f"{theirs}{gate}.weight", "m e", "e m"),
        (ours + "w_up", f"{theirs}{up}.weight", "m e", "e m"),
        (ours + "w_down", f"{theirs}{down}.weight", "e m", "m e"),
    ]


FORMATS = {
    family.name: HFFormat(
        family.architecture,
        functools.partial(config_from_hf, family=family),
        functools.partial(config_to_hf, family=family),
        functools.partial(hf_tensors, family=family),
        training=("router_aux_loss",),
        wrappers=family.wrappers,
        weights_check=family.weights_check,
        unread=unread,
        copies=copies,
    )
    for family in FAMILIES
}
