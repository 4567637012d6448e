"""Llama-family decoder: token embedding, pre-norm blocks (RMSNorm; grouped-query causal
attention with rotary position embeddings in the rotate-half layout that Hugging Face
`transformers` uses; a SwiGLU MLP), final RMSNorm, an output head tied to the embedding
or not. No biases. Layers are stacked and scanned.

Tensor parallel as Megatron: q/k/v, gate and up column-split, o and down row-split, the
embedding and head split over vocab; the key/value heads are split over `tensor` where
their number divides it, and otherwise computed whole on every tensor device.

With model.experts > 0 (Mixtral), each block's MLP is a sparse mixture of SwiGLU experts
(models/moe.py), each expert split over `tensor` as the MLP is; with model.moe_every = n,
every n-th block's (the stack then scans groups of n blocks); a shared expert beside
them (model.shared_mlp, gated with model.shared_gate); the first model.dense_first
blocks dense, run with the embedding. With model.kv_rank > 0 the attention is
DeepSeek's latent attention (models/latent.py)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config.registry import (
    AttentionDims,
    BlockKind,
    CacheDims,
    ExpertDims,
    ModelDims,
    ModelSpec,
)
from jaxpar.errors import ConfigError
from jaxpar.hf import init_notes
from jaxpar.names import (
    BATCH,
    EMBED,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    MLP,
    QKV,
    ROUTES,
    SEQ,
    SEQ_RESIDUAL,
    VOCAB,
)
from jaxpar.nn import documents, logits
from jaxpar.nn.attention import Scores, cached_attention, causal_attention
from jaxpar.nn.documents import Documents
from jaxpar.nn.layers import constrain, dense, param, scan_layers, stack, unrolled
from jaxpar.nn.problem import Stages

from . import Activation, LlamaConfig, RopeScaling, Router
from .common import (
    Gated,
    along_last,
    apply_layer,
    embed_inputs,
    embed_tokens,
    flops_per_token,
    language_model_stages,
    normal,
    rotate,
    token_losses,
)
from .families import FAMILIES, Family
from .latent import LatentAttention
from .llama_hf import FORMATS
from .moe import Load, MoE, balance_loss, capacity, report_load
from .mtp import Predictor, mtp_losses


def head_size(m: LlamaConfig) -> int:
    """Dims per head: model.head_dim, or embed / heads."""
    return m.head_dim or m.embed // m.heads


def _yarn_frequencies(cfg: LlamaConfig, inv: np.ndarray, d: int) -> np.ndarray:
    """YaRN (arXiv 2309.00071): each frequency blended from itself (dims that turn more
    than beta_fast times over the original length) to itself / rope_factor (less than
    beta_slow times), on a linear ramp between."""

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times
        turns = cfg.rope_original_positions / (rotations * 2 * math.pi)
        return d * math.log(turns) / (2 * math.log(cfg.rope_theta))

    low, high = dim_of(cfg.rope_beta_fast), dim_of(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / ((high - low) or 0.001), 0, 1)
    kept = (1 - ramp).astype(np.float32)  # 1: the frequency as it is
    interpolated = (inv / np.float32(cfg.rope_factor)).astype(np.float32)
    return (interpolated * (1 - kept) + inv * kept).astype(np.float32)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: LlamaConfig) -> float:
    """What the rotated q and k are multiplied by (transformers' cos and sin): YaRN's
    attention factor (model.rope_attention_factor, or 0.1 ln(factor) + 1, or DeepSeek's
    mscale over mscale_all_dim); 1 otherwise."""
    if cfg.rope_scaling is not RopeScaling.YARN:
        return 1.0
    if cfg.rope_attention_factor:
        return cfg.rope_attention_factor
    f, m, m_all = cfg.rope_factor, cfg.rope_mscale, cfg.rope_mscale_all_dim
    if m and m_all:
        return _yarn_mscale(f, m) / _yarn_mscale(f, m_all)
    return _yarn_mscale(f)


def latent_softmax_factor(cfg: LlamaConfig) -> float:
    """DeepSeek's latent attention under YaRN: its softmax scale times
    mscale(factor, mscale_all_dim) squared (1 without YaRN, or without mscale_all_dim)."""
    if cfg.rope_scaling is not RopeScaling.YARN or not cfg.rope_mscale_all_dim:
        return 1.0
    return _yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2


def inverse_frequencies(cfg: LlamaConfig) -> np.ndarray:
    """RoPE's [rotated dims / 2] frequencies (float32, as transformers computes them),
    with Llama 3's scaling of the long wavelengths when rope_scaling=llama3, or YaRN's
    (yarn). The rotated dims: a head's (latent attention: model.rope_dim)."""
    d = cfg.rope_dim if cfg.kv_rank else head_size(cfg)
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d)
    inv = inv.astype(np.float32)
    if cfg.rope_scaling is RopeScaling.NONE:
        return inv
    if cfg.rope_scaling is RopeScaling.LINEAR:
        return (inv / np.float32(cfg.rope_factor)).astype(np.float32)
    if cfg.rope_scaling is RopeScaling.YARN:
        return _yarn_frequencies(cfg, inv, d)
    old, low, high = (
        cfg.rope_original_positions,
        cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor,
    )
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / cfg.rope_factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


class RMSNorm(nnx.Module):
    """x / rms(x) times its scale w; with `offset` (Gemma) times 1 + w, w from 0, the
    product in fp32 before the cast, as Gemma's checkpoints were trained."""

    def __init__(self, embed: int, eps: float, rngs: nnx.Rngs, names=(EMBED,), offset=False):
        init = nnx.initializers.zeros if offset else nnx.initializers.ones
        self.scale = param(rngs, init, (embed,), names)
        self.eps, self.offset = eps, offset

    def __call__(self, x_BxSxE):
        x = x_BxSxE.astype(jnp.float32)  # the mean square in fp32, as transformers does
        y = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + self.eps)
        shape = (1,) * (y.ndim - 1) + (-1,)
        if self.offset:
            return (y * (1.0 + self.scale[...]).reshape(shape)).astype(x_BxSxE.dtype)
        scale = self.scale[...].astype(x_BxSxE.dtype)
        return y.astype(x_BxSxE.dtype) * scale.reshape(shape)


