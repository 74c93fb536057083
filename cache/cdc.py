"""Content-defined chunking over token ids.

A Gear-style rolling hash (FastCDC cut-point judgement, optional normalized chunking) picks chunk
ends from the content itself, so an insertion or deletion moves only the boundaries near it:
later boundaries shift with the text and the chunks after it keep their content. Structural
offsets (message starts, image spans) are forced boundaries; the hash never looks across them,
so a chunk depends only on the tokens of its own segment.

The hash is vectorised: ``h[i] = sum_{k<W} g(x[i-k]) * m**k mod 2**32`` over a window of W
tokens is built by log2(W) doubling steps over the whole array (m = 2 is the classic Gear shift;
the top bits, which the cut judgement reads, depend on all W tokens).
So are the cuts: the next cut is computed at once for every position a chunk can start at, and
the chain of cuts from 0 is extracted from that table by array passes (see :func:`_chain`); no
Python step runs per chunk.

What this module does not do: hashing chunks into keys (``cache/keys.py``) and looking them up
(``cache/index.py``, ``cache/planner.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np
import torch

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
TokenIds = Sequence[int] | np.ndarray | torch.Tensor
ChunkFn = Callable[[np.ndarray, "CDCConfig", np.ndarray], np.ndarray]


@dataclass(frozen=True)
class CDCConfig:
    """Chunk sizes in tokens and hash settings; validated on construction.

    ``normalization`` is FastCDC's level: a chunk shorter than ``avg_size`` needs
    ``avg_bits + normalization`` zero bits to end, a longer one ``avg_bits - normalization``,
    which narrows the size distribution around ``avg_size``.
    """

    min_size: int = 16
    avg_size: int = 64
    max_size: int = 256
    window: int = 16
    normalization: int = 1
    multiplier: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_size <= self.avg_size <= self.max_size:
            raise ValueError(
                f"need 1 <= min_size <= avg_size <= max_size, got "
                f"{self.min_size}/{self.avg_size}/{self.max_size}"
            )
        if self.window < 1 or self.window > 32 or self.window & (self.window - 1):
            raise ValueError(f"window must be a power of two in [1, 32], got {self.window}")
        if not 0 <= self.normalization <= 3:
            raise ValueError(f"normalization must be in [0, 3], got {self.normalization}")
        if self.avg_bits - self.normalization < 1:
            raise ValueError(f"avg_size {self.avg_size} too small for normalization {self.normalization}")
        if self.avg_bits + self.normalization > 24:
            raise ValueError(f"avg_size {self.avg_size} too large for a 32-bit hash")
        if self.multiplier % 2 == 0 and self.multiplier != 2:
            raise ValueError(f"multiplier must be 2 (Gear) or odd, got {self.multiplier}")

    @cached_property
    def avg_bits(self) -> int:
        return max(1, round(np.log2(self.avg_size)))

    @cached_property
    def mask_small(self) -> int:
        """Top bits that must be zero to cut a chunk shorter than ``avg_size``."""
        return _top_bits(self.avg_bits + self.normalization)

    @cached_property
    def mask_large(self) -> int:
        """Top bits that must be zero to cut a chunk of ``avg_size`` or more."""
        return _top_bits(self.avg_bits - self.normalization)


def _top_bits(n: int) -> int:
    return (_M32 >> (32 - n)) << (32 - n)


def as_token_array(tokens: TokenIds) -> np.ndarray:
    """Token ids as a 1-D int64 array (no copy when already one)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    return arr


def splitmix64(x: np.ndarray, seed: int = 0) -> np.ndarray:
    """splitmix64 finaliser of ``x + seed``: [N] -> [N] uint64 (wrapping arithmetic)."""
    z = x.astype(np.uint64)
    z += np.uint64((0x9E3779B97F4A7C15 * (seed + 1)) & _M64)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


@lru_cache(maxsize=8)
def _gear_table(seed: int, size: int) -> np.ndarray:
    table = (splitmix64(np.arange(size, dtype=np.uint64), seed) >> np.uint64(32)).astype(np.uint32)
    table.flags.writeable = False
    return table


