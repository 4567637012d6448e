"""The Hugging Face families of the Llama model (models/llama.py), one record each: its
architecture and model_type, the model keys it fixes or may set, and how its config.json
and its tensors differ from `LlamaForCausalLM`'s. models/llama_hf.py reads and writes
every family through its record; models/__init__.py registers each as a model.name;
models/llama.py refuses keys that are another family's. Adding a family is one record
here, a preset and its test against `transformers`.

No jax here: the command line reads these records before jax starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.hf import Wrapper

LLAMA_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # an MLP's, and Qwen's experts'


def _nothing(*_) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    name: str  # model.name
    architecture: str  # config.json's `architectures`
    model_type: str  # config.json's `model_type`
    # model keys the family fixes (a key set otherwise is refused)
    fixed: dict = field(default_factory=dict)
    # model keys the family may set; any other family's own or fixed keys are refused
    free: tuple[str, ...] = ()
    # a mixture of experts: what a user should set model.experts to, e.g. "Mixtral 8x7B: 8"
    mixture: str = ""
    # config.json -> model keys of this family beyond Llama's (the mixture's included)
    from_hf: Callable[[dict], dict] = _nothing
    # model config -> config.json keys of this family beyond Llama's
    to_hf: Callable = _nothing
    # a sparse block's tensors: the mixture's prefix in a layer, and each expert's
    # gate, up and down projection names
    moe_prefix: str = "mlp."
    expert_projections: tuple[str, str, str] = LLAMA_PROJECTIONS
    # the shared expert's prefix in a sparse block (its projections: an MLP's names)
    shared_prefix: str = "mlp.shared_expert."
    # (model config) -> None, or a ConfigError: what its checkpoints cannot express
    check: Callable = _nothing
    preset: str = ""  # its tiny preset's name; "" = NAME-tiny
    # config.json keys at the family's transformers defaults, where a release leaves
    # them out (Gemma 3's multimodal releases give a few text keys only)
    defaults: dict = field(default_factory=dict)
    # the releases that hold the family's model inside a larger one
    wrappers: tuple[Wrapper, ...] = ()
    # (model config, a layer's prefix) -> a sparse block's router and experts as
    # (leaf, tensor, file dims, our dims[, (part, parts)]); None: Mixtral's layout, a
    # tensor per expert and projection
    experts: Callable | None = None
    # (config.json) -> None, or a CheckpointError: weights it cannot read (a config
    # alone, as plan reads it, is still read)
    weights_check: Callable = _nothing

    @property
    def tiny(self) -> str:
        return self.preset or f"{self.name}-tiny"

    def owns(self, key: str) -> bool:
        return key in self.fixed or key in self.free


def _window(hf: dict) -> dict:
    return {"sliding_window": int(hf.get("sliding_window") or 0)}


def _experts(hf: dict) -> dict:
    balance = float(hf.get("router_aux_loss_coef", 0.0))
    return {
        "experts": hf.get("num_experts") or hf["num_local_experts"],
        "experts_per_token": hf["num_experts_per_tok"],
        # transformers adds the load-balance loss only with output_router_logits
        "router_aux_loss": balance if hf.get("output_router_logits") else 0.0,
    }


def _experts_to_hf(m) -> dict:
    return {
        "num_experts_per_tok": m.experts_per_token,
        "router_aux_loss_coef": m.router_aux_loss,
        "output_router_logits": m.router_aux_loss > 0,
    }


def _qwen3_moe_from_hf(hf: dict) -> dict:
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
    return _experts(hf) | {
        "mlp": expert,
        "moe_every": step,
        "router_renormalize": bool(hf.get("norm_topk_prob", False)),
    }


def _qwen3_moe_to_hf(m) -> dict:
    return _experts_to_hf(m) | {
        "attention_bias": False,
        "use_sliding_window": False,
        "num_experts": m.experts,
        "moe_intermediate_size": m.mlp,
        "decoder_sparse_step": m.moe_every,
        "mlp_only_layers": [],
        "norm_topk_prob": m.router_renormalize,
    }


def _mixtral_check(m) -> None:
    if m.moe_every != 1:
        raise ConfigError(
            f"model.moe_every={m.moe_every}: Mixtral's checkpoints have a mixture in every "
            "block; only model.moe_every=1 reads or writes one"
        )
    if not m.router_renormalize:
        raise ConfigError(
            "model.router_renormalize=false: Mixtral always renormalizes its experts' "
            "weights; drop it, or use model.name=qwen3_moe (norm_topk_prob)"
        )


def _qwen2_moe_from_hf(hf: dict) -> dict:
    """Qwen2-MoE's mixture keys: its dense blocks' hidden size apart from its experts',
    and a gated shared expert in every sparse block."""
    if hf.get("mlp_only_layers"):
        raise CheckpointError(
            f"config.json: mlp_only_layers={hf['mlp_only_layers']} is not supported (jaxpar "
            "places its sparse blocks by decoder_sparse_step alone: model.moe_every)"
        )
    return _experts(hf) | {
        "mlp": hf["intermediate_size"],
        "expert_mlp": hf["moe_intermediate_size"],
        "shared_mlp": hf["shared_expert_intermediate_size"],
        "moe_every": hf.get("decoder_sparse_step", 1),
        "router_renormalize": bool(hf.get("norm_topk_prob", False)),
    }


def _qwen2_moe_to_hf(m) -> dict:
    return _experts_to_hf(m) | {
        "use_sliding_window": False,
        "num_experts": m.experts,
        "moe_intermediate_size": m.expert_mlp or m.mlp,
        "shared_expert_intermediate_size": m.shared_mlp,
        "decoder_sparse_step": m.moe_every,
        "mlp_only_layers": [],
        "norm_topk_prob": m.router_renormalize,
        "qkv_bias": True,
    }


def _qwen2_moe_check(m) -> None:
    if not m.shared_mlp:
        raise ConfigError(
            "model.shared_mlp=0: Qwen2-MoE's sparse blocks have a shared expert; set "
            "model.shared_mlp to its hidden dims (shared_expert_intermediate_size)"
        )


def _deepseek_from_hf(hf: dict) -> dict:
    """DeepSeek-V3's keys: latent attention, a sigmoid router with groups, shared
    experts, the first blocks dense."""
    if not hf.get("rope_interleave", True):
        raise CheckpointError(
            "config.json: rope_interleave=false is not supported (jaxpar reads DeepSeek's "
            "rotated dims as interleaved pairs, as its checkpoints lay them out)"
        )
    expert = hf["moe_intermediate_size"]
    return {
        "experts": hf["n_routed_experts"],
        "experts_per_token": hf["num_experts_per_tok"],
        "expert_mlp": expert,
        "shared_mlp": (hf.get("n_shared_experts") or 0) * expert,
        "router_renormalize": bool(hf.get("norm_topk_prob", True)),
        "router_groups": hf.get("n_group") or 1,
        "router_top_groups": hf.get("topk_group") or 1,
        "routed_scaling": float(hf.get("routed_scaling_factor", 1.0)),
        "dense_first": hf.get("first_k_dense_replace", 0),
        "kv_rank": hf["kv_lora_rank"],
        "q_rank": hf.get("q_lora_rank") or 0,
        "rope_dim": hf["qk_rope_head_dim"],
        "head_dim": hf["qk_nope_head_dim"],
        "v_dim": hf["v_head_dim"],
        "kv_heads": hf["num_attention_heads"],
    }


def _deepseek_to_hf(m) -> dict:
    nope, expert = m.head_dim or m.embed // m.heads, m.expert_mlp or m.mlp
    return {
        "attention_bias": False,
        "n_routed_experts": m.experts,
        "num_experts_per_tok": m.experts_per_token,
        "moe_intermediate_size": expert,
        "n_shared_experts": m.shared_mlp // expert,
        "norm_topk_prob": m.router_renormalize,
        "n_group": m.router_groups,
        "topk_group": m.router_top_groups,
        "routed_scaling_factor": m.routed_scaling,
        "first_k_dense_replace": m.dense_first,
        "kv_lora_rank": m.kv_rank,
        "q_lora_rank": m.q_rank or None,
        "qk_rope_head_dim": m.rope_dim,
        "qk_nope_head_dim": nope,
        "qk_head_dim": nope + m.rope_dim,
        "v_head_dim": m.v_dim or nope,
        "head_dim": m.rope_dim,  # transformers' name for the rotated dims
        "num_key_value_heads": m.heads,
        "rope_interleave": True,
        "num_nextn_predict_layers": m.mtp_depth,
    }


def _deepseek_check(m) -> None:
    if not m.kv_rank:
        raise ConfigError(
            "model.kv_rank=0: DeepSeek-V3 attends through a latent; set model.kv_rank "
            "(kv_lora_rank, 512) with model.rope_dim (64)"
        )
    expert = m.expert_mlp or m.mlp
    if m.shared_mlp % expert or m.moe_every != 1:
        raise ConfigError(
            f"model.shared_mlp={m.shared_mlp}, model.moe_every={m.moe_every}: DeepSeek-V3's "
            f"checkpoints hold n_shared_experts of the experts' {expert} hidden dims each, "
            "and a mixture in every block after the first dense ones; choose a multiple of "
            "the experts' dims and model.moe_every=1"
        )


# config.json's layer_types: each layer's attention
SLIDING, FULL = "sliding_attention", "full_attention"


def _local_global(hf: dict, default_every: int) -> int:
    """model.global_every of a Gemma config.json's layer_types (default: every
    `default_every`-th layer global): every n-th layer global, the others sliding; 0
    where all are alike."""
    layers = hf["num_hidden_layers"]
    every = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or default_every
    kinds = hf.get("layer_types") or [
        FULL if (i + 1) % every == 0 else SLIDING for i in range(layers)
    ]
    if len(set(kinds)) == 1:
        return 0
    n = kinds.index(FULL) + 1
    if kinds != [FULL if (i + 1) % n == 0 else SLIDING for i in range(layers)]:
        raise CheckpointError(
            f"config.json: layer_types={kinds} is not supported (jaxpar's local and global "
            "attention: every n-th layer full_attention, the others sliding_attention)"
        )
    return n


def _gemma2_from_hf(hf: dict) -> dict:
    return _gemma_from_hf(hf) | {"attn_softcap": float(hf.get("attn_logit_softcapping") or 0)}


def _gemma_from_hf(hf: dict, default_every: int = 2) -> dict:
    """Gemma's keys: local and global attention, the logits' soft cap, the query scale
    (Gemma 2's attention cap apart: transformers' Gemma 3 never applies one)."""
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError(
            "config.json: use_bidirectional_attention=true is not supported (jaxpar's "
            "attention is causal)"
        )
    every = _local_global(hf, default_every)
    all_sliding = not every and (hf.get("layer_types") or [SLIDING])[0] == SLIDING
    return {
        "sliding_window": int(hf.get("sliding_window") or 0) if every or all_sliding else 0,
        "global_every": every,
        "logit_softcap": float(hf.get("final_logit_softcapping") or 0.0),
        "query_scale": float(hf.get("query_pre_attn_scalar") or 0.0),
    }


def _gemma3_from_hf(hf: dict) -> dict:
    """Gemma 3's keys: Gemma 2's, q/k norms, the local blocks' own rotary base."""
    local = (hf.get("rope_parameters") or {}).get(SLIDING) or {}
    if local.get("rope_type", "default") != "default":
        raise CheckpointError(
            f"config.json: rope_parameters.sliding_attention.rope_type="
            f"{local['rope_type']!r} is not supported (jaxpar's local blocks: default rope)"
        )
    theta = float(local.get("rope_theta") or hf.get("rope_local_base_freq") or 10000.0)
    keys = _gemma_from_hf(hf, 6)
    if keys["global_every"]:
        return keys | {"rope_local_theta": theta}
    alike = {"rope_theta": theta} if keys["sliding_window"] else {}  # every layer local
    return keys | alike | {"rope_local_theta": 0.0}