def norm(cfg: LlamaConfig, rngs: nnx.Rngs, dims: int = 0, names=(EMBED,)) -> RMSNorm:
    """The model's RMSNorm over `dims` (default model.embed)."""
    return RMSNorm(dims or cfg.embed, cfg.norm_eps, rngs, names, cfg.norm_offset)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        e, h, kv, d = cfg.embed, cfg.heads, cfg.kv_heads, head_size(cfg)
        self.wq = param(rngs, normal(0.02), (e, h, d), (EMBED, HEADS, HEAD_DIM))
        self.wk = param(rngs, normal(0.02), (e, kv, d), (EMBED, KV_HEADS, HEAD_DIM))
        self.wv = param(rngs, normal(0.02), (e, kv, d), (EMBED, KV_HEADS, HEAD_DIM))
        out_std = 0.02 / (2 * cfg.layers) ** 0.5
        self.wo = param(rngs, normal(out_std), (h, d, e), (HEADS, HEAD_DIM, EMBED))
        if cfg.qkv_bias:  # Qwen2
            zeros = nnx.initializers.zeros
            self.bq = param(rngs, zeros, (h, d), (HEADS, HEAD_DIM))
            self.bk = param(rngs, zeros, (kv, d), (KV_HEADS, HEAD_DIM))
            self.bv = param(rngs, zeros, (kv, d), (KV_HEADS, HEAD_DIM))
        if cfg.o_bias:  # GPT-OSS
            self.bo = param(rngs, nnx.initializers.zeros, (e,), (EMBED,))
        if cfg.attn_sinks:  # GPT-OSS: each head's logit of attending to nothing
            self.sinks = param(rngs, nnx.initializers.zeros, (h,), (HEADS,))
        if cfg.qk_norm:  # Qwen3, Gemma 3: over each head's dims
            self.q_norm = norm(cfg, rngs, d, (HEAD_DIM,))
            self.k_norm = norm(cfg, rngs, d, (HEAD_DIM,))
        self.inv_freq = tuple(float(f) for f in inverse_frequencies(cfg))
        self.rope_scale = rope_attention_factor(cfg)
        self.window = cfg.sliding_window  # Mistral, Gemma's local blocks; 0: none
        self.scores = Scores((cfg.query_scale or d) ** -0.5, cfg.attn_softcap)

    def __call__(self, x_BxSxE, docs: Documents | None = None):
        dt = x_BxSxE.dtype
        # Each key/value head serves heads/kv_heads query heads, in order: its weights
        # are repeated to one per query head (a local slice on every tensor device), so
        # that q, k and v come from ONE product whose input gradient is one partial sum,
        # one all-reduce over tensor (three separate products would need three).
        group = self.wq.shape[1] // self.wk.shape[1]
        names, kv_names = (EMBED, HEADS, HEAD_DIM), (EMBED, KV_HEADS, HEAD_DIM)
        wk_ExHxD, wv_ExHxD = (
            constrain(jnp.repeat(constrain(w[...].astype(dt), kv_names), group, axis=1), names)
            for w in (self.wk, self.wv)
        )
        w_Ex3xHxD = constrain(
            jnp.stack([self.wq[...].astype(dt), wk_ExHxD, wv_ExHxD], axis=1),
            (EMBED, QKV, HEADS, HEAD_DIM),
        )
        qkv_BxSx3xHxD = dense("bse,ethd->bsthd", x_BxSxE, w_Ex3xHxD, (EMBED, QKV, HEADS, HEAD_DIM))
        if hasattr(self, "bq"):
            bk_HxD, bv_HxD = (
                jnp.repeat(b[...].astype(dt), group, axis=0) for b in (self.bk, self.bv)
            )
            qkv_BxSx3xHxD += jnp.stack([self.bq[...].astype(dt), bk_HxD, bv_HxD])[None, None]
        qkv_BxSx3xHxD = constrain(qkv_BxSx3xHxD, (BATCH, SEQ, QKV, HEADS, HEAD_DIM))
        q_BxSxHxD, k_BxSxHxD, v_BxSxHxD = (qkv_BxSx3xHxD[:, :, i] for i in range(3))
        positions_BxS = None if docs is None else docs.positions
        segments_BxS = None if docs is None else docs.segment_ids
        q_BxSxHxD, k_BxSxHxD = self._positioned(q_BxSxHxD, k_BxSxHxD, positions_BxS)
        # QK-clip's largest logits: not with qk_norm, whose weights do not scale them
        watched = logits.wanted() and not hasattr(self, "q_norm")
        out = causal_attention(
            q_BxSxHxD,
            k_BxSxHxD,
            v_BxSxHxD,
            segments_BxS,
            window=self.window,
            positions_BxS=positions_BxS,
            kv_group=group,
            scale=self.scores.scale,
            softcap=self.scores.softcap,
            sinks_H=self._sinks(),
            logit_max=watched,
        )
        out_BxSxHxD = out[0] if watched else out
        if watched:
            logits.seen(out[1], *self._scaling(group))
        out_BxSxHxD = constrain(out_BxSxHxD, (BATCH, SEQ, HEADS, HEAD_DIM))
        y_BxSxE = dense(
            "bshd,hde->bse", out_BxSxHxD, self.wo[...].astype(dt), (HEADS, HEAD_DIM, EMBED)
        )
        return constrain(self._out_bias(y_BxSxE), (BATCH, SEQ_RESIDUAL, EMBED))

    def _sinks(self):
        return self.sinks[...] if hasattr(self, "sinks") else None

    def _scaling(self, group: int) -> list[tuple]:
        """The weights that scale a head's logits, each with its power (Kimi K2's QK-clip):
        q and k alike with a key head per query head, q alone where heads share keys."""
        sides = ("q",) if group > 1 else ("q", "k")
        power = 1.0 / len(sides)
        names = [f"{kind}{side}" for side in sides for kind in ("w", "b")]
        return [(getattr(self, n), power) for n in names if hasattr(self, n)]

    def _out_bias(self, y_BxSxE):
        if not hasattr(self, "bo"):
            return y_BxSxE
        return y_BxSxE + along_last(self.bo, y_BxSxE)

    def _positioned(self, q_BxSxHxD, k_BxSxNxD, positions_BxS):
        """q and k normed per head (qk_norm) and rotated to their positions."""
        if hasattr(self, "q_norm"):
            q_BxSxHxD, k_BxSxNxD = self.q_norm(q_BxSxHxD), self.k_norm(k_BxSxNxD)
        inv_freq, scale = np.asarray(self.inv_freq, np.float32), self.rope_scale
        return rotate(q_BxSxHxD, inv_freq, positions_BxS, scale), rotate(
            k_BxSxNxD, inv_freq, positions_BxS, scale
        )

    def decode(self, x_BxTxE, positions_BxT, cache, slot, pad_B):
        """The attention of T new tokens through the KV cache (jaxpar.nn.attention): k and v
        of the key/value heads alone (no repeat), as the cache holds them."""
        dt = x_BxTxE.dtype
        q_BxTxHxD, k_BxTxKxD, v_BxTxKxD = (
            jnp.einsum("bte,ehd->bthd", x_BxTxE, w[...].astype(dt))
            for w in (self.wq, self.wk, self.wv)
        )
        if hasattr(self, "bq"):
            q_BxTxHxD += self.bq[...].astype(dt)[None, None]
            k_BxTxKxD += self.bk[...].astype(dt)[None, None]
            v_BxTxKxD += self.bv[...].astype(dt)[None, None]
        q_BxTxHxD, k_BxTxKxD = self._positioned(q_BxTxHxD, k_BxTxKxD, positions_BxT)
        out_BxTxHxD, cache = cached_attention(
            q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, cache, slot, pad_B, self.window, self.scores,
            self._sinks(),
        )  # fmt: skip
        # heads and head dim as one contracted dim: the weight read as it lies
        b, t, h, d = out_BxTxHxD.shape
        wo_HDxE = self.wo[...].astype(dt).reshape(h * d, -1)
        return self._out_bias(out_BxTxHxD.reshape(b, t, h * d) @ wo_HDxE), cache