def gear_values(tokens: np.ndarray, seed: int = 0) -> np.ndarray:
    """Pseudo-random 32-bit value per token id: [T] int64 -> [T] uint32.

    Gear's byte table widened to the vocabulary (a table of the next power of two above the
    largest id, filled by splitmix64), so the per-token cost is one gather.
    """
    if tokens.size == 0:
        return np.zeros(0, dtype=np.uint32)
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0:
        raise ValueError(f"token ids must be non-negative, got {lo}")
    size = 1 << max(16, hi.bit_length())
    return _gear_table(seed, size)[tokens]


def window_hash(
    values: np.ndarray, window: int, multiplier: int = 2, segment_starts: np.ndarray | None = None
) -> np.ndarray:
    """Windowed polynomial hash ``h[i] = sum_{k<window, i-k>=s(i)} v[i-k] * multiplier**k mod 2**32``.

    values: [T] uint32; segment_starts: sorted offsets where the hash restarts (s(i) is the last
    one <= i; None or empty: only 0). window must be a power of two. Returns [T] uint32.
    Built by doubling, ``h_2w[i] = h_w[i] + m**w * h_w[i-w]``, then the few positions whose
    window reaches across a segment start are recomputed directly.
    """
    h = values.copy()
    tmp = np.empty_like(h)
    w, mult = 1, multiplier & _M32
    while w < window:
        np.multiply(h[:-w], np.uint32(mult), out=tmp[w:])
        h[w:] += tmp[w:]
        w, mult = 2 * w, (mult * mult) & _M32
    if segment_starts is not None and len(segment_starts) and window > 1:
        n = len(h)
        starts = np.asarray(segment_starts, dtype=np.int64)
        starts = starts[(starts > 0) & (starts < n)]
        near = starts[:, None] + np.arange(window - 1)  # [G, W - 1]: s + o, o < W - 1
        inside = near < np.append(starts[1:], n)[:, None]
        fix = values[np.minimum(near, n - 1)]
        # h[s + o] = sum_{j <= o} v[s + j] * m**(o - j): Horner along the offsets.
        for o in range(1, window - 1):
            fix[:, o] += fix[:, o - 1] * np.uint32(multiplier & _M32)
        h[near[inside]] = fix[inside]
    return h


def _segments(n: int, forced: Iterable[int]) -> np.ndarray:
    """Sorted unique segment bounds [0, ..., n] from forced offsets in [0, n]."""
    off = np.asarray(forced if isinstance(forced, np.ndarray) else list(forced), dtype=np.int64)
    if off.size and (off.min() < 0 or off.max() > n):
        raise ValueError(f"forced boundaries must lie in [0, {n}], got {off.min()}..{off.max()}")
    return _dedupe_sorted(np.sort(np.concatenate([np.array([0, n], dtype=np.int64), off])))


def _dedupe_sorted(x: np.ndarray) -> np.ndarray:
    """``x`` [K] sorted, without repeats (np.unique does not know it is sorted: slower)."""
    keep = np.empty(len(x), dtype=bool)
    keep[:1] = True
    np.not_equal(x[1:], x[:-1], out=keep[1:])
    return x[keep]


def gear_hash(tokens: np.ndarray, config: CDCConfig, segments: np.ndarray | None = None) -> np.ndarray:
    """Rolling hash at every position, restarted at segment bounds. [T] int64 -> [T] uint32.

    When ``min_size >= window`` no judged position has a window reaching across a segment
    start, so the restart fix-up is skipped.
    """
    starts = segments if segments is not None and config.min_size < config.window else None
    return window_hash(gear_values(tokens, config.seed), config.window, config.multiplier, starts)


class _Candidates(NamedTuple):
    """Where chunks may end, in forms cheap to query for many starts at once.

    nodes: [M + 1] sorted positions in [0, T) that can start a chunk before any ``max_size``
    cut (segment starts and candidate ends; every small candidate is also a large one), then a
    sentinel past every query; first_node: [T + avg_size], index in ``nodes`` of the first node
    >= p (M past the last one); small: [S + 1] positions of the nodes that are small
    candidates, then the sentinel; small_rank: [M + 1], small candidates among nodes[:j];
    seg_end: [T] end of the segment holding each position.
    """

    nodes: np.ndarray
    first_node: np.ndarray
    small: np.ndarray
    small_rank: np.ndarray
    seg_end: np.ndarray


