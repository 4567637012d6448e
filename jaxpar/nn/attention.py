"""Causal attention, in the form the step's platform runs best, for models to call.

`causal_attention(q, k, v, segment_ids)` computes softmax(q k^T / sqrt(head_dim) + mask)
v with the scores in fp32, the mask causal and, given the tokens' segment ids (packed
documents, jaxpar.nn.documents), closed between segments; optionally another scale of
the scores, a soft cap on them, cap x tanh(score / cap) (Gemma 2), and a learned sink
logit per head in the softmax's denominator, which no key's value answers (GPT-OSS's
attention sinks: the heads may attend to nothing). Which program
computes it follows the platform the step is built for (the running
`jaxpar.nn.scope.Context`; outside a step, the default backend):

- `cudnn`: on CUDA in bf16/fp16 with a head dim cuDNN takes (a multiple of 8, at most
  128), no soft cap and no sinks (the kernel that jax reaches has neither; those scores
  take the blocked form): `jax.nn.dot_product_attention`'s cuDNN flash-attention
  kernel, which never stores the [B, H, S, S] scores, forward or backward. Segment ids
  reach the kernel as its mask (a [B, 1, S, S] additive bias, one per row, shared by
  the heads: what jax's public cuDNN entry passes on; the kernel's packed-sequence form
  is private in jax).
- `blocked`: on any other accelerator, or fp32 on CUDA: the queries in blocks of at
  most `BLOCK` rows (the largest such divisor of S), each block's [B, H, BLOCK, S]
  scores recomputed in the backward pass instead of kept: no [S, S] buffer either.
- `direct`: on CPU, the [B, H, S, S] scores computed and kept for the backward pass,
  the fastest of the forms measured on XLA:CPU (docs/benchmarks.md, "Speed against PyTorch").

`stores_scores(platform, dtype, head_dim)` says whether the form in use keeps the
scores, for the planner's activation count (Korthikanti's 5 a s^2 b term).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpar.names import BATCH, HEAD_DIM, KV_HEADS, SEQ
from jaxpar.nn import scope, sequence
from jaxpar.parallel import context

BLOCK = 512  # query rows per block of the blocked form
# one layer's KV cache (cached_attention): keys [B, K, D, M] and values [B, K, M, D] (K
# key/value heads, M slots), each the right-hand side of its product in attention as
# XLA's dot reads it, [batch..., contracted, kept], with no transpose of the cache
CACHE_NAMES = ((BATCH, KV_HEADS, HEAD_DIM, SEQ), (BATCH, KV_HEADS, SEQ, HEAD_DIM))
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


class Form(enum.Enum):
    CUDNN = "cudnn"
    BLOCKED = "blocked"
    DIRECT = "direct"


def form(platform: str, dtype, head_dim: int, softcap: float = 0.0, sinks: bool = False) -> Form:
    """The attention program for this platform ('cpu', 'cuda', 'rocm', 'tpu'), compute
    dtype, head dim, soft cap and sinks (cuDNN's kernel takes neither)."""
    if platform == "cpu":
        return Form.DIRECT
    plain = not softcap and not sinks
    cudnn_ready = head_dim % 8 == 0 and head_dim <= 128 and plain
    if platform == "cuda" and jnp.dtype(dtype) in map(jnp.dtype, CUDNN_DTYPES) and cudnn_ready:
        return Form.CUDNN
    return Form.BLOCKED


def stores_scores(platform: str, dtype, head_dim: int) -> bool:
    return form(platform, dtype, head_dim) is Form.DIRECT


def causal_attention(
    q_BxSxHxD,
    k_BxSxHxD,
    v_BxSxHxD,
    segment_ids_BxS=None,
    window: int = 0,
    *,
    positions_BxS=None,
    kv_group: int = 1,
    gathered: bool = False,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks_H=None,
    logit_max: bool = False,
):
    """softmax(cap(q k^T x scale) + mask) v, [B, S, H, D] in and out: each query sees the
    keys at or before it, of its own segment where segment ids are given, and (a sliding
    `window`) fewer than `window` positions back. `scale` defaults to head_dim^-0.5;
    `softcap` > 0 caps the scores at +-softcap by tanh; `sinks_H`, each head's sink
    logit, joins the softmax's denominator (Scores.sinks). `logit_max`: (the output,
    each head's largest visible q k^T x scale [H], before the cap), from the scores the
    form computes anyway (direct and blocked), or beside cuDNN's kernel by a pass of the
    scores alone (largest_by_blocks); under context parallelism, over this
    device's queries at least (the step takes the maximum over `context`).

    In a step that splits sequences over `context` (jaxpar.parallel.context), the tokens may be
    reordered: "before" is then by `positions_BxS` (each token's position in its
    segment; default, its original position in the row), and k and v, repeated to one
    head per query head, are gathered as their distinct heads (`kv_group` query heads a
    key/value head); or (`gathered`) they are the whole rows already, in the step's
    token order (jaxpar.nn.sequence.gathered: what a model gathers smaller than its keys,
    latent attention's latent)."""
    ctx = scope.current()
    platform = ctx.platform if ctx else scope.platform_of(jax.devices()[0])
    sinks = sinks_H is not None
    chosen = form(platform, q_BxSxHxD.dtype, q_BxSxHxD.shape[-1], softcap, sinks)
    scale = q_BxSxHxD.shape[-1] ** -0.5 if scale is None else scale
    scores = Scores(scale, softcap, sinks, logit_max)
    if sinks:
        q_BxSxHxD = _with_sinks(q_BxSxHxD, sinks_H)
    if sequence.active() is not None:
        if positions_BxS is None:
            rows, part = q_BxSxHxD.shape[:2]
            positions_BxS = sequence.positions(rows, part * sequence.active().degree)

        def attend(q, k, v, q_pos, k_pos, q_seg, k_seg):
            return _positioned(chosen, q, k, v, q_pos, k_pos, q_seg, k_seg, window, scores)

        return context.attention(
            sequence.active(),
            q_BxSxHxD,
            k_BxSxHxD,
            v_BxSxHxD,
            segment_ids_BxS,
            positions_BxS,
            window,
            kv_group,
            attend,
            gathered,
            logit_max,
        )
    if chosen is Form.CUDNN:
        return _cudnn(q_BxSxHxD, k_BxSxHxD, v_BxSxHxD, segment_ids_BxS, window, scores)
    if chosen is Form.BLOCKED:
        return _blocked(q_BxSxHxD, k_BxSxHxD, v_BxSxHxD, segment_ids_BxS, window, scores)
    return _direct(q_BxSxHxD, k_BxSxHxD, v_BxSxHxD, 0, segment_ids_BxS, window, scores)


def _cudnn(q_BxSxHxD, k_BxSxHxD, v_BxSxHxD, segment_ids_BxS, window: int, scores: Scores):
    """cuDNN's fused kernel, causal, within the window and the segments; with
    scores.maxima, (that, each head's largest visible score [H]: largest_by_blocks, as
    the kernel hands on none)."""
    out_BxSxHxD = jax.nn.dot_product_attention(
        q_BxSxHxD,
        k_BxSxHxD,
        v_BxSxHxD,
        mask=None if segment_ids_BxS is None else same_segment(segment_ids_BxS)[:, None],
        is_causal=True,
        local_window_size=(window - 1, 0) if window else None,
        scale=scores.scale,
        implementation="cudnn",
    )
    if not scores.maxima:
        return out_BxSxHxD
    rows, seq = q_BxSxHxD.shape[:2]
    pos_BxS = jnp.broadcast_to(jnp.arange(seq), (rows, seq))
    at = (pos_BxS, pos_BxS, segment_ids_BxS, segment_ids_BxS, window)
    return out_BxSxHxD, largest_by_blocks(q_BxSxHxD, k_BxSxHxD, *at, scores.scale)


def same_segment(segment_ids_BxS, first=0, rows=None) -> jax.Array:
    """[B, C, S] bool: whether query first + c and key t are in the same segment."""
    rows = segment_ids_BxS.shape[1] if rows is None else rows
    queries_BxC = jax.lax.dynamic_slice_in_dim(segment_ids_BxS, first, rows, axis=1)
    return queries_BxC[:, :, None] == segment_ids_BxS[:, None, :]


@dataclass(frozen=True)
class Scores:
    """How q . k becomes a score: times `scale`, then capped at +-softcap (0: not); with
    `sinks`, each query carries its head's sink logit as its last dim (_with_sinks: so
    that it travels with q through every form, and through context parallelism's
    gathers and all-to-alls of q's heads)."""

    scale: float
    softcap: float = 0.0
    sinks: bool = False
    maxima: bool = False  # _scored also returns each head's largest visible score

    def largest(self, att_BxHxCxS, visible_BxCxS):
        """[H] the largest visible score of each head (before the cap)."""
        hidden = jnp.finfo(jnp.float32).min
        att_BxHxCxS = jnp.where(visible_BxCxS[:, None], att_BxHxCxS, hidden)
        return jax.lax.stop_gradient(jnp.max(att_BxHxCxS, axis=(0, 2, 3)))

    def capped(self, att):
        return att if not self.softcap else self.softcap * jnp.tanh(att / self.softcap)

    def split(self, q_BxCxHxD):
        """(q, each query's sink logit [B, C, H] or None)."""
        if not self.sinks:
            return q_BxCxHxD, None
        return q_BxCxHxD[..., :-1], q_BxCxHxD[..., -1].astype(jnp.float32)

    @staticmethod
    def softmax(att, sink=None):
        """softmax over the last axis; a `sink` logit (one a row) joins its denominator,
        as transformers' GPT-OSS appends it as a column and drops its probability."""
        if sink is None:
            return jax.nn.softmax(att, axis=-1)
        top = jax.lax.stop_gradient(jnp.maximum(jnp.max(att, -1), sink))[..., None]
        e = jnp.exp(att - top)
        return e / (jnp.sum(e, -1, keepdims=True) + jnp.exp(sink[..., None] - top))


def _with_sinks(q_BxSxHxD, sinks_H):
    """q with each head's sink logit as one more dim (Scores.sinks)."""
    sinks = jnp.broadcast_to(sinks_H.astype(q_BxSxHxD.dtype), q_BxSxHxD.shape[:-1])
    return jnp.concatenate([q_BxSxHxD, sinks[..., None]], -1)


def _scored(q_BxCxHxD, k_BxSxHxD, v_BxSxHxD, visible_BxCxS, scores: Scores):
    """softmax over the visible keys, the scores kept (`visible` [B or 1, C, S]); with
    scores.maxima, (that, each head's largest visible score [H])."""
    dt = q_BxCxHxD.dtype
    q_BxCxHxD, sink_BxCxH = scores.split(q_BxCxHxD)
    q_BxCxHxD = q_BxCxHxD * jnp.asarray(scores.scale, dt)  # scaled here: S/D times fewer
    att_BxHxCxS = jnp.einsum("bshd,bthd->bhst", q_BxCxHxD, k_BxSxHxD).astype(jnp.float32)
    top_H = scores.largest(att_BxHxCxS, visible_BxCxS) if scores.maxima else None
    att_BxHxCxS = scores.capped(att_BxHxCxS)
    # an additive mask ([C, S] constant when causal alone: no [B, H, C, S] select to
    # undo in the backward pass), shared by the heads
    mask_Bx1xCxS = jnp.where(visible_BxCxS, 0.0, -1e30)[:, None]
    sink_BxHxC = None if sink_BxCxH is None else sink_BxCxH.transpose(0, 2, 1)
    prob_BxHxCxS = scores.softmax(att_BxHxCxS + mask_Bx1xCxS, sink_BxHxC).astype(dt)
    out_BxCxHxD = jnp.einsum("bhst,bthd->bshd", prob_BxHxCxS, v_BxSxHxD)
    return out_BxCxHxD if top_H is None else (out_BxCxHxD, top_H)


def _direct(
    q_BxCxHxD, k_BxSxHxD, v_BxSxHxD, first, segment_ids_BxS=None, window=0, scores=None
) -> jax.Array:
    """Attention of the C queries at positions first.. to all S keys; the scores kept
    (`scores` default: head_dim^-0.5, no cap)."""
    scores = scores or Scores(q_BxCxHxD.shape[-1] ** -0.5)
    rows, seq = q_BxCxHxD.shape[1], k_BxSxHxD.shape[1]
    back_CxS = first + jnp.arange(rows)[:, None] - jnp.arange(seq)[None, :]
    visible_BxCxS = ((back_CxS >= 0) & ((back_CxS < window) if window else True))[None]
    if segment_ids_BxS is not None:
        visible_BxCxS = visible_BxCxS & same_segment(segment_ids_BxS, first, rows)
    return _scored(q_BxCxHxD, k_BxSxHxD, v_BxSxHxD, visible_BxCxS, scores)


def _blocked(
    q_BxSxHxD, k_BxSxHxD, v_BxSxHxD, segment_ids_BxS=None, window=0, scores=None
) -> jax.Array:
    """The queries BLOCK rows at a time; each block's scores recomputed for backward."""
    one = jax.checkpoint(
        lambda q, first: _direct(q, k_BxSxHxD, v_BxSxHxD, first, segment_ids_BxS, window, scores),
        policy=jax.checkpoint_policies.nothing_saveable,
    )
    s = q_BxSxHxD.shape[1]
    block = _block(s)
    firsts = jnp.arange(s // block) * block
    if scores is None or not scores.maxima:
        return _by_blocks(lambda q, first: one(q, first), q_BxSxHxD, firsts)
    out_BxSxHxD, top_NxH = _by_blocks(lambda q, first: one(q, first), q_BxSxHxD, firsts)
    return out_BxSxHxD, jnp.max(top_NxH, 0)


def _block(s: int) -> int:
    return max(c for c in range(1, min(BLOCK, s) + 1) if s % c == 0)


def _in_blocks(x_BxS):
    """[B, S, ...] as [N, B, C, ...]: the query blocks (_block) of each row."""
    b, s = x_BxS.shape[:2]
    block = _block(s)
    return x_BxS.reshape(b, s // block, block, *x_BxS.shape[2:]).swapaxes(0, 1)


def _positions_in_blocks(q_pos_BxS, q_seg_BxS):
    """(the queries' positions by block, their segment ids by block: zeros where None)."""
    blocks = _in_blocks(q_pos_BxS)
    return blocks, _in_blocks(q_seg_BxS) if q_seg_BxS is not None else jnp.zeros(len(blocks))


def _by_blocks(one, q_BxSxHxD, *per_block):
    """one(q block, *per_block[i]) over the query blocks, put back together."""
    b, s, h = q_BxSxHxD.shape[:3]
    out = jax.lax.map(lambda x: one(*x), (_in_blocks(q_BxSxHxD), *per_block))
    out_NxBxCxHxD, *top = out if isinstance(out, tuple) else (out,)  # [N, H]: each block's
    out_BxSxHxD = out_NxBxCxHxD.swapaxes(0, 1).reshape(b, s, h, -1)  # v's dims (not sinks')
    return (out_BxSxHxD, *top) if top else out_BxSxHxD


def visible_by_positions(q_pos_BxC, k_pos_BxS, q_seg_BxC=None, k_seg_BxS=None, window: int = 0):
    """[B, C, S] bool: which keys each query sees, by the tokens' positions (and
    segments): at or before it, within the window, in its segment."""
    back_BxCxS = q_pos_BxC[:, :, None] - k_pos_BxS[:, None, :]
    visible_BxCxS = (back_BxCxS >= 0) & ((back_BxCxS < window) if window else True)
    if q_seg_BxC is not None:
        visible_BxCxS = visible_BxCxS & (q_seg_BxC[:, :, None] == k_seg_BxS[:, None, :])
    return visible_BxCxS


def largest_by_blocks(q_BxSxHxD, k_BxTxHxD, q_pos, k_pos, q_seg, k_seg, window, scale):
    """[H] each head's largest visible q . k x scale (Scores.largest), query blocks at a
    time, and nothing else: no softmax, no product with v, no gradient. QK-clip's maxima
    beside a kernel that hands on none (cuDNN's): one of attention's products again."""
    q_BxSxHxD, k_BxTxHxD = jax.lax.stop_gradient((q_BxSxHxD, k_BxTxHxD))
    scaled = q_BxSxHxD * jnp.asarray(scale, q_BxSxHxD.dtype)

    def one(args):
        q_BxCxHxD, pos_BxC, seg_BxC = args
        att_BxHxCxS = jnp.einsum("bshd,bthd->bhst", q_BxCxHxD, k_BxTxHxD).astype(jnp.float32)
        seg_BxC = None if q_seg is None else seg_BxC
        visible_BxCxS = visible_by_positions(pos_BxC, k_pos, seg_BxC, k_seg, window)
        return Scores(scale).largest(att_BxHxCxS, visible_BxCxS)

    return jnp.max(jax.lax.map(one, (_in_blocks(scaled), *_positions_in_blocks(q_pos, q_seg))), 0)


def _positioned(
    chosen: Form, q, k, v, q_pos, k_pos, q_seg, k_seg, window: int, scores: Scores
) -> jax.Array:
    """Attention of queries to keys in any order, masked by their positions: the form
    `chosen` on local blocks (cuDNN takes the mask as its bias)."""
    if chosen is Form.CUDNN:
        mask = visible_by_positions(q_pos, k_pos, q_seg, k_seg, window)[:, None]
        out = jax.nn.dot_product_attention(
            q, k, v, mask=mask, scale=scores.scale, implementation="cudnn"
        )
        if not scores.maxima:
            return out
        return out, largest_by_blocks(q, k, q_pos, k_pos, q_seg, k_seg, window, scores.scale)
    if chosen is Form.DIRECT:
        visible = visible_by_positions(q_pos, k_pos, q_seg, k_seg, window)
        return _scored(q, k, v, visible, scores)
    one = jax.checkpoint(
        lambda q, q_pos, q_seg: _scored(
            q, k, v, visible_by_positions(q_pos, k_pos, q_seg, k_seg, window), scores
        ),
        policy=jax.checkpoint_policies.nothing_saveable,
    )
    each = one if q_seg is not None else lambda q, p, _: one(q, p, None)
    if not scores.maxima:
        return _by_blocks(each, q, *_positions_in_blocks(q_pos, q_seg))
    out, top_NxH = _by_blocks(each, q, *_positions_in_blocks(q_pos, q_seg))
    return out, jnp.max(top_NxH, 0)


def cached_attention(
    q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, cache, slot, pad_B, window: int = 0, scores=None,
    sinks_H=None,
):  # fmt: skip
    """Attention of T new queries through one layer's KV cache (CACHE_NAMES: K key/value
    heads, each serving H/K query heads in order) whose slots before `slot` hold the
    earlier tokens: the new keys and values are written at slots slot..slot+T-1 (in
    place, where the cache is donated: the write comes first, so nothing reads the
    cache before it), then each query sees the slots at or after its row's first real
    token (`pad_B`: the left padding of each row) up to its own, within the sliding
    `window` if one is given. A windowed layer's cache may be a ring of fewer slots than
    the sequence (at least the window): slot s lives at s mod its size (`_ring`).
    `scores`: their scale and cap (default: head_dim^-0.5, none); `sinks_H`, as
    causal_attention's. Returns (out [B, T, H, D], the written cache)."""
    t, d, m = q_BxTxHxD.shape[1], q_BxTxHxD.shape[3], cache[0].shape[3]
    scores = scores or Scores(d**-0.5)
    if sinks_H is not None:
        q_BxTxHxD = _with_sinks(q_BxTxHxD, sinks_H)
        scores = dataclasses.replace(scores, sinks=True)
    k_BxKxDxT = k_BxTxKxD.transpose(0, 2, 3, 1).astype(cache[0].dtype)
    v_BxKxTxD = v_BxTxKxD.transpose(0, 2, 1, 3).astype(cache[1].dtype)
    if window and t > 1:  # a ring: the new tokens' keys beside the cache's, then written
        return _ring(q_BxTxHxD, k_BxKxDxT, v_BxKxTxD, cache, slot, pad_B, window, scores)
    at = slot % m if window else slot
    cache_k = jax.lax.dynamic_update_slice_in_dim(cache[0], k_BxKxDxT, at, 3)
    cache_v = jax.lax.dynamic_update_slice_in_dim(cache[1], v_BxKxTxD, at, 2)
    # the written cache as one buffer: XLA would otherwise fuse the write into each of
    # its readers, each a copy of the cache
    cache_k, cache_v = jax.lax.optimization_barrier((cache_k, cache_v))
    # the token each slot holds: the latest at or before the last query, of its residue
    held_M = slot + t - 1 - (slot + t - 1 - jnp.arange(m)) % m if window else jnp.arange(m)
    mask_BxTxM = _cache_mask(slot + jnp.arange(t), held_M, pad_B, window)
    out_BxTxHxD = _cache_attend(q_BxTxHxD, cache_k, cache_v, mask_BxTxM, scores)
    return out_BxTxHxD, (cache_k, cache_v)


def _ring(q_BxTxHxD, k_BxKxDxT, v_BxKxTxD, cache, slot, pad_B, window, scores):
    """cached_attention of T > 1 new tokens through a ring of M slots: they see the
    ring's tokens (the latest of each residue before `slot`) and each other, then their
    last min(T, M) keys and values are written at their slots mod M."""
    t, m = q_BxTxHxD.shape[1], cache[0].shape[3]
    keys_BxKxDxN = jnp.concatenate([cache[0], k_BxKxDxT], 3)
    values_BxKxNxD = jnp.concatenate([cache[1], v_BxKxTxD], 2)
    held_M = slot - 1 - (slot - 1 - jnp.arange(m)) % m  # < 0: never written
    held_N = jnp.concatenate([held_M, slot + jnp.arange(t)])
    mask_BxTxN = _cache_mask(slot + jnp.arange(t), held_N, pad_B, window)
    out_BxTxHxD = _cache_attend(q_BxTxHxD, keys_BxKxDxN, values_BxKxNxD, mask_BxTxN, scores)
    kept = min(t, m)
    at_L = (slot + t - kept + jnp.arange(kept)) % m  # distinct: kept <= m
    cache_k = cache[0].at[:, :, :, at_L].set(k_BxKxDxT[..., t - kept :])
    cache_v = cache[1].at[:, :, at_L].set(v_BxKxTxD[:, :, t - kept :])
    return out_BxTxHxD, (cache_k, cache_v)


def _cache_attend(q_BxTxHxD, k_BxKxDxM, v_BxKxMxD, mask_BxTxM, scores: Scores):
    """softmax(cap(q k x scale) + mask) v of T queries over M cached keys."""
    q_BxTxHxD, sink_BxTxH = scores.split(q_BxTxHxD)
    b, t, h, d = q_BxTxHxD.shape
    kv, dt = k_BxKxDxM.shape[1], q_BxTxHxD.dtype
    q_BxKxGxTxD = q_BxTxHxD * jnp.asarray(scores.scale, dt)
    q_BxKxGxTxD = q_BxKxGxTxD.reshape(b, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4)
    # one new token of one row: as sums of products, for XLA:CPU copies the cache into a
    # batched product of one row (llama-tiny decodes 1.9x faster so; gemma3-tiny, 32 dims
    # a head, 1.8x slower); more rows: batched products (as sums they were as fast on
    # the peer benchmark's model at 8 rows, and 1.4x (llama-tiny) to 4x (gemma3-tiny)
    # slower)
    sums = t == 1 and b == 1
    if sums:
        att_BxKxGxTxM = jnp.sum(
            q_BxKxGxTxD[..., None] * k_BxKxDxM.astype(dt)[:, :, None, None], axis=-2
        )
    else:
        att_BxKxGxTxM = jnp.einsum("bkgtd,bkdm->bkgtm", q_BxKxGxTxD, k_BxKxDxM.astype(dt))
    att_BxKxGxTxM = scores.capped(att_BxKxGxTxM.astype(jnp.float32))
    sink = None
    if sink_BxTxH is not None:
        sink = sink_BxTxH.reshape(b, t, kv, h // kv).transpose(0, 2, 3, 1)
    prob = scores.softmax(att_BxKxGxTxM + mask_BxTxM[:, None, None], sink)
    if sums:
        out_BxKxGxTxD = jnp.sum(
            prob.astype(dt)[..., None] * v_BxKxMxD.astype(dt)[:, :, None, None], axis=-2
        )
    else:
        out_BxKxGxTxD = jnp.einsum("bkgtm,bkmd->bkgtd", prob.astype(dt), v_BxKxMxD.astype(dt))
    return out_BxKxGxTxD.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def _cache_mask(query_T, held_M, pad_B, window: int = 0) -> jax.Array:
    """[B, T, M] 0 where queries at slots `query_T` see the cache slots holding the
    tokens at `held_M` (at or before their own, from their row's first real token,
    within the window), else -1e30."""
    back_TxM = query_T[:, None] - held_M[None, :]
    visible_TxM = (back_TxM >= 0) & ((back_TxM < window) if window else True)
    visible_BxTxM = visible_TxM[None] & (held_M[None, None, :] >= pad_B[:, None, None])
    return jnp.where(visible_BxTxM, 0.0, -1e30)


def cached_latent_attention(
    q_lat_BxTxHxL, q_rope_BxTxHxR, c_BxTxL, k_rope_BxTxR, cache, slot, pad_B, scale: float
):
    """Latent attention (models/latent.py) of T new queries through one layer's latent
    cache: (rotated keys [B, 1, R, M], latents [B, 1, M, L]), laid out as CACHE_NAMES
    with one key/value head, the rotated keys as the keys and the latents as the
    values. The new latents and keys are written at slots slot..slot+T-1 (as
    cached_attention does), each query scored as q_lat . latent + q_rope . key (times
    `scale`), masked as cached_attention masks, and the latents weighted by the
    scores. Returns (the weighted latents [B, T, H, L], the written cache)."""
    t, m = q_lat_BxTxHxL.shape[1], cache[0].shape[3]
    dt = q_lat_BxTxHxL.dtype
    cache_k = jax.lax.dynamic_update_slice_in_dim(
        cache[0], k_rope_BxTxR.transpose(0, 2, 1)[:, None].astype(cache[0].dtype), slot, 3
    )
    cache_c = jax.lax.dynamic_update_slice_in_dim(
        cache[1], c_BxTxL[:, None].astype(cache[1].dtype), slot, 2
    )
    cache_k, cache_c = jax.lax.optimization_barrier((cache_k, cache_c))
    k_BxRxM, c_BxMxL = cache_k[:, 0].astype(dt), cache_c[:, 0].astype(dt)
    att_BxHxTxM = jnp.einsum("bthl,bml->bhtm", q_lat_BxTxHxL, c_BxMxL) + jnp.einsum(
        "bthr,brm->bhtm", q_rope_BxTxHxR, k_BxRxM
    )
    att_BxHxTxM = att_BxHxTxM.astype(jnp.float32) * scale
    mask_Bx1xTxM = _cache_mask(slot + jnp.arange(t), jnp.arange(m), pad_B)[:, None]
    prob_BxHxTxM = jax.nn.softmax(att_BxHxTxM + mask_Bx1xTxM, axis=-1).astype(dt)
    return jnp.einsum("bhtm,bml->bthl", prob_BxHxTxM, c_BxMxL), (cache_k, cache_c)