class SwiGLU(nnx.Module):
    """down(act(gate(x)) * up(x)), act silu (SwiGLU) or tanh-GeLU (GeGLU: Gemma): gate and
    up column-split, down row-split over `mlp`."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, hidden: int = 0):
        e, m = cfg.embed, hidden or cfg.mlp
        self.gated = Gated.of(cfg)
        self.w_gate = param(rngs, normal(0.02), (e, m), (EMBED, MLP))
        self.w_up = param(rngs, normal(0.02), (e, m), (EMBED, MLP))
        self.w_down = param(rngs, normal(0.02 / (2 * cfg.layers) ** 0.5), (m, e), (MLP, EMBED))

    def __call__(self, x_BxSxE, fused: bool = True):
        """`fused`: gate and up as one product, for one partial sum (one all-reduce) of the
        input gradient; decoding takes no gradient, and reads the two weights apart
        rather than a stacked copy of them each step."""
        dt = x_BxSxE.dtype
        if fused:
            w_Ex2xM = constrain(
                jnp.stack([self.w_gate[...].astype(dt), self.w_up[...].astype(dt)], axis=1),
                (EMBED, QKV, MLP),
            )
            gate_up_BxSx2xM = dense("bse,etm->bstm", x_BxSxE, w_Ex2xM, (EMBED, QKV, MLP))
            gate_BxSxM, up_BxSxM = gate_up_BxSx2xM[:, :, 0], gate_up_BxSx2xM[:, :, 1]
        else:
            gate_BxSxM, up_BxSxM = (
                dense("bse,em->bsm", x_BxSxE, w[...].astype(dt), (EMBED, MLP))
                for w in (self.w_gate, self.w_up)
            )
        h_BxSxM = constrain(self.gated(gate_BxSxM, up_BxSxM), (BATCH, SEQ, MLP))
        y_BxSxE = dense("bsm,me->bse", h_BxSxM, self.w_down[...].astype(dt), (MLP, EMBED))
        return constrain(y_BxSxE, (BATCH, SEQ_RESIDUAL, EMBED))


class Block(nnx.Module):
    """Pre-norm attention and MLP, each added to the residual stream; with
    model.post_norms (Gemma) each output normed again before it is added."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = norm(cfg, rngs)
        if cfg.kv_rank:
            rope = (
                inverse_frequencies(cfg),
                rope_attention_factor(cfg),
                latent_softmax_factor(cfg),
            )
            self.attn = LatentAttention(cfg, rngs, RMSNorm, *rope)
        else:
            self.attn = Attention(cfg, rngs)
        self.mlp_norm = norm(cfg, rngs)
        if cfg.post_norms:
            self.attn_out_norm, self.mlp_out_norm = norm(cfg, rngs), norm(cfg, rngs)
        self.mlp = MoE(cfg, rngs) if cfg.experts else SwiGLU(cfg, rngs)
        if cfg.experts and cfg.shared_mlp:  # beside the routed experts (Qwen2-MoE, DeepSeek)
            self.shared = SwiGLU(cfg, rngs, cfg.shared_mlp)
            if cfg.shared_gate:
                self.shared_gate = param(rngs, normal(0.02), (cfg.embed, 1), (EMBED, ROUTES))

    def __call__(self, x_BxSxE, docs: Documents | None = None):
        return self.routed(x_BxSxE, docs)[0]

    def routed(self, x_BxSxE, docs: Documents | None = None, trained_BxS=None):
        """(the block's output, its experts' Load (None for a dense MLP)); `trained_BxS`:
        which tokens' targets are trained (None: all)."""
        x_BxSxE = x_BxSxE + self._out(self.attn(self.attn_norm(x_BxSxE), docs), "attn")
        y_BxSxE, load = self.feed_forward(self.mlp_norm(x_BxSxE), trained_BxS)
        return x_BxSxE + self._out(y_BxSxE, "mlp"), load

    def _out(self, y_BxSxE, part: str):
        """A sub-block's output as the residual adds it: normed with model.post_norms."""
        if not hasattr(self, "mlp_out_norm"):
            return y_BxSxE
        return getattr(self, f"{part}_out_norm")(y_BxSxE)

    def feed_forward(self, x_BxSxE, trained_BxS=None, decoding: bool = False):
        """Decoding: every token to its experts (dropless), as transformers does."""
        if not isinstance(self.mlp, MoE):
            return self.mlp(x_BxSxE, fused=not decoding), None
        y_BxSxE, load = self.mlp(x_BxSxE, trained_BxS, dropless=decoding)
        if hasattr(self, "shared"):
            shared_BxSxE = self.shared(x_BxSxE, fused=not decoding)
            if hasattr(self, "shared_gate"):
                w_Ex1 = self.shared_gate[...].astype(x_BxSxE.dtype)
                shared_BxSxE = jax.nn.sigmoid(x_BxSxE @ w_Ex1) * shared_BxSxE
            y_BxSxE = y_BxSxE + shared_BxSxE
        return y_BxSxE, load

    def decode(self, x_BxTxE, cache, positions_BxT, slot, pad_B):
        y_BxTxE, cache = self.attn.decode(
            self.attn_norm(x_BxTxE), positions_BxT, cache, slot, pad_B
        )
        x_BxTxE = x_BxTxE + self._out(y_BxTxE, "attn")
        y_BxTxE = self.feed_forward(self.mlp_norm(x_BxTxE), decoding=True)[0]
        return x_BxTxE + self._out(y_BxTxE, "mlp"), cache


