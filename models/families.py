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
    # (model config) -> None, or a ConfigError: what its checkpoints cannot express
    check: Callable = _nothing

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
)
BY_NAME = {f.name: f for f in FAMILIES}
