"""An MLP classifier of the next byte from the current one: embedding, scanned
residual GeLU blocks, output projection. The smallest model for tests."""

from __future__ import annotations

from flax import nnx

from jaxpar.config import Model
from jaxpar.layers import constrain, param, scan_layers, stack
from jaxpar.sharding import BATCH, EMBED, SEQ, VOCAB
from models.common import FeedForward, LayerNorm, apply_layer, embed_tokens, normal


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

    def embed(self, tokens_BxS):
        return embed_tokens(self.tokens, tokens_BxS, self.head.dtype)

    def logits(self, x_BxSxE):
        return constrain(x_BxSxE @ self.head[...].astype(x_BxSxE.dtype), (BATCH, SEQ, VOCAB))

    def __call__(self, tokens_BxS):
        return self.logits(scan_layers(self.blocks, self.embed(tokens_BxS), apply_layer))