def _gemma_to_hf(m) -> dict:
    scalar = m.query_scale or m.head_dim or m.embed // m.heads
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        # transformers takes an int (every Gemma's is one)
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "attn_logit_softcapping": m.attn_softcap or None,  # Gemma 3: always none
        "final_logit_softcapping": m.logit_softcap or None,
        "sliding_window": m.sliding_window or None,
        "layer_types": [SLIDING if m.window_of(i) else FULL for i in range(m.layers)],
    }


GEMMA = {"norm_offset": True, "post_norms": True, "embed_scale": True, "activation": "gelu_tanh"}
GEMMA_KEYS = ("sliding_window", "global_every", "logit_softcap", "query_scale")
# transformers' Gemma3TextConfig() (its rope as the keys of the releases' day)
GEMMA3_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "max_position_embeddings": 131072,
}  # fmt: skip
# Gemma 3 4B, 12B and 27B: the text model under language_model., beside SigLIP; their
# transformers class never caps the logits (every release leaves the cap unset)
GEMMA3_MULTIMODAL = Wrapper(
    "Gemma3ForConditionalGeneration",
    "text_config",
    "language_model.",
    r"^(vision_tower|multi_modal_projector)\.",
    "the vision tower and its projector",
    ignores=("final_logit_softcapping",),
)


