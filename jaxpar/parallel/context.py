"""Context parallelism: each sequence split over the `context` axis.

Every device of a `context` group holds S / C of the tokens of each of its rows (`local`
takes them from the batch). The residual stream, norms, MLPs and the loss are per token
and need nothing from the others; attention needs every key and value before its
queries, and gets them by `parallel.context_strategy`:

- `all_gather`: each layer gathers the keys and values over `context` (their distinct
  heads only, under grouped-query attention) and computes its own queries' attention;
  autodiff turns the gather into a reduce-scatter of their gradients (MaxText's default).
- `ulysses`: an all-to-all from sequence-split to head-split for q, k and v, attention
  over the whole sequence for 1/C of the heads, and an all-to-all back (DeepSpeed
  Ulysses); key/value heads fewer than C are repeated to C first.

`context` is manual in the step's shard_map: each device computes on its own tokens
alone, and the collectives are the ones written here; attention runs in a shard_map
manual over `tensor` too, so that the kernel (cuDNN's too) gets whole local blocks of
heads and an explicit mask.

Causal balance (`parallel.context_balance`): under a causal mask the device holding a
sequence's last chunk would do most of the work, so each batch's tokens are reordered
into 2C chunks, device i holding chunks i and 2C-1-i. The targets, positions, segment
ids and loss mask move with their tokens (jaxpar.nn.documents reads them through `local`);
attention masks by the tokens' original positions. A loss sums over tokens, so their
order never shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxpar.config.sections import ContextStrategy, Parallel
from jaxpar.errors import ConfigError
from jaxpar.parallel.axes import CONTEXT, TENSOR
from jaxpar.parallel.collectives import compiler_axes


@dataclass(frozen=True)
class Split:
    """How a step splits sequences over `context` (jaxpar.parallel.context)."""

    degree: int  # C: the context axis' size
    strategy: ContextStrategy
    balance: bool  # the dual-chunk reorder
    seq_len: int = 0  # train.seq_len: what a device's loss must cover 1/C of (0: unchecked)


def split_of(par: Parallel, mesh_shape: dict, seq_len: int) -> Split | None:
    c = mesh_shape.get(CONTEXT, 1)
    return Split(c, par.context_strategy, par.context_balance, seq_len) if c > 1 else None


def order(seq: int, split: Split) -> np.ndarray:
    """[seq] the original position of each slot: chunks (0, 2C-1, 1, 2C-2, ...) when
    balanced, so that contiguous slices of S / C hold chunks i and 2C-1-i; else 0..S-1."""
    if not split.balance:
        return np.arange(seq)
    c = split.degree
    chunks = np.arange(seq).reshape(2 * c, seq // (2 * c))
    return np.concatenate([chunks[j] for i in range(c) for j in (i, 2 * c - 1 - i)])


def score_blocks(seq: int, split: Split, block: int) -> list[int]:
    """Per context device, the [block x block] tiles of its queries' causal scores that
    are not wholly masked (the work a blocked kernel does), its queries in slot order
    against the keys in original order."""
    where = order(seq, split)
    part = seq // split.degree
    counts = []
    for device in range(split.degree):
        queries = where[device * part : (device + 1) * part].reshape(-1, block)
        # a tile (query tile, key tile k) has a visible score if some query >= k's first key
        firsts = np.arange(0, seq, block)
        counts.append(int(sum((q.max() >= firsts).sum() for q in queries)))
    return counts


def check(par: Parallel, mesh_shape: dict, seq_len: int, heads: int | None) -> None:
    """The context layout against the sequence length and the heads, before compiling."""
    c, t = mesh_shape.get(CONTEXT, 1), mesh_shape.get(TENSOR, 1)
    if par.sequence_parallel and t == 1:
        raise ConfigError(
            "parallel.sequence_parallel=true with parallel.tensor=1: sequence parallelism "
            "splits what tensor parallelism leaves whole on every tensor device; set "
            "parallel.tensor > 1, or drop parallel.sequence_parallel"
        )
    if c == 1:
        return
    chunks = 2 * c if par.context_balance else c
    if seq_len % chunks:
        how = (
            f"2 x parallel.context = {chunks} chunks (parallel.context_balance=true)"
            if par.context_balance
            else f"parallel.context={c} parts"
        )
        raise ConfigError(
            f"train.seq_len={seq_len} does not split into {how}; choose train.seq_len a "
            f"multiple of {chunks}, e.g. {chunks * max(1, round(seq_len / chunks))}"
        )
    if par.sequence_parallel and (seq_len // c) % t:
        raise ConfigError(
            f"train.seq_len={seq_len} over parallel.context={c} leaves {seq_len // c} tokens "
            f"a device, which parallel.tensor={t} cannot split (sequence_parallel=true); "
            f"choose train.seq_len a multiple of {c * t}"
        )
    if par.context_strategy is ContextStrategy.ULYSSES:
        if heads is None:
            raise ConfigError(
                "parallel.context_strategy=ulysses splits attention heads over context, and "
                "this model has no attention heads; use context_strategy=all_gather"
            )
        if heads % (c * t):
            raise ConfigError(
                f"parallel.context_strategy=ulysses: model.heads={heads} is not divisible by "
                f"parallel.context={c} x parallel.tensor={t} = {c * t} (each context device "
                "takes an equal share of each tensor device's heads); choose degrees whose "
                f"product divides {heads}, or context_strategy=all_gather"
            )


def _distinct(local_heads: int, group: int) -> int:
    """How many distinct key/value heads serve a device's `local_heads` query heads
    (`group` query heads a key/value head, in order)."""
    if group > 1 and local_heads % group == 0:
        return local_heads // group
    if group > 1 and group % local_heads == 0:
        return 1
    return local_heads


def kv_heads_moved(local_heads: int, group: int, split: Split) -> int:
    """Key/value heads a device sends each layer (per tensor device): the distinct ones
    of its query heads, and under Ulysses a multiple of C of them (fewer than C are
    repeated to C), so that each context device receives whole ones."""
    distinct = _distinct(local_heads, group)
    if split.strategy is ContextStrategy.ULYSSES and distinct % split.degree:
        return split.degree if split.degree % distinct == 0 else local_heads
    return distinct


def _kv(x_BxSxHxD, group: int, moved: int) -> jax.Array:
    """The `moved` key/value heads of a device's repeated ones (one per query head)."""
    heads = x_BxSxHxD.shape[2]
    distinct = _distinct(heads, group)
    x = x_BxSxHxD[:, :, :: heads // distinct]
    return x if moved == distinct else jnp.repeat(x, moved // distinct, axis=2)


FAR = 2**30  # the position of a key no query sees: a halo before the sequence's start


def halo_reach(split: Split, window: int, part: int) -> bool:
    """Whether a windowed layer's keys come from the chunks just before each of this
    device's (`part` tokens a device): the window's W - 1 keys reach no further back
    than one chunk, under all_gather."""
    chunk = part // (2 if split.balance else 1)
    return bool(window) and split.strategy is ContextStrategy.ALL_GATHER and window - 1 <= chunk


def _halo(x_BxPx, split: Split, reach: int):
    """The `reach` tokens just before each of this device's chunks, [B, parts x reach,
    ...], from the devices that hold them (one collective-permute a chunk): chunk i
    follows chunk i - 1 of device i - 1 (balanced: chunk 2C-1-i follows chunk 2C-2-i of
    device i + 1). Where none is sent (device 0's first chunk starts the sequence;
    balanced, device C - 1's second follows its own first): zeros, which
    _halo_positions hides."""
    c, parts = split.degree, 2 if split.balance else 1
    chunk = x_BxPx.shape[1] // parts
    tails = [x_BxPx[:, (p + 1) * chunk - reach : (p + 1) * chunk] for p in range(parts)]
    before = jax.lax.ppermute(tails[0], CONTEXT, [(i, i + 1) for i in range(c - 1)])
    if parts == 1:
        return before
    after = jax.lax.ppermute(tails[1], CONTEXT, [(i + 1, i) for i in range(c - 1)])
    return jnp.concatenate([before, after], 1)


def _halo_positions(split: Split, positions_BxP, segments_BxP, reach: int):
    """The halo's positions and segment ids (_halo): moved with documents; without,
    counted back from each chunk's first. Where _halo got none, at FAR: no query sees
    them (device C - 1's second chunk sees its first among its own keys)."""
    c, parts = split.degree, 2 if split.balance else 1
    if segments_BxP is None:
        chunk = positions_BxP.shape[1] // parts
        firsts = [positions_BxP[:, p * chunk, None] for p in range(parts)]
        positions = jnp.concatenate([f - reach + jnp.arange(reach)[None] for f in firsts], 1)
        segments = None
    else:
        positions, segments = (_halo(x, split, reach) for x in (positions_BxP, segments_BxP))
    device, first = jax.lax.axis_index(CONTEXT), jnp.arange(parts * reach)[None] < reach
    none = (first & (device == 0)) | (~first & (device == c - 1))
    return jnp.where(none, FAR, positions), segments


def attention(
    split: Split,
    q_BxCxHxD,
    k_BxCxHxD,
    v_BxCxHxD,
    segments_BxC,
    positions_BxC,
    window,
    group,
    attend,
    gathered: bool = False,
    maxima: bool = False,
):
    """Causal attention of this device's S / C tokens' q, k and v ([B, C, H, D], k
    and v repeated to one head per query head, `group` query heads a key/value head) by
    the split's strategy; `attend(q, k, v, q_pos, k_pos, q_seg, k_seg)` is the local
    attention, masked by original positions. `gathered` (all_gather only): k and v
    are the whole rows already, [B, S, H, D] in the step's token order. The whole
    row's positions are known without documents; with them, they and the segment ids
    are gathered too. `maxima`: attend returns (out, each head's largest score [H]),
    and so does this, each head's over this device's queries at least (ulysses: over
    the row's, its heads' gathered back over `context`)."""
    rows, part = positions_BxC.shape
    if not gathered and halo_reach(split, window, part):
        qkv = (q_BxCxHxD, k_BxCxHxD, v_BxCxHxD)
        return _windowed(split, *qkv, segments_BxC, positions_BxC, window, group, attend, maxima)
    if segments_BxC is None:
        whole = order(part * split.degree, split)
        positions_BxS = jnp.broadcast_to(jnp.asarray(whole, jnp.int32), (rows, whole.size))
    else:
        segments_BxS, positions_BxS = (
            jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True)
            for x in (segments_BxC, positions_BxC)
        )

    def per_tensor(q, k, v, segments, positions, q_segments, q_positions):
        if gathered:
            return attend(q, k, v, q_positions, positions, q_segments, segments)
        moved = kv_heads_moved(q.shape[2], group, split)
        k, v = (_kv(x, group, moved) for x in (k, v))
        if split.strategy is ContextStrategy.ALL_GATHER:
            k, v = (jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True) for x in (k, v))
            k, v = (jnp.repeat(x, q.shape[2] // moved, axis=2) for x in (k, v))
            return attend(q, k, v, q_positions, positions, q_segments, segments)
        q, k, v = (
            jax.lax.all_to_all(x, CONTEXT, split_axis=2, concat_axis=1, tiled=True)
            for x in (q, k, v)
        )
        k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
        out = attend(q, k, v, positions, positions, segments, segments)
        back = lambda o: jax.lax.all_to_all(o, CONTEXT, split_axis=1, concat_axis=2, tiled=True)  # noqa: E731
        if not maxima:
            return back(out)
        return back(out[0]), jax.lax.all_gather(out[1], CONTEXT, axis=0, tiled=True)

    return _by_heads(
        maxima,
        per_tensor,
        (q_BxCxHxD, k_BxCxHxD, v_BxCxHxD),
        None if segments_BxC is None else segments_BxS,
        positions_BxS,
        segments_BxC,
        positions_BxC,
    )


def _by_heads(maxima: bool, per_tensor, qkv, *whole):
    """per_tensor(q, k, v, *whole) in a shard_map manual over `tensor`: each tensor
    device's block of heads of q, k and v ([B, C, H, D]), and `whole` (4 arrays, or
    None) as they are; with `maxima`, per_tensor's heads' largest scores [H] too. Called
    plainly where `tensor` is manual already (its degree 1: jaxpar.parallel.mesh.by_hand)."""
    if TENSOR not in compiler_axes():
        return per_tensor(*qkv, *whole)
    heads = PartitionSpec(None, None, TENSOR, None)
    return jax.shard_map(
        per_tensor,
        in_specs=(heads, heads, heads, *(PartitionSpec(),) * len(whole)),
        out_specs=(heads, PartitionSpec(TENSOR)) if maxima else heads,
        axis_names={TENSOR},
        check_vma=False,
    )(*qkv, *whole)


def _windowed(split: Split, q_BxCxHxD, k_BxCxHxD, v_BxCxHxD, segments_BxC, positions_BxC,
              window, group, attend, maxima):  # fmt: skip
    """attention() of a windowed layer whose window reaches one chunk back (halo_reach):
    each device gets the W - 1 keys and values before each of its chunks (_halo), their
    distinct heads alone, and attends its queries to them and its own."""
    reach = window - 1
    halo_positions, halo_segments = _halo_positions(split, positions_BxC, segments_BxC, reach)
    positions = jnp.concatenate([halo_positions, positions_BxC], 1)
    segments = None
    if segments_BxC is not None:
        segments = jnp.concatenate([halo_segments, segments_BxC], 1)

    def per_tensor(q, k, v, positions, segments, q_positions, q_segments):
        moved = kv_heads_moved(q.shape[2], group, split)
        k, v = (_kv(x, group, moved) for x in (k, v))
        k, v = (jnp.concatenate([_halo(x, split, reach), x], 1) for x in (k, v))
        k, v = (jnp.repeat(x, q.shape[2] // moved, axis=2) for x in (k, v))
        return attend(q, k, v, q_positions, positions, q_segments, segments)

    qkv = (q_BxCxHxD, k_BxCxHxD, v_BxCxHxD)
    return _by_heads(maxima, per_tensor, qkv, positions, segments, positions_BxC, segments_BxC)
