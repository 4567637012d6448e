"""Building blocks shared by the models. Parameters carry logical names only."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpar.config.sections import Model
from jaxpar.names import BATCH, EMBED, MLP, SEQ, SEQ_RESIDUAL, VOCAB
from jaxpar.nn import documents
from jaxpar.nn.layers import constrain, dense, param, scan_layers
from jaxpar.nn.problem import Stages


def normal(std: float):
    return nnx.initializers.normal(std)


@dataclass(frozen=True)
class Gated:
    """A gated MLP's hidden act(gate) x up, by model.activation: silu (SwiGLU),
    gelu_tanh (GeGLU) or clamped_swiglu (GPT-OSS's: the gate clamped from above at
    `limit`, up within +-limit, gate x sigmoid(alpha gate) x (up + 1))."""

    activation: str
    alpha: float = 1.702
    limit: float = 7.0

    @staticmethod
    def of(cfg) -> Gated:
        return Gated(str(cfg.activation), cfg.swiglu_alpha, cfg.swiglu_limit)

    def __call__(self, gate, up):
        if self.activation == "gelu_tanh":
            return jax.nn.gelu(gate, approximate=True) * up
        if self.activation == "clamped_swiglu":
            gate, up = jnp.minimum(gate, self.limit), jnp.clip(up, -self.limit, self.limit)
            return gate * jax.nn.sigmoid(gate * self.alpha) * (up + 1)
        return jax.nn.silu(gate) * up


class LayerNorm(nnx.Module):
    def __init__(self, embed: int, rngs: nnx.Rngs):
        self.scale = param(rngs, nnx.initializers.ones, (embed,), (EMBED,))
        self.bias = param(rngs, nnx.initializers.zeros, (embed,), (EMBED,))

    def __call__(self, x_BxSxE):
        x = x_BxSxE.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + 1e-5)
        return (y * along_last(self.scale, y) + along_last(self.bias, y)).astype(x_BxSxE.dtype)


class FeedForward(nnx.Module):
    """GeLU(x A + a) B + b: A column-split, B row-split over `mlp`, no communication between."""

    def __init__(self, embed: int, hidden: int, layers: int, rngs: nnx.Rngs):
        self.w_in = param(rngs, normal(0.02), (embed, hidden), (EMBED, MLP))
        self.b_in = param(rngs, nnx.initializers.zeros, (hidden,), (MLP,))
        self.w_out = param(rngs, normal(0.02 / (2 * layers) ** 0.5), (hidden, embed), (MLP, EMBED))
        self.b_out = param(rngs, nnx.initializers.zeros, (embed,), (EMBED,))

    def __call__(self, x_BxSxE):
        dt = x_BxSxE.dtype
        h_BxSxM = dense("bse,em->bsm", x_BxSxE, self.w_in[...].astype(dt), (EMBED, MLP))
        h_BxSxM = jax.nn.gelu(h_BxSxM + along_last(self.b_in, h_BxSxM))
        h_BxSxM = constrain(h_BxSxM, (BATCH, SEQ, MLP))
        y_BxSxE = dense("bsm,me->bse", h_BxSxM, self.w_out[...].astype(dt), (MLP, EMBED))
        y_BxSxE = y_BxSxE + along_last(self.b_out, y_BxSxE)
        return constrain(y_BxSxE, (BATCH, SEQ_RESIDUAL, EMBED))


def along_last(vector: nnx.Param, like: jax.Array) -> jax.Array:
    """A [dim] parameter shaped to broadcast over `like`'s last dim, in its dtype."""
    return vector[...].astype(like.dtype).reshape((1,) * (like.ndim - 1) + (-1,))


def embed_tokens(table_VxE: nnx.Param, tokens_BxS: jax.Array, dtype) -> jax.Array:
    """Token lookup as one-hot @ table: with the table split over vocab this is Megatron's
    vocab-parallel embedding (each shard looks up its rows, one all-reduce sums them)."""
    vocab = table_VxE.shape[0]
    onehot_BxSxV = jax.nn.one_hot(tokens_BxS, vocab, dtype=dtype)
    x_BxSxE = dense("bsv,ve->bse", onehot_BxSxV, table_VxE[...].astype(dtype), (VOCAB, EMBED))
    return constrain(x_BxSxE, (BATCH, SEQ_RESIDUAL, EMBED))


