from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cache.cdc import (
    _PRUNE_ROUNDS,
    CHUNKERS,
    CDCConfig,
    _chain,
    _cut_table,
    _segments,
    chunk_bounds,
    gear_hash,
    gear_values,
    register_chunker,
    spans,
    window_hash,
)

M32 = (1 << 32) - 1


def ref_hash(tokens: np.ndarray, cfg: CDCConfig, forced: list[int]) -> list[int]:
    """Per-token windowed hash restarted at every forced offset."""
    g = gear_values(tokens, cfg.seed).tolist()
    starts = sorted({0, *forced})
    out = []
    for i in range(len(tokens)):
        s = max(b for b in starts if b <= i)
        out.append(sum(g[i - k] * cfg.multiplier**k for k in range(cfg.window) if i - k >= s) & M32)
    return out


def ref_chunk(tokens: np.ndarray, cfg: CDCConfig, forced: list[int]) -> list[int]:
    """FastCDC as a plain loop over positions, one segment at a time."""
    h = ref_hash(tokens, cfg, forced)
    n = len(tokens)
    bounds = [0]
    seg = sorted({0, n, *forced})
    for s, e in pairwise(seg):
        pos = s
        while pos < e:
            if e - pos <= cfg.min_size:
                pos = e
            else:
                limit = min(pos + cfg.max_size, e)
                normal = min(pos + cfg.avg_size, limit)
                cut = limit
                small = [c for c in range(pos + cfg.min_size, normal) if h[c - 1] & cfg.mask_small == 0]
                large = [c for c in range(normal, limit) if h[c - 1] & cfg.mask_large == 0]
                if small:
                    cut = small[0]
                elif large:
                    cut = large[0]
                pos = cut
            bounds.append(pos)
    return bounds


def test_config_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="min_size"):
        CDCConfig(min_size=100, avg_size=64)
    with pytest.raises(ValueError, match="window"):
        CDCConfig(window=12)
    with pytest.raises(ValueError, match="multiplier"):
        CDCConfig(multiplier=4)
    assert CDCConfig().mask_small == 0xFE000000  # 7 top bits: 6 for avg 64, +1 normalization
    assert CDCConfig().mask_large == 0xF8000000


def test_window_hash_doubling_matches_direct_sum() -> None:
    rng = np.random.default_rng(0)
    v = rng.integers(0, 2**32, 300, dtype=np.uint64).astype(np.uint32)
    for window, mult in [(1, 2), (8, 2), (16, 0x01000193), (32, 2)]:
        got = window_hash(v, window, mult)
        want = [sum(int(v[i - k]) * mult**k for k in range(window) if i >= k) & M32 for i in range(300)]
        assert got.tolist() == want


@pytest.mark.parametrize("forced", [[], [5, 40, 41, 170], [1, 2, 3, 299]])
@pytest.mark.parametrize("min_size", [4, 16])
def test_gear_hash_restarts_at_segment_starts(forced: list[int], min_size: int) -> None:
    rng = np.random.default_rng(1)
    tok = rng.integers(0, 50_000, 300)
    cfg = CDCConfig(min_size=min_size, avg_size=32, max_size=128, window=8)
    got = gear_hash(tok, cfg, np.array(sorted({0, 300, *forced})))
    want = ref_hash(tok, cfg, forced)
    if min_size >= cfg.window:  # restarts are skipped where no judged window crosses them
        judged = [i for i in range(300) if i - max(b for b in [0, *forced] if b <= i) >= cfg.window - 1]
        assert got[judged].tolist() == [want[i] for i in judged]
    else:
        assert got.tolist() == want


@pytest.mark.parametrize(
    ("cfg", "forced"),
    [
        (CDCConfig(), []),
        (CDCConfig(min_size=4, avg_size=16, max_size=40, window=8, normalization=2), [3, 50, 51, 400]),
        (CDCConfig(min_size=8, avg_size=32, max_size=64, normalization=0, multiplier=0x01000193), [700]),
    ],
)
def test_gear_chunking_matches_reference_loop(cfg: CDCConfig, forced: list[int]) -> None:
    rng = np.random.default_rng(2)
    for n in [0, 1, 17, 900]:
        tok = rng.integers(0, 1000, n)
        f = [x for x in forced if x <= n]
        assert chunk_bounds(tok, cfg, f).tolist() == (ref_chunk(tok, cfg, f) if n else [0])


def test_low_entropy_input_falls_back_to_max_size_cuts() -> None:
    cfg = CDCConfig()
    b = chunk_bounds(np.full(1000, 7), cfg)
    assert b.tolist() == ref_chunk(np.full(1000, 7), cfg, [])
    assert b.tolist() == [0, 256, 512, 768, 1000]


def test_sizes_and_forced_bounds() -> None:
    rng = np.random.default_rng(3)
    tok = torch.from_numpy(rng.integers(0, 50_000, 200_000))
    forced = sorted(rng.choice(200_000, 500, replace=False).tolist())
    cfg = CDCConfig()
    b = chunk_bounds(tok, cfg, forced)
    assert set(forced) <= set(b.tolist())
    sizes = np.diff(b)
    assert sizes.min() >= 1
    assert sizes.max() <= cfg.max_size
    # Chunks shorter than min_size only end a segment.
    short_ends = b[1:][sizes < cfg.min_size]
    assert set(short_ends.tolist()) <= {*forced, 200_000}
    free = chunk_bounds(tok, cfg)
    mean = float(np.diff(free).mean())
    assert 64 <= mean <= 90, mean  # min_size skip + normalization around avg_size