class Group(nnx.Module):
    """n blocks the layer stack scans as one unit (and a pipeline stage holds whole):
    `head`, the first n - 1, and `last`. model.moe_every = n: the head's MLPs dense, the
    last's the mixture; model.global_every = n: the head's attention local (windowed),
    the last's global (each a mixture, with model.experts: GPT-OSS)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        *head, last = unit(cfg)
        self.head = nnx.List([Block(c, rngs) for c in head])
        self.last = Block(last, rngs)

    def __call__(self, x_BxSxE, docs: Documents | None = None):
        return self.routed(x_BxSxE, docs)[0]

    def routed(self, x_BxSxE, docs: Documents | None = None, trained_BxS=None):
        """(the group's output, its sparse blocks' Load summed; None: none sparse)."""
        loads = []
        for block in [*self.head, self.last]:
            x_BxSxE, load = block.routed(x_BxSxE, docs, trained_BxS)
            loads += [load] if load is not None else []
        return x_BxSxE, sum(loads[1:], loads[0]) if loads else None

    def decode(self, x_BxTxE, caches, positions_BxT, slot, pad_B):
        """As Block.decode, `caches` the group's blocks' caches, in order."""
        caches = list(caches)
        for i, block in enumerate([*self.head, self.last]):
            x_BxTxE, caches[i] = block.decode(x_BxTxE, caches[i], positions_BxT, slot, pad_B)
        return x_BxTxE, caches


def local(m: LlamaConfig) -> LlamaConfig:
    """A local block's config under model.global_every: windowed, with its own rotary
    base unscaled (model.rope_local_theta: Gemma 3) or the global blocks' rope."""
    if not m.rope_local_theta:
        return m
    return dataclasses.replace(m, rope_theta=m.rope_local_theta, rope_scaling=RopeScaling.NONE)