def _position_dtype(n: int, config: CDCConfig) -> type[np.signedinteger[Any]]:
    """int32 when every position and sentinel fits: half the memory traffic of int64."""
    return np.int32 if n + config.max_size + 1 < 2**31 else np.int64


def _candidates(h: np.ndarray, config: CDCConfig, segments: np.ndarray) -> _Candidates:
    """Candidate cut points from the hash [T] (h[i] judges the chunk end i + 1)."""
    n = len(h)
    pos = _position_dtype(n, config)
    node = np.empty(n, dtype=bool)
    node[0] = True
    np.equal(h[:-1] & np.uint32(config.mask_large), 0, out=node[1:])
    node[segments[:-1]] = True
    nodes = np.flatnonzero(node).astype(pos)
    first_node = np.empty(n + config.avg_size, dtype=pos)
    first_node[0] = 0
    np.cumsum(node[:-1], out=first_node[1:n])
    first_node[n:] = len(nodes)
    is_small = (h[nodes - 1] & np.uint32(config.mask_small)) == 0
    is_small[0] = False  # nodes[0] is 0, which ends no chunk (h[-1] is not its judge)
    small_rank = np.empty(len(nodes) + 1, dtype=pos)
    small_rank[0] = 0
    np.cumsum(is_small, out=small_rank[1:])
    sentinel = np.array([n + config.max_size + 1], dtype=pos)
    return _Candidates(
        np.concatenate([nodes, sentinel]),
        first_node,
        np.concatenate([nodes[is_small], sentinel]),
        small_rank,
        np.repeat(segments[1:].astype(pos), np.diff(segments)),
    )


def _next_cuts(x: np.ndarray, cand: _Candidates, cfg: CDCConfig) -> np.ndarray:
    """End of the chunk that starts at each of ``x`` ([K] in [0, T)), FastCDC judgement: the
    first small candidate in [x + min_size, x + avg_size), else the first large one in
    [x + avg_size, x + max_size), else x + max_size; never past the segment end."""
    end = cand.seg_end[x]
    lim = np.minimum(x + cfg.max_size, end)
    c_small = cand.small[cand.small_rank[cand.first_node[x + cfg.min_size]]]
    c_large = cand.nodes[cand.first_node[x + cfg.avg_size]]  # segment starts there are >= end
    nxt = np.where(c_large < lim, c_large, lim)
    nxt = np.where((c_small < x + cfg.avg_size) & (c_small < end), c_small, nxt)
    return np.where(end - x <= cfg.min_size, end, nxt)


def _cut_table(h: np.ndarray, config: CDCConfig, segments: np.ndarray) -> np.ndarray:
    """Next cut from every position a chunk can start at: [T + 1], 0 elsewhere, T at T.

    Starts are the candidate nodes and, closed under the table, the ``max_size`` cuts. A cut
    that lands off the nodes seeds a run of ``max_size`` steps, added in one go up to the first
    node that can stop it, so a low-entropy stretch takes one round, not one per cut.
    """
    n = len(h)
    cand = _candidates(h, config, segments)
    table = np.zeros(n + 1, dtype=cand.nodes.dtype)
    table[n] = n
    starts = cand.nodes[:-1]
    while True:
        cuts = _next_cuts(starts, cand, config)
        table[starts] = cuts
        seeds = cuts[table[cuts] == 0]
        if not seeds.size:
            return table
        seeds = _dedupe_sorted(np.sort(seeds))
        # The run of max_size cuts from a seed goes on at least until the first node past its
        # min_size (a guess that only adds starts: each still gets its cut from _next_cuts).
        stop = np.minimum(cand.nodes[cand.first_node[seeds + config.min_size]], cand.seg_end[seeds] - 1)
        runs = (stop - seeds) // config.max_size + 1
        step = np.arange(runs.sum()) - np.repeat(np.cumsum(runs) - runs, runs)
        starts = np.repeat(seeds, runs) + config.max_size * step


# Pruning rounds before the chain is followed by pointer doubling. A round removes one node
# from each chain that has not yet merged into the chain from 0; on random and real text they
# merge within 5 to 12 rounds. Periodic input can hold chains that never merge before the
# segment end (one round per chunk), so after this many rounds the O(M log M) doubling takes over.
_PRUNE_ROUNDS = 16


