"""An MLP classifier of the next byte from the current one: embedding, scanned
residual GeLU blocks, output projection. The smallest model for tests."""

from __future__ import annotations

from flax import nnx

from jaxpar.config.registry import BlockKind, ModelDims, ModelSpec
from jaxpar.config.sections import Model
from jaxpar.names import BATCH, EMBED, SEQ, VOCAB
from jaxpar.nn.layers import constrain, param, scan_layers, stack

from .common import (
    FeedForward,
    LayerNorm,
    embed_tokens,
    flops_per_token,
    language_model_stages,
    next_token_loss,
    normal,
)


class Residual(nnx.Module):
    def __init__(self, cfg: Model, rngs: nnx.Rngs):
        self.ln = LayerNorm(cfg.embed, rngs)
        self.ff = FeedForward(cfg.embed, cfg.mlp, cfg.layers, rngs)

    def __call__(self, x_BxSxE, docs=None):
        del docs  # each position is classified on its own
        return x_BxSxE + self.ff(self.ln(x_BxSxE))


class MLP(nnx.Module):
    def __init__(self, cfg: Model, seq_len: int, rngs: nnx.Rngs):
        del seq_len  # each position is classified on its own
        self.tokens = param(rngs, normal(0.02), (cfg.vocab, cfg.embed), (VOCAB, EMBED))
        self.blocks = stack(lambda r: Residual(cfg, r), cfg.layers, rngs)
        self.head = param(rngs, normal(0.02), (cfg.embed, cfg.vocab), (EMBED, VOCAB))

    def embed(self, tokens_BxS, docs=None):
        del docs
        return embed_tokens(self.tokens, tokens_BxS, self.head.dtype)

    def logits(self, x_BxSxE, docs=None):
        del docs
        return constrain(x_BxSxE @ self.head[...].astype(x_BxSxE.dtype), (BATCH, SEQ, VOCAB))

    def __call__(self, tokens_BxS):
        return self.logits(scan_layers(self.blocks, self.embed(tokens_BxS), Residual.__call__))


SPEC = ModelSpec(
    name="mlp",
    build=lambda model, seq_len, rngs: MLP(model, seq_len, rngs),
    loss=next_token_loss,
    stages=lambda m, seq_len: language_model_stages(m, 4 * m.embed * m.mlp),
    flops_per_token=lambda m, seq_len: flops_per_token(m, 4 * m.embed * m.mlp),
    dims=lambda m, seq_len: ModelDims(BlockKind.MLP, seq_len, m.layers, m.embed, m.mlp),
    tiny="mlp-tiny",
)