def unit(m: LlamaConfig) -> list[LlamaConfig]:
    """The configs of the blocks of one unit of the layer stack, in order."""
    n = m.unit_size
    if n == 1:
        return [m]
    if m.experts and m.moe_every > 1:
        return [dataclasses.replace(m, experts=0)] * (n - 1) + [m]
    return [local(m)] * (n - 1) + [dataclasses.replace(m, sliding_window=0)]


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, seq_len: int, rngs: nnx.Rngs):
        del seq_len  # positions are rotary: any length
        self.tokens = param(rngs, normal(0.02), (cfg.vocab, cfg.embed), (VOCAB, EMBED))
        self.embed_scale = math.sqrt(cfg.embed) if cfg.embed_scale else 0.0  # Gemma
        if cfg.dense_first:  # DeepSeek's first k blocks, dense: run with the embedding
            dense = dataclasses.replace(cfg, experts=0)
            self.first = stack(lambda r: Block(dense, r), cfg.dense_first, rngs)
        self.dense_first = cfg.dense_first
        n = self.every = cfg.unit_size
        units = (cfg.layers - cfg.dense_first - cfg.tail_size) // n
        self.blocks = stack(lambda r: (Group if n > 1 else Block)(cfg, r), units, rngs)
        self.tail_layers = cfg.tail_size
        if self.tail_layers:  # the last local blocks: run before the final norm
            self.tail = stack(lambda r: Block(local(cfg), r), self.tail_layers, rngs)
        self.norm = norm(cfg, rngs)
        self.tied = cfg.tie_embeddings
        self.logit_softcap = cfg.logit_softcap  # Gemma 2
        self.experts, self.experts_per_token = cfg.experts, cfg.experts_per_token
        self.router_aux_loss = cfg.router_aux_loss
        # the balance loss's layers: every block of a unit with a mixture in each
        self.sparse_layers = units * (n if cfg.experts and cfg.moe_every == 1 else 1)
        if cfg.mtp_depth:  # DeepSeek-V3's multi-token prediction, after the stack
            self.mtp = stack(lambda r: Predictor(cfg, r, Block, norm), cfg.mtp_depth, rngs)
            self.mtp_weight = cfg.mtp_weight
        if not self.tied:
            self.head = param(rngs, normal(0.02), (cfg.embed, cfg.vocab), (EMBED, VOCAB))

    def _embedded(self, tokens_BxS):
        x_BxSxE = embed_tokens(self.tokens, tokens_BxS, self.tokens.dtype)
        if self.embed_scale:  # the scale in the weights' dtype, as transformers has it
            return x_BxSxE * jnp.asarray(self.embed_scale, x_BxSxE.dtype)
        return x_BxSxE

    def embed(self, tokens_BxS, docs: Documents | None = None):
        """The residual stream of the tokens: their embeddings, through the first dense
        blocks where model.dense_first sets some."""
        x_BxSxE = self._embedded(tokens_BxS)
        if not hasattr(self, "first"):
            return x_BxSxE
        return scan_layers(self.first, x_BxSxE, lambda block, x: block(x, docs))

    def decode(self, tokens_BxT, positions_BxT, caches, slot, pad_B):
        """(logits [B, T, V] of T new tokens at cache slots slot.., the caches with their
        keys and values): `caches`, one (k, v) per layer as jaxpar.nn.attention.CACHE_NAMES
        lays them out."""
        x_BxTxE, caches = self.decode_states(tokens_BxT, positions_BxT, caches, slot, pad_B)
        return self._logits(x_BxTxE), caches

    def draft(self, h_BxTxE, tokens_BxT, positions_BxT, cache, slot, pad_B):
        """The first prediction module through its own cache (one layer's): (its hidden
        state, its logits of the token after `tokens`, the cache); `h` is the previous
        depth's hidden state (the model's normed output), `tokens` the tokens one ahead."""

        def one(module, _, cache):
            e_BxTxE = self._embedded(tokens_BxT)
            out_BxTxE, cache = module.decode(h_BxTxE, e_BxTxE, cache, positions_BxT, slot, pad_B)
            return (out_BxTxE, self.head_of(module.norm(out_BxTxE))), cache

        (out_BxTxE, logits_BxTxV), (cache,) = unrolled(self.mtp, None, [cache], one)
        return out_BxTxE, logits_BxTxV, cache

    def decode_states(self, tokens_BxT, positions_BxT, caches, slot, pad_B):
        """decode's stack output, before the final norm, and the caches."""
        n = self.every  # a Group's blocks: their caches side by side
        decode = lambda block, x, c: block.decode(x, c, positions_BxT, slot, pad_B)  # noqa: E731
        x_BxTxE = self._embedded(tokens_BxT)
        k, tail = self.dense_first, len(caches) - self.tail_layers
        first, units, last = caches[:k], caches[k:tail], caches[tail:]
        if hasattr(self, "first"):
            x_BxTxE, first = unrolled(self.first, x_BxTxE, first, decode)
        grouped = [units[i : i + n] for i in range(0, len(units), n)] if n > 1 else units
        x_BxTxE, grouped = unrolled(self.blocks, x_BxTxE, grouped, decode)
        units = [c for u in grouped for c in u] if n > 1 else grouped
        if hasattr(self, "tail"):
            x_BxTxE, last = unrolled(self.tail, x_BxTxE, last, decode)
        return x_BxTxE, [*first, *units, *last]

    def logits(self, x_BxSxE, docs: Documents | None = None):
        """The output of the stack, through the last local blocks (model.global_every's
        beyond whole groups), normed and projected to the vocab."""
        return self.head_of(self.features(x_BxSxE, docs))

    def features(self, x_BxSxE, docs: Documents | None = None):
        """The output of the stack through the last local blocks and the final norm: what
        the head reads (and a reward model's score, train.objective=reward)."""
        if hasattr(self, "tail"):
            x_BxSxE = scan_layers(self.tail, x_BxSxE, lambda block, x: block(x, docs))
        return self.norm(x_BxSxE)

    def _logits(self, x_BxSxE):
        return self.head_of(self.norm(x_BxSxE))

    def head_of(self, x_BxSxE):
        """The output head's logits of a normed hidden state (capped, for Gemma 2)."""
        head_ExV = self.tokens[...].T if self.tied else self.head[...]
        logits_BxSxV = dense("bse,ev->bsv", x_BxSxE, head_ExV.astype(x_BxSxE.dtype), (EMBED, VOCAB))
        if self.logit_softcap:
            cap = self.logit_softcap
            logits_BxSxV = (cap * jnp.tanh(logits_BxSxV.astype(jnp.float32) / cap)).astype(
                logits_BxSxV.dtype
            )
        return constrain(logits_BxSxV, (BATCH, SEQ, VOCAB))


def loss(model: Llama, batch: dict) -> jax.Array:
    """next_token_loss; with experts, each trained token's loss plus its part of the
    load-balance loss (model.router_aux_loss x moe.balance_loss), the experts' Load
    carried through the layer scan beside the residual stream, and the step's metrics of
    it reported."""
    if not model.experts:
        x_BxSxE = scan_layers(
            model.blocks, embed_inputs(model, batch), lambda block, x: apply_layer(block, x, batch)
        )
        return dense_losses(model, x_BxSxE, batch)
    carry = mixture_embed(model, batch)
    carry = scan_layers(model.blocks, carry, lambda block, c: mixture_layer(block, c, batch))
    return mixture_losses(model, carry, batch)


