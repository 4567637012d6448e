"""The order an epoch visits a split's windows in: a pseudo-random permutation of
[0, n) that is a pure function of (seed, source, epoch), computed for each index alone.

It is a Feistel network over the smallest power of four at least n, cycle-walked into
[0, n) (a bijection of the larger domain, applied again while it lands past n, is a
bijection of [0, n)). No table of n entries is built, so a split of any size costs
nothing to shuffle, and each process computes only its own rows' windows: what Grain's
index shuffle does, in numpy, vectorised over a batch's rows."""

from __future__ import annotations

import functools

import numpy as np

ROUNDS = 4  # Luby-Rackoff: four rounds of a random function make a strong permutation
_GOLDEN = 0x9E3779B97F4A7C15


@functools.lru_cache(maxsize=256)
def keys(seed: int, source: int, epoch: int) -> tuple[np.uint64, ...]:
    """The round keys of one source's epoch, each added to the round's input."""
    draws = np.random.default_rng([seed, source, epoch]).integers(0, 2**63, size=ROUNDS)
    return tuple(np.uint64((int(k) * _GOLDEN) & (2**64 - 1)) for k in draws)


def permute(index: np.ndarray, n: int, round_keys: tuple[np.uint64, ...]) -> np.ndarray:
    """The window each of `index` (each in [0, n)) visits, int64, as the epoch of
    `round_keys` orders them: a bijection of [0, n)."""
    half = max(1, ((int(n) - 1).bit_length() + 1) // 2)
    out = np.asarray(index, dtype=np.uint64).copy()
    todo = np.arange(out.size)
    while todo.size:  # cycle-walking: at most a few rounds, the domain being < 4n
        out[todo] = _feistel(out[todo], half, round_keys)
        todo = todo[out[todo] >= n]
    return out.astype(np.int64)


def _feistel(x: np.ndarray, half: int, round_keys: tuple[np.uint64, ...]) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for key in round_keys:
        left, right = right, left ^ (_mix(right, key) & mask)
    return (left << np.uint64(half)) | right


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finaliser of x + key: every bit of the key and of x in every bit out
    (arrays' uint64 arithmetic wraps modulo 2**64 without a warning)."""
    z = x + key
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def windows(counts: np.ndarray, n: int, seed: int, source: int) -> np.ndarray:
    """The windows of one source's `counts`-th draws (0 the first ever): draw k is in
    epoch k // n, at that epoch's place k % n; int64, in the order given."""
    counts = np.asarray(counts, dtype=np.int64)
    out = np.empty(counts.shape, dtype=np.int64)
    epochs = counts // n
    for epoch in np.unique(epochs):  # a batch spans one epoch, or two at its turn
        at = epochs == epoch
        out[at] = permute(counts[at] % n, n, keys(seed, source, int(epoch)))
    return out
