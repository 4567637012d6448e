"""Causal attention, in the form the step's platform runs best, for models to call.

`causal_attention(q, k, v)` computes softmax(q k^T / sqrt(head_dim) + causal mask) v
with the scores in fp32. Which program computes it follows the platform the step is
built for (the running `jaxpar.context.Context`; outside a step, the default backend):

- `cudnn`: on CUDA in bf16/fp16 with a head dim cuDNN takes (a multiple of 8, at most
  128): `jax.nn.dot_product_attention`'s cuDNN flash-attention kernel, which never stores
  the [B, H, S, S] scores, forward or backward.
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


def causal_attention(q_BxSxHxD, k_BxSxHxD, v_BxSxHxD) -> jax.Array:
    """softmax(q k^T / sqrt(head_dim) + causal mask) v, [B, S, H, D] in and out."""
    ctx = context.current()
    platform = ctx.platform if ctx else context.platform_of(jax.devices()[0])
    chosen = form(platform, q_BxSxHxD.dtype, q_BxSxHxD.shape[-1])
    if chosen is Form.CUDNN:
        return jax.nn.dot_product_attention(
            q_BxSxHxD, k_BxSxHxD, v_BxSxHxD, is_causal=True, implementation="cudnn"
        )
    if chosen is Form.BLOCKED:
        return _blocked(q_BxSxHxD, k_BxSxHxD, v_BxSxHxD)
    return _direct(q_BxSxHxD, k_BxSxHxD, v_BxSxHxD, 0)


def _direct(q_BxCxHxD, k_BxSxHxD, v_BxSxHxD, first) -> jax.Array:
    """Attention of the C queries at positions first.. to all S keys; the scores kept."""
    dt = q_BxCxHxD.dtype
    q_BxCxHxD = q_BxCxHxD * q_BxCxHxD.shape[-1] ** -0.5  # scaled here: S/D times fewer
    att_BxHxCxS = jnp.einsum("bshd,bthd->bhst", q_BxCxHxD, k_BxSxHxD).astype(jnp.float32)
    rows, seq = q_BxCxHxD.shape[1], k_BxSxHxD.shape[1]
    # causal: an additive mask, a constant [C, S] (no [B, H, C, S] select to undo in
    # the backward pass)
    visible_CxS = first + jnp.arange(rows)[:, None] >= jnp.arange(seq)[None, :]
    mask_CxS = jnp.where(visible_CxS, 0.0, -1e30)
    prob_BxHxCxS = jax.nn.softmax(att_BxHxCxS + mask_CxS[None, None], axis=-1).astype(dt)
    return jnp.einsum("bhst,bthd->bshd", prob_BxHxCxS, v_BxSxHxD)


def _blocked(q_BxSxHxD, k_BxSxHxD, v_BxSxHxD) -> jax.Array:
    """The queries BLOCK rows at a time; each block's scores recomputed for backward."""
    b, s, h, d = q_BxSxHxD.shape
    block = max(c for c in range(1, min(BLOCK, s) + 1) if s % c == 0)
    q_NxBxCxHxD = q_BxSxHxD.reshape(b, s // block, block, h, d).swapaxes(0, 1)
    one = jax.checkpoint(
        lambda q, first: _direct(q, k_BxSxHxD, v_BxSxHxD, first),
        policy=jax.checkpoint_policies.nothing_saveable,
    )
    firsts = jnp.arange(s // block) * block
    out_NxBxCxHxD = jax.lax.map(lambda x: one(*x), (q_NxBxCxHxD, firsts))
    return out_NxBxCxHxD.swapaxes(0, 1).reshape(b, s, h, d)