def dense_losses(model: Llama, x_BxSxE, batch: dict) -> jax.Array:
    """token_losses, and the multi-token prediction's where the model has it."""
    losses_BxS = token_losses(model, x_BxSxE, batch)
    return losses_BxS + mtp_losses(model, x_BxSxE, batch) if hasattr(model, "mtp") else losses_BxS


# A mixture's pipeline pieces (and its loss's): the activation is (residual, Load).


def mixture_embed(model: Llama, batch: dict) -> tuple[jax.Array, Load]:
    x_BxSxE = embed_inputs(model, batch)
    return x_BxSxE, Load.zeros(x_BxSxE.shape[0], model.experts)


def mixture_layer(block: Block, carry: tuple, batch: dict) -> tuple[jax.Array, Load]:
    x_BxSxE, load = carry
    docs, trained_BxS = documents.of_inputs(batch), documents.target_weights(batch)
    x_BxSxE, more = block.routed(x_BxSxE, docs, trained_BxS)
    return x_BxSxE, load + more


def mixture_losses(model: Llama, carry: tuple, batch: dict) -> jax.Array:
    x_BxSxE, load = carry
    losses_BxS = dense_losses(model, x_BxSxE, batch)
    k = model.experts_per_token
    balance_B = balance_loss(load, k, model.sparse_layers)
    report_load(load, balance_B, k, model.sparse_layers)
    if not model.router_aux_loss:
        return losses_BxS
    # each row's part spread over its trained tokens (the engine sums them)
    trained_BxS = documents.target_weights(batch)
    if trained_BxS is None:
        trained_BxS = jnp.ones(losses_BxS.shape, bool)
    w_BxS = trained_BxS.astype(jnp.float32)
    share_BxS = w_BxS / jnp.maximum(jnp.sum(w_BxS, -1, keepdims=True), 1.0)
    return losses_BxS + model.router_aux_loss * balance_B[:, None] * share_BxS


def stages(m: LlamaConfig, seq_len: int) -> Stages:
    """The pipeline's pieces: a mixture hands its Load on from stage to stage."""
    plain = language_model_stages(m, m.unit_size * block_flops(m, seq_len))
    pre, block, head = plain.costs  # the modules run on the last stage, with the head
    costs = (pre, block, head + mtp_flops(m, seq_len))
    plain = dataclasses.replace(plain, post=dense_losses, costs=costs)
    if not m.experts:
        return plain
    return dataclasses.replace(plain, pre=mixture_embed, layer=mixture_layer, post=mixture_losses)


DEFAULTS = {f.name: f.default for f in dataclasses.fields(LlamaConfig)}
# keys of a mixture of experts, and of latent attention: set without one, refused
MIXTURE_KEYS = ("moe_every", "router_aux_loss", "expert_mlp", "shared_mlp", "shared_gate",
                "router", "router_bias_update", "router_groups", "router_top_groups",
                "routed_scaling", "dense_first", "expert_bias")  # fmt: skip
LATENT_KEYS = ("q_rank", "rope_dim", "v_dim")
YARN_KEYS = ("rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim",
             "rope_attention_factor", "rope_truncate")  # fmt: skip


def _unset(m: LlamaConfig, keys: tuple[str, ...], what: str, needs: str) -> None:
    """Refuse any of `keys` set (off its default) where the model has no `what`."""
    for key in keys:
        if getattr(m, key) != DEFAULTS[key]:
            value = str(getattr(m, key)).lower()
            raise ConfigError(
                f"model.{key}={value} is a key of {what}; {needs}=0 has none: set {needs}, "
                f"or drop model.{key}"
            )


def check(m: LlamaConfig, mesh_shape: dict) -> None:
    if m.kv_rank:
        check_latent(m)
    else:
        _unset(m, LATENT_KEYS, "latent attention", "model.kv_rank")
        check_heads(m)
    if m.heads % m.kv_heads:
        raise ConfigError(
            f"model.kv_heads={m.kv_heads} does not divide model.heads={m.heads}: each "
            "key/value head serves an equal group of query heads"
        )
    if m.experts:
        check_experts(m)
    else:
        _unset(m, MIXTURE_KEYS, "a mixture of experts", "model.experts")
    if m.rope_scaling is not RopeScaling.YARN:
        for key in YARN_KEYS:
            if getattr(m, key) != DEFAULTS[key]:
                raise ConfigError(
                    f"model.{key}={str(getattr(m, key)).lower()} tunes YaRN only, and "
                    f"model.rope_scaling={m.rope_scaling}: set model.rope_scaling=yarn, or "
                    f"drop model.{key}"
                )
    if not m.mtp_depth:
        _unset(m, ("mtp_weight",), "multi-token prediction", "model.mtp_depth")
    elif m.global_every:
        raise ConfigError(
            f"model.mtp_depth={m.mtp_depth} with model.global_every={m.global_every}: "
            "multi-token prediction is built for a stack of like blocks (DeepSeek-V3's); "
            "drop one of them"
        )
    if m.global_every:
        check_local(m)
    else:
        _unset(m, ("rope_local_theta",), "local and global attention", "model.global_every")
    if m.activation is not Activation.CLAMPED_SWIGLU:
        for key in ("swiglu_alpha", "swiglu_limit"):
            if getattr(m, key) != DEFAULTS[key]:
                raise ConfigError(
                    f"model.{key}={getattr(m, key):g} tunes the clamped SwiGLU only, and "
                    f"model.activation={m.activation}: set model.activation=clamped_swiglu, "
                    f"or drop model.{key}"
                )


