"""An MLP classifier of the next byte from the current one: embedding, scanned
residual GeLU blocks, output projection. The smallest model for tests."""

from __future__ import annotations

from flax import nnx

from jaxpar.config import Model
from jaxpar.layers import constrain, param, scan_layers
from jaxpar.sharding import BATCH, EMBED, SEQ, VOCAB
from models.common import FeedForward, LayerNorm, embed_tokens, normal, stack


class Residual(nnx.Module):
    def __init__(self, cfg: Model, rngs: nnx.Rngs):
        self.ln = LayerNorm(cfg.embed, rngs)
        self.ff = FeedForward(cfg.embed, cfg.mlp, cfg.layers, rngs)

    def __call__(self, x_BxSxE):
        return x_BxSxE + self.ff(self.ln(x_BxSxE))


class MLP(nnx.Module):
    def __init__(self, cfg: Model, seq_len: int, rngs: nnx.Rngs):
        del seq_len  # each position is classified on its own
        self.tokens = param(rngs, normal(0.02), (cfg.vocab, cfg.embed), (VOCAB, EMBED))
        self.blocks = stack(lambda r: Residual(cfg, r), cfg.layers, rngs)
        self.head = param(rngs, normal(0.02), (cfg.embed, cfg.vocab), (EMBED, VOCAB))

    def __call__(self, tokens_BxS):
        dt = self.head.dtype
        x_BxSxE = embed_tokens(self.tokens, tokens_BxS, dt)
        x_BxSxE = scan_layers(self.blocks, x_BxSxE, lambda block, x: block(x))
        return constrain(x_BxSxE @ self.head[...].astype(dt), (BATCH, SEQ, VOCAB))