def apply_layer(layer: nnx.Module, x_BxSxE: jax.Array, batch: dict) -> jax.Array:
    """One layer of a stack on the inputs of `batch`, given their documents."""
    return layer(x_BxSxE, documents.of_inputs(batch))


def embed_inputs(model: nnx.Module, batch: dict) -> jnp.ndarray:
    """The pipeline's first piece: tokens[:, :-1] -> residual stream."""
    return model.embed(documents.inputs(batch), documents.of_inputs(batch))


def token_losses(model: nnx.Module, x_BxSxE: jnp.ndarray, batch: dict) -> jnp.ndarray:
    """The pipeline's last piece: per-token cross-entropy of predicting tokens[:, 1:],
    zero where the target is not trained (jaxpar.nn.documents). `model.logits` gets the
    documents too, for any blocks it runs after the stack."""
    logits_BxSxV = model.logits(x_BxSxE, documents.of_inputs(batch)).astype(jnp.float32)
    losses_BxS = optax.softmax_cross_entropy_with_integer_labels(
        logits_BxSxV, documents.targets(batch)
    )
    return documents.masked(losses_BxS, batch)


def next_token_loss(model: nnx.Module, batch: dict) -> jnp.ndarray:
    """Per-token cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1], each
    document of a row on its own."""
    x_BxSxE = scan_layers(
        model.blocks, embed_inputs(model, batch), lambda layer, x: apply_layer(layer, x, batch)
    )
    return token_losses(model, x_BxSxE, batch)


def flops_per_token(model: Model, block_flops: float) -> float:
    """Forward and backward FLOPs per token, 3x the forward: `block_flops` per block, and
    the embedding and the head as matmuls (2 V E each)."""
    return 3 * (model.layers * block_flops + 2 * 2 * model.vocab * model.embed)


def language_model_stages(model: Model, block_flops: float) -> Stages:
    """A model with `embed`, `blocks` and `logits` cut into pipeline stages, with forward
    FLOPs per token of the embedding, one block and the output head (for balancing)."""
    head = 2 * model.vocab * model.embed
    return Stages(
        pre=embed_inputs,
        stack="blocks",
        layer=apply_layer,
        post=token_losses,
        costs=(head, block_flops, head),
    )


def rotate(
    x_BxSxNxD: jax.Array, inv_freq: np.ndarray, positions_BxS=None, scale: float = 1.0
) -> jax.Array:
    """Rotary embedding of `positions` (default 0..S-1, as constants), rotate-half layout:
    the first half of each head's dims pairs with the second (Meta's original
    checkpoints pair neighbours). The angles in fp32, as transformers computes them; cos
    and sin times `scale` (YaRN's attention factor) before they meet x."""
    if positions_BxS is None:
        seq = x_BxSxNxD.shape[1]
        angles = np.concatenate([np.outer(np.arange(seq, dtype=np.float32), inv_freq)] * 2, -1)
        cos, sin = (
            jnp.asarray(f(angles) * np.float32(scale), x_BxSxNxD.dtype)[None, :, None]
            for f in (np.cos, np.sin)
        )
    else:
        half_BxSxD = (
            positions_BxS.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None]
        )
        angles_BxSxD = jnp.concatenate([half_BxSxD, half_BxSxD], -1)
        cos, sin = (
            (f(angles_BxSxD) * np.float32(scale)).astype(x_BxSxNxD.dtype)[:, :, None]
            for f in (jnp.cos, jnp.sin)
        )
    half = x_BxSxNxD.shape[-1] // 2
    rotated = jnp.concatenate([-x_BxSxNxD[..., half:], x_BxSxNxD[..., :half]], -1)
    return x_BxSxNxD * cos + rotated * sin