def _chain(table: np.ndarray, rounds: int = _PRUNE_ROUNDS) -> np.ndarray:
    """Positions 0, table[0], table[table[0]], ... up to T = len(table) - 1: [n_chunks + 1].

    ``table`` must be non-decreasing over its non-zero entries with table[x] > x (FastCDC's next
    cut is: a later start never cuts earlier). Then each node's image keeps the order, so a
    round ``s <- {0} | table[s]`` deduplicates by comparing neighbours; it drops every node no
    earlier node cuts to, and its fixed point is exactly the chain from 0.
    """
    n = len(table) - 1
    s = np.flatnonzero(table != 0)  # intp: gathers with it are faster than with int32
    for _ in range(rounds):
        img = table[s]
        nxt = np.concatenate([s[:1], img[:1], img[1:][img[1:] != img[:-1]]])
        if len(nxt) == len(s):
            return s
        s = nxt
    # Pointer doubling over what is left: jumps[k][i] is 2**k steps from s[i].
    jumps = [np.searchsorted(s, table[s])]
    while 1 << len(jumps) < len(s):
        jumps.append(jumps[-1][jumps[-1]])
    path = np.zeros(1, dtype=np.intp)
    for jump in reversed(jumps):  # path holds the nodes 0, 2**k, 2 * 2**k, ... steps from 0
        path = np.stack([path, jump[path]], axis=1).reshape(-1)
    out = s[path]
    return out[: np.searchsorted(out, n) + 1]


def chunk_gear(tokens: np.ndarray, config: CDCConfig, segments: np.ndarray) -> np.ndarray:
    """Gear/FastCDC chunk bounds within each segment. tokens [T] -> bounds [n_chunks + 1].

    The next cut is computed for every position a chunk can start at, all at once
    (:func:`_cut_table`); the chain of cuts from 0 is then found without a step per chunk
    (:func:`_chain`).
    """
    return _chain(_cut_table(gear_hash(tokens, config, segments), config, segments)).astype(np.int64)


def chunk_fixed(tokens: np.ndarray, config: CDCConfig, segments: np.ndarray) -> np.ndarray:
    """Fixed ``avg_size`` chunks restarted at every segment bound (the baseline CDC must beat)."""
    parts = [np.arange(s, e, config.avg_size) for s, e in pairwise(segments)]
    return np.concatenate([*parts, np.array([len(tokens)], dtype=np.int64)]).astype(np.int64)


CHUNKERS: dict[str, ChunkFn] = {"gear": chunk_gear, "fixed": chunk_fixed}


def register_chunker(name: str, fn: ChunkFn) -> None:
    """Add a chunking strategy ``fn(tokens [T], config, segments [S+1]) -> bounds``."""
    if name in CHUNKERS:
        raise ValueError(f"chunker {name!r} already registered")
    CHUNKERS[name] = fn


def chunk_bounds(
    tokens: TokenIds,
    config: CDCConfig | None = None,
    forced: Iterable[int] = (),
    strategy: str = "gear",
) -> np.ndarray:
    """Chunk bounds of a token sequence.

    tokens: [T] ids; forced: offsets in [0, T] that must be bounds. Returns [n_chunks + 1]
    int64, strictly increasing from 0 to T (just [0] for an empty sequence); chunk c is
    ``tokens[b[c]:b[c+1]]``. Raises KeyError for an unknown strategy.
    """
    try:
        fn = CHUNKERS[strategy]
    except KeyError:
        raise KeyError(f"unknown chunker {strategy!r}; known: {sorted(CHUNKERS)}") from None
    arr = as_token_array(tokens)
    if arr.size == 0:
        return np.zeros(1, dtype=np.int64)
    return fn(arr, config or CDCConfig(), _segments(len(arr), forced))


def spans(bounds: np.ndarray | Sequence[Any]) -> list[tuple[int, int]]:
    """[(start, end), ...] from bounds [n + 1]."""
    b = bounds.tolist() if isinstance(bounds, np.ndarray) else [int(x) for x in bounds]
    return list(pairwise(b))
