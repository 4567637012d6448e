"""Multi-head latent attention (DeepSeek-V2/V3's MLA), the Llama model's attention where
model.kv_rank > 0.

Keys and values come from one compressed latent per token: x -> [latent (kv_rank),
rotary key (rope_dim)]; the latent normed, then expanded per head to the unrotated key
(head_dim) and the value (v_dim). The rotary key is one head shared by all. Queries:
x -> (a normed latent of q_rank ->) per head [unrotated (head_dim), rotated
(rope_dim)]. Scores over head_dim + rope_dim dims. DeepSeek's checkpoints lay the
rotated dims out in interleaved pairs: they are read into the rotate-half layout (even
dims, then odd) before rotating, as transformers does.

Tensor parallel: the per-head expansions and the output split over `tensor` by head;
the compressing projections and their norms are whole on every tensor device (their
outputs are a few hundred dims a token).

Decoding caches the normed latent and the rotated key alone, kv_rank + rope_dim values
a token and layer, as DeepSeek's inference does: the queries' unrotated part is taken
into the latent's space through each head's key expansion (W_UK absorbed), scored
against the cached latents and rotary keys, and the weighted latents expanded through
each head's value expansion (W_UV) afterwards.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.names import BATCH, EMBED, HEAD_DIM, HEADS, LATENT, SEQ, SEQ_RESIDUAL
from jaxpar.nn import logits, sequence
from jaxpar.nn.attention import cached_latent_attention, causal_attention
from jaxpar.nn.documents import Documents
from jaxpar.nn.layers import constrain, dense, param

from . import LlamaConfig
from .common import normal, rotate

# the latents' norms' epsilon: DeepSeek's own (not model.norm_eps: transformers builds
# them with its RMSNorm's default)
LATENT_EPS = 1e-6


def interleaved(d: int) -> np.ndarray:
    """The order that reads interleaved pairs (x0, x1), (x2, x3), ... as rotate-half's
    halves: the even dims, then the odd."""
    return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


class LatentAttention(nnx.Module):
    def __init__(
        self,
        cfg: LlamaConfig,
        rngs: nnx.Rngs,
        norm,
        frequencies: np.ndarray,
        rope_scale: float = 1.0,
        softmax_factor: float = 1.0,
    ):
        """`rope_scale`, `softmax_factor`: YaRN's attention factor on the rotated q and k,
        and DeepSeek's factor on the softmax scale (models/llama.py)."""
        e, h, r, dr = cfg.embed, cfg.heads, cfg.kv_rank, cfg.rope_dim
        dn, dv, qr = cfg.head_dim, cfg.v_dim or cfg.head_dim, cfg.q_rank
        if qr:
            self.wq_a = param(rngs, normal(0.02), (e, qr), (EMBED, LATENT))
            self.q_norm = norm(qr, LATENT_EPS, rngs, (LATENT,))
            self.wq_b = param(rngs, normal(0.02), (qr, h, dn + dr), (LATENT, HEADS, HEAD_DIM))
        else:
            self.wq = param(rngs, normal(0.02), (e, h, dn + dr), (EMBED, HEADS, HEAD_DIM))
        self.wkv_a = param(rngs, normal(0.02), (e, r + dr), (EMBED, LATENT))
        self.kv_norm = norm(r, LATENT_EPS, rngs, (LATENT,))
        self.wkv_b = param(rngs, normal(0.02), (r, h, dn + dv), (LATENT, HEADS, HEAD_DIM))
        out_std = 0.02 / (2 * cfg.layers) ** 0.5
        self.wo = param(rngs, normal(out_std), (h, dv, e), (HEADS, HEAD_DIM, EMBED))
        self.inv_freq = tuple(float(f) for f in frequencies)
        self.rope_scale = rope_scale
        self.scale = (dn + dr) ** -0.5 * softmax_factor
        self.dims = (r, dn, dr, dv)

    def _queries(self, x_BxSxE):
        """[B, S, H, head_dim + rope_dim] (the rotated part not yet rotated)."""
        dt = x_BxSxE.dtype
        if hasattr(self, "wq"):
            return dense(
                "bse,ehd->bshd", x_BxSxE, self.wq[...].astype(dt), (EMBED, HEADS, HEAD_DIM)
            )
        latent_BxSxQ = self.q_norm(jnp.einsum("bse,eq->bsq", x_BxSxE, self.wq_a[...].astype(dt)))
        w_QxHxD = self.wq_b[...].astype(dt)
        return dense("bsq,qhd->bshd", latent_BxSxQ, w_QxHxD, (LATENT, HEADS, HEAD_DIM))

    def _latent(self, x_BxSxE, positions_BxS):
        """(the normed latent [B, S, kv_rank], the rotated key [B, S, 1, rope_dim])."""
        r = self.dims[0]
        c_BxSxL = jnp.einsum("bse,el->bsl", x_BxSxE, self.wkv_a[...].astype(x_BxSxE.dtype))
        k_rope_BxSx1xR = self._rotated(c_BxSxL[:, :, None, r:], positions_BxS)
        return self.kv_norm(c_BxSxL[..., :r]), k_rope_BxSx1xR

    def _rotated(self, x_BxSxNxR, positions_BxS):
        order = interleaved(x_BxSxNxR.shape[-1])
        inv_freq = np.asarray(self.inv_freq, np.float32)
        return rotate(x_BxSxNxR[..., order], inv_freq, positions_BxS, self.rope_scale)

    def __call__(self, x_BxSxE, docs: Documents | None = None):
        dt = x_BxSxE.dtype
        r, dn, dr, dv = self.dims
        positions_BxS = None if docs is None else docs.positions
        segments_BxS = None if docs is None else docs.segment_ids
        q_BxSxHxD = self._queries(x_BxSxE)
        q_BxSxHxD = jnp.concatenate(
            [q_BxSxHxD[..., :dn], self._rotated(q_BxSxHxD[..., dn:], positions_BxS)], -1
        )
        c_BxSxL, k_rope_BxSx1xR = self._latent(x_BxSxE, positions_BxS)
        # sequences split over context: the latent and the rotated key are gathered
        # (kv_rank + rope_dim a token), not the keys and values they expand to
        whole = [sequence.gathered(x) for x in (c_BxSxL, k_rope_BxSx1xR)]
        if whole[0] is not None:
            c_BxSxL, k_rope_BxSx1xR = whole
        w_LxHxD = self.wkv_b[...].astype(dt)
        kv_BxSxHxD = dense("bsl,lhd->bshd", c_BxSxL, w_LxHxD, (LATENT, HEADS, HEAD_DIM))
        heads = q_BxSxHxD.shape[2]
        k_rope_BxSxHxR = jnp.broadcast_to(k_rope_BxSx1xR, (*k_rope_BxSx1xR.shape[:2], heads, dr))
        k_BxSxHxD = jnp.concatenate([kv_BxSxHxD[..., :dn], k_rope_BxSxHxR], -1)
        # values padded to the keys' dims for the attention program, and cut after it
        v_BxSxHxD = kv_BxSxHxD[..., dn:]
        pad = [(0, 0)] * 3 + [(0, dn + dr - dv)]
        names = (BATCH, SEQ, HEADS, HEAD_DIM)
        q_BxSxHxD, k_BxSxHxD = (constrain(x, names) for x in (q_BxSxHxD, k_BxSxHxD))
        v_BxSxHxD = constrain(jnp.pad(v_BxSxHxD, pad) if dv < dn + dr else v_BxSxHxD, names)
        watched = logits.wanted()
        out = causal_attention(
            q_BxSxHxD,
            k_BxSxHxD,
            v_BxSxHxD,
            segments_BxS,
            positions_BxS=positions_BxS,
            gathered=whole[0] is not None,
            scale=self.scale,
            logit_max=watched,
        )
        out_BxSxHxD = out[0] if watched else out
        if watched:
            logits.seen(out[1], *self._scaling())
        out_BxSxHxV = constrain(out_BxSxHxD[..., :dv], names)
        y_BxSxE = dense(
            "bshv,hve->bse", out_BxSxHxV, self.wo[...].astype(dt), (HEADS, HEAD_DIM, EMBED)
        )
        return constrain(y_BxSxE, (BATCH, SEQ_RESIDUAL, EMBED))

    def _scaling(self) -> list[tuple]:
        """The weights that scale a head's logits, by part (Kimi K2's QK-clip for latent
        attention): its query's and key's unrotated dims each by the square root, its
        query's rotated dims by the whole factor, the rotated key (shared by the heads)
        not at all."""
        _, dn, dr, _ = self.dims
        q = self.wq if hasattr(self, "wq") else self.wq_b
        return [(q, 0.5, None, (0, dn)), (q, 1.0, None, (dn, dn + dr)),
                (self.wkv_b, 0.5, None, (0, dn))]  # fmt: skip

    def decode(self, x_BxTxE, positions_BxT, cache, slot, pad_B):
        """The attention of T new tokens through the latent cache (the module's
        docstring): cache (rotated keys [B, 1, rope_dim, M], latents [B, 1, M, kv_rank])."""
        dt = x_BxTxE.dtype
        r, dn, dr, dv = self.dims
        q_BxTxHxD = self._queries(x_BxTxE)
        q_rope_BxTxHxR = self._rotated(q_BxTxHxD[..., dn:], positions_BxT)
        c_BxTxL, k_rope_BxTx1xR = self._latent(x_BxTxE, positions_BxT)
        w_LxHxD = self.wkv_b[...].astype(dt)
        # the unrotated queries in the latent's space: q_nope . W_UK per head
        q_lat_BxTxHxL = jnp.einsum("bthd,lhd->bthl", q_BxTxHxD[..., :dn], w_LxHxD[..., :dn])
        out_BxTxHxL, cache = cached_latent_attention(
            q_lat_BxTxHxL, q_rope_BxTxHxR, c_BxTxL, k_rope_BxTx1xR[:, :, 0], cache, slot, pad_B,
            scale=self.scale,
        )  # fmt: skip
        out_BxTxHxV = jnp.einsum("bthl,lhv->bthv", out_BxTxHxL, w_LxHxD[..., dn:])
        b, t, h, _ = out_BxTxHxV.shape
        wo_HVxE = self.wo[...].astype(dt).reshape(h * dv, -1)
        return out_BxTxHxV.reshape(b, t, h * dv) @ wo_HVxE, cache
