"""The models shipped with jaxpar, installed as `jaxpar.models`: one file each, whose
`SPEC` (a jaxpar.ModelSpec) says what jaxpar needs to know of it. Registered here by
module, so that naming one imports no jax until it is built.

To add a model: write `models/NAME.py` with its module and `SPEC`, add one line below,
and a preset in jaxpar/configs/; to add a Hugging Face family of the Llama model, one
record in models/families.py and a preset (a model with keys of its own declares its config
class here too, so that --help and the config checks need no jax). Nothing else in
jaxpar names a model.
"""

import enum
from dataclasses import dataclass
from typing import Annotated

from jaxpar.config.options import Range, key
from jaxpar.config.registry import register_module
from jaxpar.config.sections import Model

from .families import FAMILIES


class RopeScaling(enum.StrEnum):
    NONE = "none"
    LLAMA3 = "llama3"
    LINEAR = "linear"
    YARN = "yarn"


class Activation(enum.StrEnum):
    SILU = "silu"  # SwiGLU
    GELU_TANH = "gelu_tanh"  # GeGLU, GeLU's tanh approximation (Gemma)
    CLAMPED_SWIGLU = "clamped_swiglu"  # GPT-OSS's: clamped, sigmoid(alpha x), up + 1


class Router(enum.StrEnum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(Model):
    """model.* for model.name=llama (declared here, without jax, like every key)."""

    name: str = key("llama", "a registered model (jaxpar.config.registry)")
    kv_heads: Annotated[int, Range(1, 2**14, "key/value heads")] = key(
        8, "key/value heads (grouped-query attention); they divide model.heads"
    )
    rope_theta: Annotated[float, Range(1, 1e9, "a rotary base")] = key(
        10000.0, "the rotary embedding's base (Llama 2: 10000, Llama 3: 500000)"
    )
    rope_scaling: RopeScaling = key(
        RopeScaling.NONE,
        (
            "rotary frequency scaling: none | llama3 (Llama 3.1+'s long-context scaling) | "
            "linear (every frequency over model.rope_factor; Gemma 3's global blocks) | yarn "
            "(YaRN: DeepSeek-V3, Kimi K2, Qwen3's long context, GPT-OSS)"
        ),
    )
    rope_factor: Annotated[float, Range(1, 1024, "a scaling factor")] = key(
        8.0,
        "rope_scaling=llama3, linear or yarn: how much the (long) wavelengths are stretched",
    )
    rope_low_freq_factor: Annotated[float, Range(0, 1024, "a factor", True)] = key(
        1.0, "rope_scaling=llama3: wavelengths beyond original_positions / this are scaled"
    )
    rope_high_freq_factor: Annotated[float, Range(0, 1024, "a factor", True)] = key(
        4.0, "rope_scaling=llama3: wavelengths below original_positions / this are kept"
    )
    rope_original_positions: Annotated[int, Range(1, 2**24, "positions")] = key(
        8192, "rope_scaling=llama3 or yarn: the context length the model was first trained at"
    )
    rope_beta_fast: Annotated[float, Range(0, 1024, "rotations", True)] = key(
        32.0,
        (
            "rope_scaling=yarn: dims turning more than this many times over the original "
            "length keep their frequency"
        ),
    )
    rope_beta_slow: Annotated[float, Range(0, 1024, "rotations", True)] = key(
        1.0, "rope_scaling=yarn: dims turning less than this often are divided by model.rope_factor"
    )
    rope_mscale: Annotated[float, Range(0, 1024, "a factor; 0 = unset")] = key(
        0.0,
        (
            "rope_scaling=yarn: DeepSeek's mscale (with rope_mscale_all_dim: the attention "
            "factor's numerator)"
        ),
    )
    rope_mscale_all_dim: Annotated[float, Range(0, 1024, "a factor; 0 = unset")] = key(
        0.0,
        (
            "rope_scaling=yarn: DeepSeek's mscale_all_dim (the attention factor's denominator; "
            "latent attention's softmax scale times its square)"
        ),
    )
    rope_attention_factor: Annotated[float, Range(0, 1024, "a factor; 0 = derived")] = key(
        0.0,
        (
            "rope_scaling=yarn: what the rotated q and k are multiplied by; 0 = YaRN's "
            "0.1 ln(rope_factor) + 1 (or DeepSeek's mscale ratio)"
        ),
    )
    rope_truncate: bool = key(
        True, "rope_scaling=yarn: the ramp's ends rounded to whole dims (GPT-OSS: false)"
    )
    norm_eps: Annotated[float, Range(0, 1, "a small positive number", True)] = key(
        1e-5, "RMSNorm's epsilon"
    )
    tie_embeddings: bool = key(
        False, "the output head is the embedding table, transposed (no head of its own)"
    )
    head_dim: Annotated[int, Range(0, 2**14, "dims per head; 0 = embed / heads")] = key(
        0, "dims per attention head; 0 = model.embed / model.heads (Qwen3 sets its own)"
    )
    qkv_bias: bool = key(False, "biases on the q, k and v projections (Qwen2)")
    o_bias: bool = key(
        False, "a bias on the attention's output projection (GPT-OSS, with model.qkv_bias)"
    )
    attn_sinks: bool = key(
        False,
        "a learned sink logit per head in each softmax's denominator, with no value: a "
        "head may attend to nothing (GPT-OSS)",
    )
    qk_norm: bool = key(False, "RMSNorm on each head's q and k, before the rotation (Qwen3)")
    sliding_window: Annotated[int, Range(0, 2**24, "tokens; 0 = no window")] = key(
        0,
        (
            "each token attends to at most this many tokens, itself included (Mistral); 0 = "
            "all before it. A window of train.seq_len or more masks nothing at that length"
        ),
    )
    experts: Annotated[int, Range(0, 2**12, "experts; 0 = a dense MLP")] = key(
        0,
        (
            "a sparse mixture of experts in every block's feed-forward (Mixtral): this many "
            "SwiGLU experts of model.mlp hidden dims each; 0 = one dense MLP"
        ),
    )
    moe_every: Annotated[int, Range(1, 2**12, "layers")] = key(
        1,
        (
            "model.experts > 0: every n-th block's feed-forward is the mixture (blocks n, 2n, "
            "...; Qwen3-MoE's decoder_sparse_step), the others dense; 1 = every block. "
            "model.layers must be a multiple of it"
        ),
    )
    experts_per_token: Annotated[int, Range(1, 2**12, "experts a token is sent to")] = key(
        2, "model.experts > 0: the k experts the router sends each token to (top-k)"
    )
    router_renormalize: bool = key(
        True,
        (
            "model.experts > 0: the k chosen experts' weights renormalized to sum to 1 "
            "(Mixtral; Qwen3-MoE's norm_topk_prob); false: their router probabilities as they "
            "are"
        ),
    )
    capacity_factor: Annotated[float, Range(0, 2**12, "a factor >= 0; 0 = dropless")] = key(
        1.25,
        (
            "model.experts > 0: each expert takes ceil(factor x seq_len x k / experts) tokens "
            "of a sequence, the rest of its tokens dropped (passed on by the residual); "
            "0 = dropless: no capacity, every token to its experts by grouped products "
            "(lax.ragged_dot; over `expert` the tokens all-gathered, the outputs "
            "reduce-scattered)"
        ),
    )
    expert_mlp: Annotated[int, Range(0, 2**20, "hidden dims; 0 = model.mlp")] = key(
        0,
        (
            "model.experts > 0: each expert's hidden dims (moe_intermediate_size), where "
            "they differ from the dense blocks' model.mlp; 0 = model.mlp"
        ),
    )
    shared_mlp: Annotated[int, Range(0, 2**20, "hidden dims; 0 = none")] = key(
        0,
        (
            "model.experts > 0: a shared expert of this many hidden dims beside the routed "
            "ones, which every token goes to (Qwen2-MoE; DeepSeek's n_shared_experts x "
            "moe_intermediate_size); 0 = none"
        ),
    )
    shared_gate: bool = key(
        False,
        "model.shared_mlp > 0: the shared expert's output scaled by sigmoid(x . w), a "
        "learned gate of each token (Qwen2-MoE)",
    )
    router: Router = key(
        Router.SOFTMAX,
        (
            "model.experts > 0: the router's scores: softmax over the experts (Mixtral, Qwen) "
            "or sigmoid of each (DeepSeek-V3, with a balancing bias that enters the choice "
            "but not the weights)"
        ),
    )
    router_bias_update: Annotated[float, Range(0, 1, "a step >= 0")] = key(
        0.0,
        (
            "model.router=sigmoid: DeepSeek's auxiliary-loss-free balance: after each step "
            "each expert's bias moves by this step toward the mean load (up when it got "
            "fewer of the batch's choices than the mean, down when more); 0 = the bias "
            "is kept as it is"
        ),
    )
    router_groups: Annotated[int, Range(1, 2**12, "groups")] = key(
        1,
        (
            "model.experts > 0: group-limited top-k (DeepSeek's n_group): the experts in "
            "this many equal groups, a token's k chosen among the model.router_top_groups "
            "groups whose two best scores sum highest; 1 = no groups"
        ),
    )
    router_top_groups: Annotated[int, Range(1, 2**12, "groups")] = key(
        1, "model.router_groups > 1: the groups a token's experts come from (topk_group)"
    )
    routed_scaling: Annotated[float, Range(0, 1e3, "a factor > 0")] = key(
        1.0, "model.experts > 0: the routed experts' weights scaled by this (DeepSeek: 2.5)"
    )
    dense_first: Annotated[int, Range(0, 2**12, "blocks")] = key(
        0,
        (
            "model.experts > 0: the first this many blocks have a dense MLP of model.mlp "
            "hidden dims, the rest the mixture (DeepSeek's first_k_dense_replace); they run "
            "with the embedding, before the layer stack"
        ),
    )
    kv_rank: Annotated[int, Range(0, 2**16, "latent dims; 0 = none")] = key(
        0,
        (
            "multi-head latent attention (DeepSeek's kv_lora_rank): keys and values from a "
            "compressed latent of this many dims, normed, and a rotary key of "
            "model.rope_dim shared by the heads; model.head_dim is then each head's "
            "unrotated query/key dims. 0 = grouped-query attention"
        ),
    )
    q_rank: Annotated[int, Range(0, 2**16, "latent dims; 0 = a full projection")] = key(
        0,
        "model.kv_rank > 0: the queries through a normed latent of this many dims "
        "(q_lora_rank); 0 = one projection",
    )
    rope_dim: Annotated[int, Range(0, 2**14, "dims")] = key(
        0, "model.kv_rank > 0: each head's rotated query/key dims (qk_rope_head_dim)"
    )
    v_dim: Annotated[int, Range(0, 2**14, "dims; 0 = model.head_dim")] = key(
        0, "model.kv_rank > 0: each head's value dims (v_head_dim); 0 = model.head_dim"
    )
    global_every: Annotated[int, Range(0, 2**12, "blocks; 0 = every block alike")] = key(
        0,
        (
            "local and global attention: every n-th block attends to all before it, the "
            "others within model.sliding_window (Gemma 2: 2, Gemma 3: 6); the stack scans "
            "groups of n, and the last layers % n blocks are local. 0 = every block alike"
        ),
    )
    rope_local_theta: Annotated[float, Range(0, 1e9, "a rotary base; 0 = the global's")] = key(
        0.0,
        (
            "model.global_every > 0: the local blocks' rotary base, unscaled (Gemma 3: "
            "10000); 0 = the global blocks' rope, base and scaling alike (GPT-OSS)"
        ),
    )
    attn_softcap: Annotated[float, Range(0, 1e6, "a cap; 0 = none")] = key(
        0.0, "attention scores soft-capped: cap x tanh(score / cap) (Gemma 2: 50); 0 = none"
    )
    logit_softcap: Annotated[float, Range(0, 1e6, "a cap; 0 = none")] = key(
        0.0, "the output logits soft-capped: cap x tanh(logit / cap) (Gemma 2: 30); 0 = none"
    )
    query_scale: Annotated[float, Range(0, 2**20, "a scalar; 0 = the head dims")] = key(
        0.0,
        "attention scores scaled by query_scale^-0.5 (Gemma's query_pre_attn_scalar); "
        "0 = model.head_dim",
    )
    norm_offset: bool = key(
        False, "RMSNorm scales by 1 + w in fp32 (Gemma), its w initialized to 0; false: by w"
    )
    post_norms: bool = key(
        False,
        "an RMSNorm on the attention's and the MLP's outputs too, before each residual add (Gemma)",
    )
    embed_scale: bool = key(False, "the token embeddings scaled by sqrt(model.embed) (Gemma)")
    activation: Activation = key(
        Activation.SILU,
        "the gated MLP's activation: silu (SwiGLU) | gelu_tanh (GeGLU with GeLU's tanh "
        "approximation: Gemma) | clamped_swiglu (GPT-OSS's: min(gate, limit) x "
        "sigmoid(alpha x gate) x (clip(up, +-limit) + 1))",
    )
    swiglu_alpha: Annotated[float, Range(0, 1e3, "a slope > 0", True)] = key(
        1.702, "model.activation=clamped_swiglu: the gate is gate x sigmoid(alpha x gate)"
    )
    swiglu_limit: Annotated[float, Range(0, 1e6, "a bound > 0", True)] = key(
        7.0,
        "model.activation=clamped_swiglu: the gate clamped to at most this, the up "
        "projection to +-this",
    )
    expert_bias: bool = key(
        False,
        "model.experts > 0: biases on the router's logits and on each expert's gate, up "
        "and down projections (GPT-OSS)",
    )
    mtp_depth: Annotated[int, Range(0, 64, "modules; 0 = none")] = key(
        0,
        (
            "multi-token prediction (DeepSeek-V3's): this many modules after the stack, the "
            "k-th predicting the token k + 1 ahead from the previous one's hidden state and "
            "the next tokens' embeddings, each a projection and a block of its own, with the "
            "model's embedding and head; read from and written to a checkpoint's layers "
            "from num_hidden_layers on. 0 = none"
        ),
    )
    mtp_weight: Annotated[float, Range(0, 1e3, "a weight >= 0")] = key(
        0.3,
        "model.mtp_depth > 0: the weight of the modules' mean loss (DeepSeek-V3: 0.3, then 0.1)",
    )
    router_aux_loss: Annotated[float, Range(0, 1e3, "a weight >= 0")] = key(
        0.0,
        (
            "model.experts > 0: the weight of the load-balance loss (Switch / Mixtral: experts "
            "x sum of each expert's share of the tokens x its mean router probability, over "
            "the trained tokens of the whole batch and all layers) added to the loss"
        ),
    )

    @property
    def unit_size(self) -> int:
        """Blocks per unit of the layer stack (models/llama.py's Group): model.moe_every
        for a mixture with dense blocks, model.global_every for local and global
        attention (a mixture in every block, GPT-OSS's, too), else 1."""
        return self.moe_every if self.experts and self.moe_every > 1 else self.global_every or 1

    @property
    def tail_size(self) -> int:
        """model.global_every's last blocks beyond whole groups: local, after the stack."""
        return self.layers % self.global_every if self.global_every else 0

    def window_of(self, layer: int) -> int:
        """The sliding window of block `layer` (0: it attends to all before it)."""
        if self.global_every and (layer + 1) % self.global_every == 0:
            return 0
        return self.sliding_window


register_module("gpt", "jaxpar.models.gpt", tiny="gpt-tiny", default=True)
register_module("mlp", "jaxpar.models.mlp", tiny="mlp-tiny")
# the Llama model and its Hugging Face families, a record each (models/families.py)
for family in FAMILIES:
    register_module(family.name, "jaxpar.models.llama", config=LlamaConfig, tiny=family.tiny)