def test_fixed_chunker_and_registry() -> None:
    b = chunk_bounds(list(range(150)), CDCConfig(avg_size=64), forced=[100], strategy="fixed")
    assert b.tolist() == [0, 64, 100, 150]
    assert spans(b) == [(0, 64), (64, 100), (100, 150)]
    with pytest.raises(KeyError, match="unknown chunker"):
        chunk_bounds([1, 2], strategy="nope")
    with pytest.raises(ValueError, match="already registered"):
        register_chunker("gear", CHUNKERS["gear"])
    with pytest.raises(ValueError, match="forced"):
        chunk_bounds([1, 2, 3], forced=[4])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 4000),
    at=st.floats(0, 0.999),
    k=st.integers(1, 60),
    insert=st.booleans(),
)
def test_edit_changes_only_nearby_chunks(seed: int, n: int, at: float, k: int, insert: bool) -> None:
    """Bounds before an edit stay; after it they resync (shifted) within a few chunks."""
    rng = np.random.default_rng(seed)
    cfg = CDCConfig()
    tok = rng.integers(0, 50_000, n)
    p = int(at * n)
    if insert:
        edited, delta, edit_end = np.concatenate([tok[:p], rng.integers(0, 50_000, k), tok[p:]]), k, p + k
    else:
        k = min(k, n - p - 1)
        edited, delta, edit_end = np.concatenate([tok[:p], tok[p + k :]]), -k, p
    before, after = chunk_bounds(tok, cfg).tolist(), chunk_bounds(edited, cfg).tolist()
    assert [b for b in before[:-1] if b <= p] == [b for b in after[:-1] if b <= p]
    moved = {b + delta for b in before}
    resync = next(b for b in after if b >= edit_end and b in moved)
    assert resync - edit_end <= 4 * cfg.max_size
    assert [b for b in after if b >= resync] == [b + delta for b in before if b + delta >= resync]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 500),
    vocab=st.sampled_from([1, 2, 3, 40, 50_000]),
    sizes=st.sampled_from([(1, 1, 1), (1, 2, 4), (2, 8, 32), (3, 8, 20), (4, 16, 64), (16, 64, 256)]),
    window=st.sampled_from([1, 2, 4, 8, 16]),
    normalization=st.integers(0, 2),
    multiplier=st.sampled_from([2, 0x01000193]),
    n_forced=st.integers(0, 12),
)
def test_gear_chunking_matches_reference_on_random_inputs(
    seed: int,
    n: int,
    vocab: int,
    sizes: tuple[int, int, int],
    window: int,
    normalization: int,
    multiplier: int,
    n_forced: int,
) -> None:
    """Small vocabularies give long low-entropy runs (max_size cuts) and periodic hashes."""
    assume(max(1, round(np.log2(sizes[1]))) - normalization >= 1)
    cfg = CDCConfig(*sizes, window=window, normalization=normalization, multiplier=multiplier)
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, vocab, n)
    forced = sorted(rng.integers(0, n + 1, n_forced).tolist())
    assert chunk_bounds(tok, cfg, forced).tolist() == ref_chunk(tok, cfg, forced)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 400), vocab=st.sampled_from([1, 2, 50_000]))
def test_chain_by_pruning_equals_chain_by_pointer_doubling(seed: int, n: int, vocab: int) -> None:
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, vocab, n)
    cfg = CDCConfig(2, 8, 32, 4)
    seg = _segments(n, rng.integers(0, n + 1, 3).tolist())
    table = _cut_table(gear_hash(tok, cfg, seg), cfg, seg)
    by_pruning = _chain(table, rounds=10**6)
    assert by_pruning.tolist() == _chain(table, rounds=0).tolist()
    assert by_pruning.tolist() == _chain(table).tolist()


def test_chains_that_never_merge_are_resolved() -> None:
    """Constant input whose hash is a small candidate everywhere: the chains from even and
    odd starts run side by side to the segment end, so pruning would need about n / 4 rounds
    and the chain is found by pointer doubling."""
    cfg = CDCConfig(2, 8, 32, 4)
    v = next(v for v in range(1000) if int(gear_hash(np.full(8, v), cfg)[-1]) & cfg.mask_small == 0)
    tok = np.full(4 * _PRUNE_ROUNDS + 500, v)
    b = chunk_bounds(tok, cfg, [37])
    assert b.tolist() == ref_chunk(tok, cfg, [37])
    assert np.median(np.diff(b)) == cfg.min_size


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 200),
    window=st.sampled_from([1, 2, 4, 8, 32]),
    multiplier=st.sampled_from([2, 0x01000193]),
    n_starts=st.integers(0, 20),
)
def test_window_hash_restarts_match_direct_sum(
    seed: int, n: int, window: int, multiplier: int, n_starts: int
) -> None:
    rng = np.random.default_rng(seed)
    cfg = CDCConfig(min_size=1, avg_size=32, max_size=64, window=window, multiplier=multiplier)
    tok = rng.integers(0, 50_000, n)
    starts = sorted(set(rng.integers(0, n + 1, n_starts).tolist()))
    got = window_hash(gear_values(tok), window, multiplier, np.array(sorted({0, n, *starts})))
    assert got.tolist() == ref_hash(tok, cfg, starts)
