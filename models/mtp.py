"""DeepSeek-V3's multi-token prediction (model.mtp_depth = D modules after the stack):
module k (1..D) takes, at each input position i, the previous depth's hidden state
(the main model's output, normed, for k = 1) and the embedding of token i + k, each
normed, projects the two to one (eh_proj, the embedding first, as the released weights
and vLLM have it), runs a block of its own, norms its output (shared_head.norm) and
predicts token i + k + 1 through the model's head. The embedding and the head are the
model's own. The loss adds model.mtp_weight / D x each module's cross-entropy at every
trained position (a position whose token i + k + 1 exists, is trained, and is in the
same document), over the main loss's count of trained targets: DeepSeek's L_MTP =
lambda / D x sum_k L_k with L_k's 1 / T."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.names import EMBED, QKV
from jaxpar.nn import documents, sequence
from jaxpar.nn.layers import batch_sum, param, scan_layers
from jaxpar.nn.scope import report

from .common import normal

MTP_LOSS = "mtp_loss"  # the metric: the modules' mean cross-entropy, before the weight


class Predictor(nnx.Module):
    """One module: norms of the embedding and the hidden state, their projection
    ([2, embed, embed]: the embedding's part, then the hidden state's), a block (the
    model's, `make_block`), and its output's norm."""

    def __init__(self, cfg, rngs: nnx.Rngs, make_block, make_norm):
        e = cfg.embed
        self.enorm, self.hnorm, self.norm = (make_norm(cfg, rngs) for _ in range(3))
        self.eh_proj = param(rngs, normal(0.02), (2, e, e), (QKV, EMBED, EMBED))
        self.block = make_block(cfg, rngs)

    def __call__(self, h_BxSxE, e_BxSxE, docs):
        """The module's hidden state from the previous one's and the embeddings ahead."""
        return self.block.routed(self._joined(h_BxSxE, e_BxSxE), docs)[0]

    def decode(self, h_BxTxE, e_BxTxE, cache, positions_BxT, slot, pad_B):
        """As __call__, of T new positions through the block's KV cache: (out, cache)."""
        return self.block.decode(self._joined(h_BxTxE, e_BxTxE), cache, positions_BxT, slot, pad_B)

    def _joined(self, h_BxSxE, e_BxSxE):
        dt = h_BxSxE.dtype
        both_Bx2xSxE = jnp.stack([self.enorm(e_BxSxE), self.hnorm(h_BxSxE)], 1)
        return jnp.einsum("btse,tef->bsf", both_Bx2xSxE, self.eh_proj[...].astype(dt))


def mtp_losses(model, x_BxSxE, batch: dict) -> jax.Array:
    """[B, S] model.mtp_weight / D x the D modules' cross-entropies at each input
    position (zero where untrained), reported apart as MTP_LOSS; `x` is the stack's
    output (the main model's hidden state before its final norm)."""
    depth = model.mtp.eh_proj.shape[0]
    tokens = batch["tokens"]
    depths = range(1, depth + 1)
    ahead = lambda k: sequence.local(documents.ahead(tokens, k, 0))  # noqa: E731
    embedded_DxBxSxE = jnp.stack([model._embedded(ahead(k)) for k in depths])
    targets_DxBxS = jnp.stack([ahead(1 + k) for k in depths])
    trained_DxBxS = jnp.stack([documents.trained_ahead(batch, k) for k in depths])
    docs = documents.of_inputs(batch)

    def module(predictor: Predictor, carry):
        h_BxSxE, total_BxS, k = carry
        take = lambda x: jax.lax.dynamic_index_in_dim(x, k, keepdims=False)  # noqa: E731
        h_BxSxE = predictor(h_BxSxE, take(embedded_DxBxSxE), docs)
        logits_BxSxV = model.head_of(predictor.norm(h_BxSxE)).astype(jnp.float32)
        ce_BxS = optax.softmax_cross_entropy_with_integer_labels(logits_BxSxV, take(targets_DxBxS))
        return h_BxSxE, total_BxS + jnp.where(take(trained_DxBxS), ce_BxS, 0.0), k + 1

    start = (model.norm(x_BxSxE), jnp.zeros(x_BxSxE.shape[:2], jnp.float32), jnp.int32(0))
    _, total_BxS, _ = scan_layers(model.mtp, start, module)
    main = documents.target_weights(batch)
    count = jnp.float32(total_BxS.size) if main is None else jnp.sum(main, dtype=jnp.float32)
    report(MTP_LOSS, batch_sum(jnp.sum(total_BxS)) / batch_sum(count) / depth)
    return model.mtp_weight / depth * total_BxS