def _gpt_oss_from_hf(hf: dict) -> dict:
    """GPT-OSS's keys: a mixture in every block, biased, with the clamped SwiGLU;
    sliding and full attention in turn, with sinks and biases on every projection."""
    if not hf.get("attention_bias", True):
        raise CheckpointError(
            "config.json: attention_bias=false is not supported (jaxpar's GPT-OSS has "
            "biases on q, k, v and o, as every release)"
        )
    every = _local_global(hf, 2)
    return _experts(hf) | {
        "sliding_window": int(hf.get("sliding_window") or 0) if every else 0,
        "global_every": every,
        "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
    }


def _gpt_oss_to_hf(m) -> dict:
    return _experts_to_hf(m) | {
        "hidden_act": "silu",  # as the releases say; GPT-OSS's experts clamp their own
        "attention_bias": True,
        "num_local_experts": m.experts,
        "swiglu_alpha": m.swiglu_alpha,
        "swiglu_limit": m.swiglu_limit,
        "sliding_window": m.sliding_window or None,
        "layer_types": [SLIDING if m.window_of(i) else FULL for i in range(m.layers)],
    }


def _gpt_oss_experts(m, layer: str) -> list[tuple]:
    """GPT-OSS's router and experts: every expert in one tensor a projection, [in, out]
    (not nn.Linear's [out, in]), the gate and up projections interleaved in one."""
    router, experts = layer + "mlp.router.", layer + "mlp.experts."
    return [
        ("mlp/router", router + "weight", "x e", "e x"),
        ("mlp/router_bias", router + "bias", "x", "x"),
        ("mlp/w_gate", experts + "gate_up_proj", "x e (m t)", "x e m", (0, 2)),
        ("mlp/w_up", experts + "gate_up_proj", "x e (m t)", "x e m", (1, 2)),
        ("mlp/b_gate", experts + "gate_up_proj_bias", "x (m t)", "x m", (0, 2)),
        ("mlp/b_up", experts + "gate_up_proj_bias", "x (m t)", "x m", (1, 2)),
        ("mlp/w_down", experts + "down_proj", "x m e", "x m e"),
        ("mlp/b_down", experts + "down_proj_bias", "x e", "x e"),
    ]


