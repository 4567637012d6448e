"""The frozen base in fewer bits: 4-bit NormalFloat with a scale per block of 64 values
(QLoRA's NF4), or int8 with a scale per output channel. A quantized weight is stored as
two leaves, its codes and its scales, and dequantized a layer at a time in the compute
dtype as the layer is made ready (jaxpar.nn.layers.Assembled).

NF4 packs two codes to a byte along the weight's last dim, in blocks of 64 of that dim.
int8's scale is the largest magnitude over the input dims (kept as size-1 dims), per
output channel."""

from __future__ import annotations

from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np

NF4_BLOCK = 64  # values per NF4 scale (QLoRA's block size)
# QLoRA's outermost quantile: halfway between 1 - 1/(2 x 15) and 1 - 1/(2 x 16)
NF4_OFFSET = 0.9677083


def nf4_code_book() -> np.ndarray:
    """QLoRA's 16 NormalFloat values: 8 quantiles of N(0, 1) for the positive half, 7
    for the negative and an exact zero, scaled into [-1, 1] (Dettmers et al. 2023, §3)."""
    ppf = NormalDist().inv_cdf
    positive = [ppf(p) for p in np.linspace(NF4_OFFSET, 0.5, 9)[:-1]]
    negative = [-ppf(p) for p in np.linspace(NF4_OFFSET, 0.5, 8)[:-1]]
    values = np.sort(np.asarray([*positive, 0.0, *negative]))
    return (values / np.abs(values).max()).astype(np.float32)


NF4 = nf4_code_book()


def storage(kind: str, shape: tuple[int, ...], inputs: tuple[int, ...]):
    """((codes shape, dtype), scales shape) of a weight of `shape` whose input dims are
    at `inputs`, stored as `kind`."""
    if kind == "nf4":
        lead, last = shape[:-1], shape[-1]
        return ((*lead, last // 2), jnp.uint8), (*lead, last // NF4_BLOCK)
    return (shape, jnp.int8), tuple(1 if i in inputs else n for i, n in enumerate(shape))


def quantize(kind: str, w: jax.Array, inputs: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """(codes, fp32 scales) of a weight whose input dims are at `inputs`."""
    w = w.astype(jnp.float32)
    if kind == "nf4":
        lead, last = w.shape[:-1], w.shape[-1]
        blocks = w.reshape(*lead, last // NF4_BLOCK, NF4_BLOCK)
        absmax = jnp.max(jnp.abs(blocks), -1)
        normed = blocks / jnp.where(absmax == 0, 1.0, absmax)[..., None]
        book = jnp.asarray(NF4).reshape((1,) * normed.ndim + (len(NF4),))
        nearest = jnp.argmin(jnp.abs(normed[..., None] - book), -1)
        pairs = nearest.astype(jnp.uint8).reshape(*lead, last // 2, 2)
        return pairs[..., 0] << 4 | pairs[..., 1], absmax
    scale = jnp.max(jnp.abs(w), inputs, keepdims=True)
    return jnp.round(w / jnp.where(scale == 0, 1.0, scale) * 127).astype(jnp.int8), scale


def dequantize(kind: str, codes: jax.Array, scale: jax.Array) -> jax.Array:
    """The weight, in the scales' dtype, from its codes and scales (any leading dims
    sliced off both alike)."""
    if kind == "nf4":
        lead, last = codes.shape[:-1], codes.shape[-1] * 2
        pairs = jnp.stack([codes >> 4, codes & 15], -1).reshape(*lead, -1, NF4_BLOCK)
        values = jnp.asarray(NF4, scale.dtype)[pairs]
        return (values * scale[..., None]).reshape(*lead, last)
    return codes.astype(scale.dtype) * (scale / 127)
