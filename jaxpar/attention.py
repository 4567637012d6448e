"""Causal attention, in the form the step's platform runs best, for models to call.

`causal_attention(q, k, v, segment_ids)` computes softmax(q k^T / sqrt(head_dim) + mask)
v with the scores in fp32, the mask causal and, given the tokens' segment ids (packed
documents, jaxpar.documents), closed between segments. Which program computes it
follows the platform the step is built for (the running `jaxpar.context.Context`;
outside a step, the default backend):

- `cudnn`: on CUDA in bf16/fp16 with a head dim cuDNN takes (a multiple of 8, at most
  128): `jax.nn.dot_product_attention`'s cuDNN flash-attention kernel, which never stores
  the [B, H, S, S] scores, forward or backward. Segment ids reach the kernel as its
  mask (a [B, 1, S, S] additive bias, one per row, shared by the heads: what jax's
  public cuDNN entry passes on; the kernel's packed-sequence form is private in jax).
- `blocked`: on any other accelerator, or fp32 on CUDA: the queries in blocks of at
  most `BLOCK` rows (the largest such divisor of S), each block's [B, H, BLOCK, S]
  scores recomputed in the backward pass instead of kept: no [S, S] buffer either.
- `direct`: on CPU, the [B, H, S, S] scores computed and kept for the backward pass,
  the fastest of the forms measured on XLA:CPU (README, "Speed against PyTorch").

`stores_scores(platform, dtype, head_dim)` says whether the form in use keeps the
scores, for the planner's activation count (Korthikanti's 5 a s^2 b term).
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from jaxpar import context

BLOCK = 512  # query rows per block of the blocked form
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


class Form(enum.Enum):
    CUDNN = "cudnn"
    BLOCKED = "blocked"
    DIRECT = "direct"


def form(platform: str, dtype, head_dim: int) -> Form:
    """The attention program for this platform ('cpu', 'cuda', 'rocm', 'tpu'), compute
    dtype and head dim."""
    if platform == "cpu":
        return Form.DIRECT
    cudnn_ready = head_dim % 8 == 0 and head_dim <= 128
    if platform == "cuda" and jnp.dtype(dtype) in map(jnp.dtype, CUDNN_DTYPES) and cudnn_ready:
        return Form.CUDNN
    return Form.BLOCKED


def stores_scores(platform: str, dtype, head_dim: int) -> bool:
    return form(platform, dtype, head_dim) is Form.DIRECT


def causal_attention(
    q_BxSxHxD, k_BxSxHxD, v_BxSxHxD, segment_ids_BxS=None, window: int = 0
) -> jax.Array:
    """softmax(q k^T / sqrt(head_dim) + mask) v, [B, S, H, D] in and out: each query
    sees the keys at or before it, of its own segment where segment ids are given, and
    (a sliding `window`) fewer than `window` positions back."""
    ctx = context.current()
    platform = ctx.platform if ctx else context.platform_of(jax.devices()[0])
    chosen = form(platform, q_BxSxHxD.dtype, q_BxSxHxD.shape[-1])
    if chosen is Form.CUDNN:
        return jax.nn.dot_product_attention(
            q_BxSxHxD,
            k_BxSxHxD,
            v_BxSxHxD,
            mask=None if segment_ids_BxS is None else same_segment(segment_ids_BxS)[:, None],
            is_causal=True,
            local_window_size=(window - 1, 0) if window else None,
            implementation="cudnn",
        )
    if chosen is Form.BLOCKED:
        return _blocked(q_BxSxHxD, k_BxSxHxD, v_BxSxHxD, segment_ids_BxS, window)
    return _direct(q_BxSxHxD, k_BxSxHxD, v_BxSxHxD, 0, segment_ids_BxS, window)


def same_segment(segment_ids_BxS, first=0, rows=None) -> jax.Array:
    """[B, C, S] bool: whether query first + c and key t are in the same segment."""
    rows = segment_ids_BxS.shape[1] if rows is None else rows
    queries_BxC = jax.lax.dynamic_slice_in_dim(segment_ids_BxS, first, rows, axis=1)
    return queries_BxC[:, :, None] == segment_ids_BxS[:, None, :]


def _direct(
    q_BxCxHxD, k_BxSxHxD, v_BxSxHxD, first, segment_ids_BxS=None, window: int = 0
) -> jax.Array:
    """Attention of the C queries at positions first.. to all S keys; the scores kept."""
    dt = q_BxCxHxD.dtype
    q_BxCxHxD = q_BxCxHxD * q_BxCxHxD.shape[-1] ** -0.5  # scaled here: S/D times fewer
    att_BxHxCxS = jnp.einsum("bshd,bthd->bhst", q_BxCxHxD, k_BxSxHxD).astype(jnp.float32)
    rows, seq = q_BxCxHxD.shape[1], k_BxSxHxD.shape[1]
    # causal: an additive mask, a constant [C, S] (no [B, H, C, S] select to undo in
    # the backward pass); with segments, [B, C, S], shared by the heads
    back_CxS = first + jnp.arange(rows)[:, None] - jnp.arange(seq)[None, :]
    visible_BxCxS = ((back_CxS >= 0) & ((back_CxS < window) if window else True))[None]
    if segment_ids_BxS is not None:
        visible_BxCxS = visible_BxCxS & same_segment(segment_ids_BxS, first, rows)
    mask_Bx1xCxS = jnp.where(visible_BxCxS, 0.0, -1e30)[:, None]
    prob_BxHxCxS = jax.nn.softmax(att_BxHxCxS + mask_Bx1xCxS, axis=-1).astype(dt)
    return jnp.einsum("bhst,bthd->bshd", prob_BxHxCxS, v_BxSxHxD)


def _blocked(q_BxSxHxD, k_BxSxHxD, v_BxSxHxD, segment_ids_BxS=None, window=0) -> jax.Array:
    """The queries BLOCK rows at a time; each block's scores recomputed for backward."""
    b, s, h, d = q_BxSxHxD.shape
    block = max(c for c in range(1, min(BLOCK, s) + 1) if s % c == 0)
    q_NxBxCxHxD = q_BxSxHxD.reshape(b, s // block, block, h, d).swapaxes(0, 1)
    one = jax.checkpoint(
        lambda q, first: _direct(q, k_BxSxHxD, v_BxSxHxD, first, segment_ids_BxS, window),
        policy=jax.checkpoint_policies.nothing_saveable,
    )
    firsts = jnp.arange(s // block) * block
    out_NxBxCxHxD = jax.lax.map(lambda x: one(*x), (q_NxBxCxHxD, firsts))
    return out_NxBxCxHxD.swapaxes(0, 1).reshape(b, s, h, d)


def cached_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, cache, slot, pad_B, window: int = 0):
    """Attention of T new queries through a KV cache: their keys and values written at
    slots slot..slot+T-1 of `cache` (k, v [B, M, K, D], K key/value heads, each serving
    H/K query heads in order), each query seeing the slots at or before its own and at or
    after its row's first real token (`pad_B`: the left padding of each row), and within
    the sliding `window` if one is given. Returns
    (out [B, T, H, D], the cache with the new keys and values)."""
    cache_k, cache_v = cache
    cache_k = jax.lax.dynamic_update_slice_in_dim(cache_k, k_BxTxKxD.astype(cache_k.dtype), slot, 1)
    cache_v = jax.lax.dynamic_update_slice_in_dim(cache_v, v_BxTxKxD.astype(cache_v.dtype), slot, 1)
    b, t, h, d = q_BxTxHxD.shape
    kv, m = cache_k.shape[2], cache_k.shape[1]
    q_BxTxKxGxD = (q_BxTxHxD * d**-0.5).reshape(b, t, kv, h // kv, d)
    att_BxKxGxTxM = jnp.einsum(
        "btkgd,bmkd->bkgtm", q_BxTxKxGxD, cache_k.astype(q_BxTxHxD.dtype)
    ).astype(jnp.float32)
    keys_M, queries_T = jnp.arange(m), slot + jnp.arange(t)
    back_TxM = queries_T[:, None] - keys_M[None, :]
    visible_TxM = (back_TxM >= 0) & ((back_TxM < window) if window else True)
    visible_BxTxM = visible_TxM[None] & (keys_M[None, None, :] >= pad_B[:, None, None])
    mask_Bx1x1xTxM = jnp.where(visible_BxTxM, 0.0, -1e30)[:, None, None]
    prob = jax.nn.softmax(att_BxKxGxTxM + mask_Bx1x1xTxM, axis=-1).astype(q_BxTxHxD.dtype)
    out_BxTxKxGxD = jnp.einsum("bkgtm,bmkd->btkgd", prob, cache_v.astype(q_BxTxHxD.dtype))
    return out_BxTxKxGxD.reshape(b, t, h, d), (cache_k, cache_v)