def check_local(m: LlamaConfig) -> None:
    n = m.global_every
    if not m.sliding_window or n < 2:
        raise ConfigError(
            f"model.global_every={n} with model.sliding_window={m.sliding_window}: every "
            "n-th block global, the others within the window; set model.sliding_window "
            "and n >= 2 (Gemma 2: 2, Gemma 3: 6)"
        )
    mixed = m.experts and (m.moe_every > 1 or m.dense_first or m.tail_size)
    for key in ("experts", "kv_rank"):
        if getattr(m, key) and (key == "kv_rank" or mixed):
            raise ConfigError(
                f"model.global_every={n} with model.{key}={getattr(m, key)}: local and "
                f"global attention is built for grouped-query blocks, each with a dense MLP "
                f"or each with the mixture (GPT-OSS: model.moe_every=1, no model.dense_first, "
                f"model.layers a multiple of {n}); drop one of them"
            )


def check_heads(m: LlamaConfig) -> None:
    if m.head_dim % 2:
        raise ConfigError(
            f"model.head_dim={m.head_dim}: rotary embeddings rotate pairs of dims; give an "
            "even head size"
        )
    if not m.head_dim and (m.embed % m.heads or (m.embed // m.heads) % 2):
        raise ConfigError(
            f"model.embed={m.embed} over model.heads={m.heads}: each head needs an even "
            "number of dims (rotary embeddings rotate pairs); choose embed = heads x an even "
            "head size"
        )


def check_latent(m: LlamaConfig) -> None:
    if not m.rope_dim or m.rope_dim % 2:
        raise ConfigError(
            f"model.rope_dim={m.rope_dim} with model.kv_rank={m.kv_rank}: latent attention "
            "rotates a key of its own, pairs of dims; give an even model.rope_dim > 0 "
            "(DeepSeek-V3: 64)"
        )
    if m.kv_heads != m.heads:
        raise ConfigError(
            f"model.kv_heads={m.kv_heads} with model.kv_rank={m.kv_rank}: latent attention "
            f"expands keys and values for every head; set model.kv_heads={m.heads} "
            "(model.heads)"
        )
    for key in ("qkv_bias", "qk_norm", "sliding_window", "o_bias", "attn_sinks"):
        if getattr(m, key):
            raise ConfigError(
                f"model.{key}={str(getattr(m, key)).lower()} is grouped-query attention's; "
                f"latent attention (model.kv_rank={m.kv_rank}) has none: drop model.{key}"
            )


def check_experts(m: LlamaConfig) -> None:
    if m.experts_per_token > m.experts:
        raise ConfigError(
            f"model.experts_per_token={m.experts_per_token} > model.experts={m.experts}: a "
            f"token goes to k of the experts; choose k <= {m.experts}"
        )
    sparse = m.layers - m.dense_first
    if m.dense_first >= m.layers:
        raise ConfigError(
            f"model.dense_first={m.dense_first} with model.layers={m.layers}: the blocks "
            f"after the first dense ones are the mixture's; choose at most {m.layers - 1}"
        )
    if m.moe_every > sparse or sparse % m.moe_every:
        fits = [n for n in range(1, sparse + 1) if sparse % n == 0]
        less = f" less model.dense_first={m.dense_first}" if m.dense_first else ""
        raise ConfigError(
            f"model.moe_every={m.moe_every} with model.layers={m.layers}{less}: every n-th "
            f"block is sparse, in groups of n that fill them; choose n among {fits}"
        )
    check_router(m)
    if m.shared_gate and not m.shared_mlp:
        raise ConfigError(
            "model.shared_gate=true gates a shared expert; model.shared_mlp=0 has none: set "
            "model.shared_mlp (its hidden dims), or drop model.shared_gate"
        )


def check_router(m: LlamaConfig) -> None:
    if m.router_bias_update and m.router is not Router.SIGMOID:
        raise ConfigError(
            f"model.router_bias_update={m.router_bias_update:g} moves a sigmoid router's "
            "balancing bias; model.router=softmax has none: set model.router=sigmoid, or "
            "drop model.router_bias_update"
        )
    g, top, n, k = m.router_groups, m.router_top_groups, m.experts, m.experts_per_token
    if n % g or (g > 1 and n // g < 2):
        fits = [d for d in range(1, n // 2 + 1) if n % d == 0 and n // d >= 2]
        raise ConfigError(
            f"model.router_groups={g} with model.experts={n}: the experts fall in equal "
            f"groups of at least 2 (each group scored by its top two); choose among {fits}"
        )
    if top > g or k > top * (n // g):
        raise ConfigError(
            f"model.router_top_groups={top} of model.router_groups={g} ({n // g} experts "
            f"each) for model.experts_per_token={k}: the chosen groups must hold the k "
            f"experts, at most all {g} groups; choose top_groups with top_groups x {n // g} "
            f">= {k}"
        )


def block_flops(m: LlamaConfig, seq_len: int) -> float:
    """Forward FLOPs of one block per token, the mean block's (model.dense_first and
    model.moe_every's dense ones among them): 2 per matmul parameter (attention's
    projections; the MLP's gate, up and down, or a mixture's router, k experts' and the
    shared expert's: the active FLOPs), plus the attention scores and their product with
    V."""
    return (m.dense_first * _block_flops(m, seq_len, False) + (m.layers - m.dense_first)
            * _block_flops(m, seq_len, bool(m.experts))) / m.layers  # fmt: skip


def mtp_flops(m: LlamaConfig, seq_len: int) -> float:
    """Forward FLOPs per token of the model.mtp_depth prediction modules: each its block
    (a mixture's, where the model has experts), its projection of the embedding and the
    hidden state to one (2 x 2 E^2) and the shared head (2 V E)."""
    block = _block_flops(dataclasses.replace(m, moe_every=1), seq_len, bool(m.experts))
    return m.mtp_depth * (block + 4 * m.embed**2 + 2 * m.vocab * m.embed)


def _flops_per_token(m: LlamaConfig, seq_len: int) -> float:
    return flops_per_token(m, block_flops(m, seq_len)) + 3 * mtp_flops(m, seq_len)


def _block_flops(m: LlamaConfig, seq_len: int, mixture: bool) -> float:
    """block_flops of the stack's blocks (`mixture`: a mixture in every moe_every-th)."""
    h, e, d = m.heads, m.embed, head_size(m)
    if m.kv_rank:  # latent attention: q (through its latent), kv_a, kv_b, o
        qk, v = d + m.rope_dim, m.v_dim or d
        query = e * m.q_rank + m.q_rank * h * qk if m.q_rank else e * h * qk
        attention = query + e * (m.kv_rank + m.rope_dim) + m.kv_rank * h * (d + v) + h * v * e
        scores = 2 * seq_len * h * (qk + v)
    else:
        attention = 2 * e * h * d + 2 * e * m.kv_heads * d
        seen = [min(m.window_of(i) or seq_len, seq_len) for i in range(m.layers)]
        scores = 4 * sum(seen) / m.layers * h * d  # the mean block's keys a query sees
    mlp = 3 * e * m.mlp
    if mixture:  # the mean block's: n - 1 dense, one sparse
        expert = 3 * e * (m.expert_mlp or m.mlp)
        sparse = e * m.experts + m.experts_per_token * expert + 3 * e * m.shared_mlp
        mlp = ((m.moe_every - 1) * mlp + sparse) / m.moe_every
    return 2 * (attention + mlp) + scores


def dims(m: LlamaConfig, seq_len: int) -> ModelDims:
    return ModelDims(
        BlockKind.LLAMA,
        seq_len,
        m.layers,
        m.embed,
        m.mlp,
        m.heads,
        m.kv_heads,
        head_size(m),
        expert_dims(m, seq_len),
    )


def attention_dims(m: LlamaConfig) -> AttentionDims:
    if m.kv_rank:  # q, k and v (padded) of head_dim + rope_dim dims a head
        d = head_size(m) + m.rope_dim
        return AttentionDims(m.layers, m.heads, m.heads, d, latent=m.kv_rank + m.rope_dim)
    windows = tuple(m.window_of(i) for i in range(m.layers)) if m.sliding_window else ()
    return AttentionDims(m.layers, m.heads, m.kv_heads, head_size(m), windows=windows)


def expert_dims(m: LlamaConfig, seq_len: int) -> ExpertDims | None:
    if not m.experts:
        return None
    slots = capacity(seq_len, m.experts, m.experts_per_token, m.capacity_factor)
    return ExpertDims(
        (m.layers - m.dense_first) // m.moe_every,
        m.experts,
        slots,
        m.embed,
        m.experts_per_token,
        6 * m.embed * (m.expert_mlp or m.mlp),
        dropless=m.capacity_factor == 0,
        bias_step=m.router_bias_update,
    )


def cache_dims(m: LlamaConfig) -> CacheDims:
    """The KV cache's dims; latent attention's: one head, the rotated key, the latent;
    each layer's window."""
    if m.kv_rank:
        return CacheDims(m.layers, 1, m.rope_dim, m.kv_rank)
    windows = tuple(m.window_of(i) for i in range(m.layers)) if m.sliding_window else ()
    return CacheDims(m.layers, m.kv_heads, head_size(m), head_size(m), windows)


SPEC = ModelSpec(
    name="llama",
    build=lambda model, seq_len, rngs: Llama(model, seq_len, rngs),
    loss=loss,
    stages=stages,
    flops_per_token=_flops_per_token,
    dims=dims,
    check=check,
    config=LlamaConfig,
    tiny="llama-tiny",
    cache_dims=cache_dims,
    attention_dims=attention_dims,
    expert_dims=expert_dims,
)


def family_check(family: Family):
    """check(), and the family's keys: those it fixes, none of the others' own."""

    def checked(m: LlamaConfig, mesh_shape: dict) -> None:
        check(m, mesh_shape)
        if family.mixture and not m.experts:
            raise ConfigError(
                f"model.name={family.name} is a mixture of experts: set model.experts "
                f"({family.mixture}, with model.experts_per_token)"
            )
        for key, value in family.fixed.items():
            if getattr(m, key) != value:
                raise ConfigError(
                    f"model.name={family.name} has model.{key}={str(value).lower()}; drop "
                    f"model.{key}={str(getattr(m, key)).lower()}"
                )
        for other in FAMILIES:
            for key in (*other.fixed, *other.free):
                if not family.owns(key) and getattr(m, key) != DEFAULTS[key]:
                    raise ConfigError(
                        f"model.{key}={getattr(m, key)} is {other.name}'s, not {family.name}'s; "
                        f"set model.name={other.name}, or drop model.{key}"
                    )

    return checked


def notes(m: LlamaConfig, seq_len: int) -> list[str]:
    """What the start-up summary notes of the model: a window that masks nothing, and
    what model.init's release holds that the model does not read."""
    release = init_notes(FORMATS[m.name], m)
    if m.sliding_window and m.sliding_window >= seq_len:
        return [
            f"model.sliding_window={m.sliding_window} masks nothing at train.seq_len={seq_len}: "
            "every token sees all before it, as without a window",
            *release,
        ]
    return release


# model.name -> its spec: the Llama model as each family reads and writes it
SPECS = {
    family.name: dataclasses.replace(
        SPEC,
        name=family.name,
        check=family_check(family),
        notes=notes,
        tiny=family.tiny,
        hf=FORMATS[family.name],
    )
    for family in FAMILIES
}
SPEC = SPECS["llama"]
