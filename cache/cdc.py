"""Content-defined chunking over token ids.

A Gear-style rolling hash (FastCDC cut-point judgement, optional normalized chunking) picks chunk
ends from the content itself, so an insertion or deletion moves only the boundaries near it:
later boundaries shift with the text and the chunks after it keep their content. Structural
offsets (message starts, image spans) are forced boundaries; the hash never looks across them,
so a chunk depends only on the tokens of its own segment.

The hash is vectorised: ``h[i] = sum_{k<W} g(x[i-k]) * m**k mod 2**32`` over a window of W
tokens is built by log2(W) doubling steps over the whole array (m = 2 is the classic Gear shift;
the top bits, which the cut judgement reads, depend on all W tokens).
Only the loop that walks candidate cut points is Python, one step per chunk.

What this module does not do: hashing chunks into keys (``cache/keys.py``) and looking them up
(``cache/index.py``, ``cache/planner.py``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise
from typing import Any

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

    @property
    def avg_bits(self) -> int:
        return max(1, round(np.log2(self.avg_size)))

    @property
    def mask_small(self) -> int:
        """Top bits that must be zero to cut a chunk shorter than ``avg_size``."""
        return _top_bits(self.avg_bits + self.normalization)

    @property
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
        starts = np.asarray(segment_starts, dtype=np.int64)
        starts = starts[(starts > 0) & (starts < len(h))]
        nxt = np.append(starts[1:], len(h))
        near = starts[:, None] + np.arange(window - 1)
        near = near[near < nxt[:, None]]
        pos = near - np.repeat(starts, [int(x) for x in np.minimum(nxt - starts, window - 1)])
        fix = np.zeros(len(near), dtype=np.uint32)
        mk = 1
        for k in range(window - 1):
            sel = pos >= k
            fix[sel] += values[near[sel] - k] * np.uint32(mk)
            mk = (mk * multiplier) & _M32
        h[near] = fix
    return h


def _segments(n: int, forced: Iterable[int]) -> np.ndarray:
    """Sorted unique segment bounds [0, ..., n] from forced offsets in [0, n]."""
    off = np.asarray(list(forced), dtype=np.int64)
    if off.size and (off.min() < 0 or off.max() > n):
        raise ValueError(f"forced boundaries must lie in [0, {n}], got {off.min()}..{off.max()}")
    return np.unique(np.concatenate([np.array([0, n], dtype=np.int64), off]))


def gear_hash(tokens: np.ndarray, config: CDCConfig, segments: np.ndarray | None = None) -> np.ndarray:
    """Rolling hash at every position, restarted at segment bounds. [T] int64 -> [T] uint32.

    When ``min_size >= window`` no judged position has a window reaching across a segment
    start, so the restart fix-up is skipped.
    """
    starts = segments if segments is not None and config.min_size < config.window else None
    return window_hash(gear_values(tokens, config.seed), config.window, config.multiplier, starts)


def _next_cuts(
    starts: np.ndarray, small: np.ndarray, large: np.ndarray, segments: np.ndarray, cfg: CDCConfig
) -> np.ndarray:
    """End of the chunk that begins at each of ``starts`` (FastCDC judgement, vectorised).

    starts: [S] int64 in [0, T); small, large: sorted candidate ends, each closed by a sentinel
    beyond T; segments: [G + 1] bounds. Returns [S] int64.
    """
    end = segments[np.searchsorted(segments, starts, side="right")]
    lim = np.minimum(starts + cfg.max_size, end)
    c_small = small[np.searchsorted(small, starts + cfg.min_size)]
    c_large = large[np.searchsorted(large, starts + cfg.avg_size)]
    nxt = np.where(
        (c_small < starts + cfg.avg_size) & (c_small < end), c_small, np.where(c_large < lim, c_large, lim)
    )
    return np.where(end - starts <= cfg.min_size, end, nxt)


def chunk_gear(tokens: np.ndarray, config: CDCConfig, segments: np.ndarray) -> np.ndarray:
    """Gear/FastCDC chunk bounds within each segment. tokens [T] -> bounds [n_chunks + 1].

    Every chunk starts at a segment start, at a candidate end, or ``max_size`` after another
    start. The next cut is computed for all nodes of the first two kinds at once, so walking
    the chain from 0 is list indexing; only the rare ``max_size`` cuts take a slow step.
    """
    n = len(tokens)
    h = gear_hash(tokens, config, segments)
    # The hash at token i judges the chunk end i + 1.
    large = np.flatnonzero((h & np.uint32(config.mask_large)) == 0)
    small = large[(h[large] & np.uint32(config.mask_small)) == 0] + 1
    large += 1
    sentinel = np.array([n + config.max_size + 1], dtype=np.int64)
    small_s, large_s = np.concatenate([small, sentinel]), np.concatenate([large, sentinel])
    nodes = np.sort(np.concatenate([large[large < n], segments[:-1]]))
    nxt = _next_cuts(nodes, small_s, large_s, segments, config)
    nxt_node = np.searchsorted(nodes, nxt)
    nxt_node[nodes[np.minimum(nxt_node, len(nodes) - 1)] != nxt] = -1
    node_list, nxt_list, nxt_node_list = nodes.tolist(), nxt.tolist(), nxt_node.tolist()
    out, pos, i = [0], 0, 0  # i: index of pos in nodes, -1 when pos is not a node
    while pos < n:
        if i >= 0:
            pos, i = nxt_list[i], nxt_node_list[i]
        else:
            pos = int(_next_cuts(np.array([pos]), small_s, large_s, segments, config)[0])
            j = bisect_left(node_list, pos)
            i = j if j < len(node_list) and node_list[j] == pos else -1
        out.append(pos)
    return np.asarray(out, dtype=np.int64)


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
    b = [int(x) for x in bounds]
    return list(pairwise(b))
