"""Models shipped with jaxpar, by `model.name`, and their loss."""

from __future__ import annotations

import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.config import Model
from models.gpt import GPT
from models.mlp import MLP

MODELS = {"gpt": GPT, "mlp": MLP}


def build(cfg: Model, seq_len: int, rngs: nnx.Rngs) -> nnx.Module:
    return MODELS[cfg.name](cfg, seq_len, rngs)


def next_token_loss(model: nnx.Module, batch: dict) -> jnp.ndarray:
    """Per-token cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1]."""
    tokens_BxT = batch["tokens"]
    logits_BxSxV = model(tokens_BxT[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxSxV, tokens_BxT[:, 1:])


# Megatron all-reduces of a [batch, seq, embed] activation over `tensor`, per micro-batch:
# each block's row-split outputs in forward and column-split inputs in backward, plus the
# vocab-split embedding (forward) and output projection (backward).
TENSOR_ALLREDUCES = {
    "gpt": lambda layers: 4 * layers + 2,  # attention + MLP, 2 each way
    "mlp": lambda layers: 2 * layers + 2,  # one feed-forward, 1 each way
}


def tensor_allreduce_elements(cfg: Model, rows: int, seq_len: int) -> int:
    """Elements all-reduced over `tensor` for one micro-batch of `rows` sequences."""
    return TENSOR_ALLREDUCES[cfg.name](cfg.layers) * rows * seq_len * cfg.embed
