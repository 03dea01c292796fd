"""Seeded pseudo-random permutations of [0, n), computed index by index (a Feistel network with cycle
walking): a shard's documents are shuffled with O(1) memory and a reader's position is an integer.
Logical shards are contiguous ranges of a dataset's documents in file order."""

from __future__ import annotations

import numpy as np

_ROUNDS = 4
_MUL = np.uint64(0x9E3779B97F4A7C15)
_MUL2 = np.uint64(0xBF58476D1CE4E5B9)


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """A splitmix64-style hash of x under key (uint64 arithmetic wraps)."""
    z = (x ^ key) * _MUL
    z ^= z >> np.uint64(31)
    z *= _MUL2
    return z ^ (z >> np.uint64(29))


def round_keys(seed: int, *salt: int) -> np.ndarray:
    """The Feistel round keys for one (seed, salt...) permutation."""
    ss = np.random.SeedSequence([seed & 0xFFFFFFFF, *[s & 0xFFFFFFFF for s in salt]])
    return ss.generate_state(_ROUNDS, dtype=np.uint64)


def permute(positions: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """The images of `positions` (ints in [0, n)) under the permutation of [0, n) given by keys."""
    half = max(1, (max(1, n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    x = positions.astype(np.uint64)
    todo = np.ones(len(x), dtype=bool)
    while todo.any():  # cycle walking: re-permute the values that fall outside [0, n)
        left, right = x[todo] >> np.uint64(half), x[todo] & mask
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & mask)
        x[todo] = (left << np.uint64(half)) | right
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


def shard_bounds(n_docs: int, n_shards: int, shard: int) -> tuple[int, int]:
    """Documents [lo, hi) (in file order) of logical shard `shard` of n_shards."""
    return shard * n_docs // n_shards, (shard + 1) * n_docs // n_shards