def _gpt_oss_weights(hf: dict) -> None:
    method = (hf.get("quantization_config") or {}).get("quant_method")
    if method:
        raise CheckpointError(
            f"config.json: quantization_config.quant_method={method!r}: GPT-OSS's released "
            "experts are MXFP4 blocks, which jaxpar does not read; dequantize them to bf16 "
            "once (transformers: from_pretrained(DIR, quantization_config=Mxfp4Config("
            "dequantize=True)), then save_pretrained) and give that directory"
        )


def _gpt_oss_check(m) -> None:
    if m.moe_every != 1 or not m.router_renormalize:
        raise ConfigError(
            f"model.moe_every={m.moe_every}, model.router_renormalize="
            f"{str(m.router_renormalize).lower()}: GPT-OSS has a mixture in every block, "
            "its weights a softmax over the chosen experts; set model.moe_every=1 and "
            "model.router_renormalize=true"
        )


FAMILIES: tuple[Family, ...] = (
    Family(
        "llama",
        "LlamaForCausalLM",
        "llama",
        to_hf=lambda m: {"attention_bias": False, "mlp_bias": False},
    ),
    Family(
        "mistral",
        "MistralForCausalLM",
        "mistral",
        free=("sliding_window",),
        from_hf=_window,
        to_hf=lambda m: {"sliding_window": m.sliding_window or None},
    ),
    Family(
        "qwen2",
        "Qwen2ForCausalLM",
        "qwen2",
        fixed={"qkv_bias": True},
        to_hf=lambda m: {"use_sliding_window": False},
    ),
    Family(
        "qwen3",
        "Qwen3ForCausalLM",
        "qwen3",
        fixed={"qk_norm": True},
        to_hf=lambda m: {"attention_bias": False, "use_sliding_window": False},
    ),
    Family(
        "mixtral",
        "MixtralForCausalLM",
        "mixtral",
        free=("sliding_window", "experts", "router_aux_loss"),
        mixture="Mixtral 8x7B: 8",
        from_hf=lambda hf: _window(hf) | _experts(hf),
        to_hf=lambda m: (
            _experts_to_hf(m)
            | {
                "sliding_window": m.sliding_window or None,
                "num_local_experts": m.experts,
                "router_jitter_noise": 0.0,
            }
        ),
        moe_prefix="block_sparse_moe.",
        expert_projections=("w1", "w3", "w2"),
        check=_mixtral_check,
    ),
    Family(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        fixed={"qk_norm": True},
        free=("experts", "router_aux_loss"),
        mixture="Qwen3-30B-A3B: 128, with 8 a token",
        from_hf=_qwen3_moe_from_hf,
        to_hf=_qwen3_moe_to_hf,
    ),
    Family(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        fixed={"qkv_bias": True, "shared_gate": True},
        free=("experts", "router_aux_loss", "expert_mlp", "shared_mlp"),
        mixture="Qwen1.5-MoE-A2.7B: 60, with 4 a token",
        from_hf=_qwen2_moe_from_hf,
        to_hf=_qwen2_moe_to_hf,
        check=_qwen2_moe_check,
    ),
    Family(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        fixed={"router": "sigmoid"},
        free=(
            "experts",
            "expert_mlp",
            "shared_mlp",
            "router_bias_update",
            "router_groups",
            "router_top_groups",
            "routed_scaling",
            "dense_first",
            "kv_rank",
            "q_rank",
            "rope_dim",
            "v_dim",
        ),  # fmt: skip
        mixture="DeepSeek-V3: 256, with 8 a token",
        from_hf=_deepseek_from_hf,
        to_hf=_deepseek_to_hf,
        shared_prefix="mlp.shared_experts.",
        check=_deepseek_check,
        preset="deepseek-tiny",
    ),
    Family(
        "gemma2",
        "Gemma2ForCausalLM",
        "gemma2",
        fixed=GEMMA,
        free=(*GEMMA_KEYS, "attn_softcap"),
        from_hf=_gemma2_from_hf,
        to_hf=_gemma_to_hf,
    ),
    Family(
        "gemma3",
        "Gemma3ForCausalLM",
        "gemma3_text",
        fixed={**GEMMA, "qk_norm": True},
        free=(*GEMMA_KEYS, "rope_local_theta"),
        from_hf=_gemma3_from_hf,
        to_hf=_gemma_to_hf,
        defaults=GEMMA3_DEFAULTS,
        wrappers=(GEMMA3_MULTIMODAL,),
    ),
    Family(
        "gpt_oss",
        "GptOssForCausalLM",
        "gpt_oss",
        fixed={
            "qkv_bias": True,
            "o_bias": True,
            "attn_sinks": True,
            "expert_bias": True,
            "activation": "clamped_swiglu",
        },  # fmt: skip
        free=(
            "sliding_window",
            "global_every",
            "experts",
            "router_aux_loss",
            "swiglu_alpha",
            "swiglu_limit",
        ),  # fmt: skip
        mixture="GPT-OSS 20B: 32, with 4 a token",
        from_hf=_gpt_oss_from_hf,
        to_hf=_gpt_oss_to_hf,
        check=_gpt_oss_check,
        experts=_gpt_oss_experts,
        weights_check=_gpt_oss_weights,
    ),
)
BY_NAME = {f.name: f for f in FAMILIES}
