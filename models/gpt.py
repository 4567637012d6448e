"""Decoder-only transformer: token + position embedding, pre-LN blocks (causal
multi-head attention, GeLU MLP), final LN, output projection. Layers are stacked
and scanned, so compile time does not grow with depth."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxpar.config.registry import AttentionDims, BlockKind, ModelDims, ModelSpec
from jaxpar.config.sections import Model
from jaxpar.errors import ConfigError
from jaxpar.names import BATCH, EMBED, HEAD_DIM, HEADS, POSITION, QKV, SEQ, SEQ_RESIDUAL, VOCAB
from jaxpar.nn import logits
from jaxpar.nn.attention import causal_attention
from jaxpar.nn.documents import Documents
from jaxpar.nn.layers import constrain, dense, param, scan_layers, stack

from .common import (
    FeedForward,
    LayerNorm,
    embed_tokens,
    flops_per_token,
    language_model_stages,
    next_token_loss,
    normal,
)


class Attention(nnx.Module):
    """Q, K, V column-split over heads; the output projection row-split over heads."""

    def __init__(self, embed: int, heads: int, layers: int, rngs: nnx.Rngs):
        head_dim = embed // heads
        # One fused projection: its input gradient is one partial sum, so one all-reduce.
        self.wqkv = param(
            rngs, normal(0.02), (embed, 3, heads, head_dim), (EMBED, QKV, HEADS, HEAD_DIM)
        )
        self.wo = param(
            rngs,
            normal(0.02 / (2 * layers) ** 0.5),
            (heads, head_dim, embed),
            (HEADS, HEAD_DIM, EMBED),
        )

    def __call__(self, x_BxSxE, docs: Documents | None = None):
        dt = x_BxSxE.dtype
        qkv_BxSx3xHxD = constrain(
            dense(
                "bse,ethd->bsthd", x_BxSxE, self.wqkv[...].astype(dt), (EMBED, QKV, HEADS, HEAD_DIM)
            ),
            (BATCH, SEQ, QKV, HEADS, HEAD_DIM),
        )
        q_BxSxHxD, k_BxSxHxD, v_BxSxHxD = (qkv_BxSx3xHxD[:, :, i] for i in range(3))
        watched = logits.wanted()
        out = causal_attention(
            q_BxSxHxD,
            k_BxSxHxD,
            v_BxSxHxD,
            None if docs is None else docs.segment_ids,
            positions_BxS=None if docs is None else docs.positions,
            logit_max=watched,
        )
        out_BxSxHxD = out[0] if watched else out
        if watched:  # QK-clip: q and k, parts 0 and 1 of the fused weight, alike
            logits.seen(out[1], (self.wqkv, 0.5, 0), (self.wqkv, 0.5, 1))
        out_BxSxHxD = constrain(out_BxSxHxD, (BATCH, SEQ, HEADS, HEAD_DIM))
        y_BxSxE = dense(
            "bshd,hde->bse", out_BxSxHxD, self.wo[...].astype(dt), (HEADS, HEAD_DIM, EMBED)
        )
        return constrain(y_BxSxE, (BATCH, SEQ_RESIDUAL, EMBED))


class Block(nnx.Module):
    def __init__(self, cfg: Model, rngs: nnx.Rngs):
        self.ln1 = LayerNorm(cfg.embed, rngs)
        self.attn = Attention(cfg.embed, cfg.heads, cfg.layers, rngs)
        self.ln2 = LayerNorm(cfg.embed, rngs)
        self.mlp = FeedForward(cfg.embed, cfg.mlp, cfg.layers, rngs)

    def __call__(self, x_BxSxE, docs: Documents | None = None):
        x_BxSxE = x_BxSxE + self.attn(self.ln1(x_BxSxE), docs)
        return x_BxSxE + self.mlp(self.ln2(x_BxSxE))


class GPT(nnx.Module):
    def __init__(self, cfg: Model, seq_len: int, rngs: nnx.Rngs):
        self.tokens = param(rngs, normal(0.02), (cfg.vocab, cfg.embed), (VOCAB, EMBED))
        self.positions = param(rngs, normal(0.01), (seq_len, cfg.embed), (POSITION, EMBED))
        self.blocks = stack(lambda r: Block(cfg, r), cfg.layers, rngs)
        self.ln_f = LayerNorm(cfg.embed, rngs)
        self.head = param(rngs, normal(0.02), (cfg.embed, cfg.vocab), (EMBED, VOCAB))

    def embed(self, tokens_BxS, docs: Documents | None = None):
        """Token plus position embeddings: positions 0..S-1, or each document's own."""
        dt = self.head.dtype
        x_BxSxE = embed_tokens(self.tokens, tokens_BxS, dt)
        table_SxE = self.positions[...].astype(dt)
        if docs is None:
            return x_BxSxE + table_SxE[None, : tokens_BxS.shape[1]]
        return x_BxSxE + jnp.take(table_SxE, docs.positions, axis=0)

    def features(self, x_BxSxE, docs=None):
        """The stack's output through the final norm (what the head reads)."""
        del docs  # no blocks after the stack
        return self.ln_f(x_BxSxE)

    def logits(self, x_BxSxE, docs=None):
        x_BxSxE = self.features(x_BxSxE, docs)
        logits_BxSxV = dense(
            "bse,ev->bsv", x_BxSxE, self.head[...].astype(x_BxSxE.dtype), (EMBED, VOCAB)
        )
        return constrain(logits_BxSxV, (BATCH, SEQ, VOCAB))

    def __call__(self, tokens_BxS):
        x_BxSxE = scan_layers(self.blocks, self.embed(tokens_BxS), Block.__call__)
        return self.logits(x_BxSxE)


def check(model: Model, mesh_shape: dict) -> None:
    if model.embed % model.heads:
        raise ConfigError(
            f"model.embed={model.embed} is not divisible by model.heads="
            f"{model.heads}; each head needs embed/heads dims"
        )


def block_flops(m: Model, seq_len: int) -> float:
    """Forward FLOPs of one block per token: 2 per matmul parameter (q/k/v, o, the MLP),
    plus the attention scores and their product with V, 4 S E."""
    return 2 * (4 * m.embed**2 + 2 * m.embed * m.mlp) + 4 * seq_len * m.embed


SPEC = ModelSpec(
    name="gpt",
    build=lambda model, seq_len, rngs: GPT(model, seq_len, rngs),
    loss=next_token_loss,
    stages=lambda m, seq_len: language_model_stages(m, block_flops(m, seq_len)),
    flops_per_token=lambda m, seq_len: flops_per_token(m, block_flops(m, seq_len)),
    dims=lambda m, seq_len: ModelDims(
        BlockKind.GPT, seq_len, m.layers, m.embed, m.mlp, m.heads, m.heads, m.embed // m.heads
    ),
    check=check,
    tiny="gpt-tiny",
    attention_dims=lambda m: AttentionDims(m.layers, m.heads, m.heads, m.embed // m.heads),
)
