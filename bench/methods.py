"""The methods the benchmarks compare, built in one place, and which of them are oracles.

Every benchmark rebuilds a context's KV several ways and compares each with a full prefill of
the prompt it serves:

- reference: ``reprefill``, everything prefilled (:func:`full_prefill`, :func:`reprefill`);
- exact: ``prefix``, the longest unchanged leading run reused (:class:`PrefixCache`);
- deployable: ``blind``, each chunk's canonical KV rotated to its start (:func:`place`);
  ``stored-r<m>``, canonical + the patch fitted where the chunk was first seen
  (:func:`patch_and_place`); ``orbit-r<m>``, canonical + one patch fitted to the chunk's KV
  under other orders of its set, never the served one (:func:`orbit_patch_and_place`);
  ``cacheblend-<pct>``, ``epic-<k>``, ``first-k``: blind, then the
  tokens that deviate most at layer 1, or the first k of each chunk, recomputed
  (:func:`recompute_selections`);
- oracle: ``patch-r<m>``, ``patch-budget-*``, ``patched``: canonical + a patch fitted to the
  chunk's KV in the served prompt's own full prefill (:func:`patch_and_place` given the
  reference's conditioned KV).

An oracle needs the full prefill of the very request being served, so it is an upper bound for
a figure and never a product path. The benchmarks mark each method with
``"oracle": true|false`` in their JSON, list the names apart (``deployable``, ``oracle``) and
print the oracles in a table of their own (:func:`split_oracles`).

Tensor shapes: per-layer KV is ``[L, H, N, D]``; a chunk's KV is pre-RoPE (``cache.layout``)
until placed, post-RoPE after.

Not here: scoring answers (each benchmark's own), the selective recompute itself
(``agent/recompute.py``), fitting patches (``cache/patch.py``).
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from agent.adapters.base import ChunkInput, ModelAdapter, TextInput
from agent.adapters.vision import VisionAdapter
from agent.recompute import DeviationSelection, FixedSelection, Selection, first_tokens
from cache.layout import ChunkKV
from cache.orbit import Delta, fit_orbit
from cache.patch import KV, Patch, PatchConfig, apply_and_place, fit_delta
from cache.rope import RopeSpec

KV_STORAGE_BYTES = 2  # chunk KV and patches are both counted at float16

# --- comparing with the reference -------------------------------------------------------


def kl_rows(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(ref || got) per row of two logit tensors ``[..., V]``, in float64 (``[...]``)."""
    lp, lq = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) of two next-token distributions given as logits ``[V]``."""
    return float(kl_rows(p_logits, q_logits))


def split_oracles(methods: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    """The names of the deployable methods and of the oracles (``"oracle": true``), in order."""
    deployable = [name for name, m in methods.items() if not m.get("oracle")]
    return deployable, [name for name in methods if name not in deployable]


# --- the reference: a full prefill ------------------------------------------------------


class FullPrefill(NamedTuple):
    """A prefix, then each chunk in order, prefilled on one cache.

    k, v: post-RoPE ``[L, H, N, D]`` of the whole context; conditioned: each chunk's KV in
    that context (pre-RoPE, ``KV(B|A)``); prefill_s: each chunk's prefill time; seconds: the
    whole pass, the prefix included.
    """

    k: torch.Tensor
    v: torch.Tensor
    conditioned: list[ChunkKV]
    prefill_s: list[float]
    seconds: float


def layers_kv(cache: Any, n_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE ``[L, H, N, D]`` keys and values held by an HF cache (batch 0)."""
    layers = cache.layers[:n_layers]
    return torch.stack([lay.keys[0] for lay in layers]), torch.stack([lay.values[0] for lay in layers])


def full_prefill(adapter: ModelAdapter, prefix: ChunkInput, chunks: Sequence[ChunkInput]) -> FullPrefill:
    """Prefill ``prefix``, then each of ``chunks`` at the position its predecessors reach."""
    t0 = time.perf_counter()
    out = adapter.prefill(prefix, adapter.empty_cache(), 0)
    pos, conditioned, prefill_s = out.kv.extent, [], []
    for chunk in chunks:
        t = time.perf_counter()
        kv = adapter.prefill(chunk, out.cache, pos).kv
        prefill_s.append(time.perf_counter() - t)
        conditioned.append(kv)
        pos += kv.extent
    seconds = time.perf_counter() - t0
    k, v = layers_kv(out.cache, adapter.info.n_layers)
    return FullPrefill(k, v, conditioned, prefill_s, seconds)


# --- placing stored chunks: blind and patched -------------------------------------------


class Placed(NamedTuple):
    """One chunk placed: post-RoPE ``kv``, seconds to fit its patch (0 without one) and to apply
    and place it, and the patch's bytes."""

    kv: KV
    fit_s: float = 0.0
    place_s: float = 0.0
    patch_bytes: int = 0


def place(chunk: ChunkKV, start: int, spec: RopeSpec) -> Placed:
    """Blind reuse: the chunk's KV rotated to ``start``, nothing else changed."""
    t0 = time.perf_counter()
    kv = KV(*chunk.place(start, spec))
    return Placed(kv, place_s=time.perf_counter() - t0)


def delta(conditioned: ChunkKV, canonical: ChunkKV) -> tuple[torch.Tensor, torch.Tensor]:
    """``Δ = KV(B|A) − KV(B|∅)`` in the pre-RoPE frame: keys and values, ``[L, H, T, D]`` each."""
    return conditioned.k - canonical.k, conditioned.v - canonical.v


def patch_and_place(
    chunk: ChunkKV, deltas: tuple[torch.Tensor, torch.Tensor], start: int, spec: RopeSpec, config: PatchConfig
) -> Placed:
    """Canonical + the low-rank patch of ``deltas`` fitted by ``config``, placed at ``start``.

    Whether this is deployable depends only on where ``deltas`` came from: the KV the chunk had
    where it was first encoded (a stored patch), or its KV in the served prompt's full prefill
    (an oracle).
    """
    t0 = time.perf_counter()
    patch = fit_delta(deltas[0], deltas[1], config).patch
    return _place_patched(chunk, patch, start, spec, time.perf_counter() - t0)


def orbit_patch_and_place(
    chunk: ChunkKV, deltas: Sequence[Delta], start: int, spec: RopeSpec, config: PatchConfig
) -> Placed:
    """Canonical + one orbit patch fitted to the chunk's ``deltas`` under other orders of its set
    (``cache/orbit.py``, the mean method), placed at ``start``. Deployable when none of ``deltas``
    comes from the served order."""
    t0 = time.perf_counter()
    patch = fit_orbit(deltas, config).patch
    return _place_patched(chunk, patch, start, spec, time.perf_counter() - t0)


def _place_patched(chunk: ChunkKV, patch: Patch, start: int, spec: RopeSpec, fit_s: float) -> Placed:
    t0 = time.perf_counter()
    kv = apply_and_place(chunk.k, chunk.v, patch, chunk.placed_positions(start), spec)
    return Placed(kv, fit_s, time.perf_counter() - t0, patch.nbytes)


def concat_kv(
    prefix: tuple[torch.Tensor, torch.Tensor], parts: Iterable[KV]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix's and the placed chunks' post-RoPE ``(k, v)`` side by side along tokens."""
    parts = list(parts)
    k = torch.cat([prefix[0], *[p[0] for p in parts]], 2)
    return k, torch.cat([prefix[1], *[p[1] for p in parts]], 2)


def recompute_selections(
    cacheblend: Iterable[float],
    epic: Iterable[int],
    candidates: torch.Tensor,
    starts: Sequence[int],
    lengths: Sequence[int],
) -> dict[str, Selection]:
    """``cacheblend-<pct>``: the ``pct`` % of ``candidates`` deviating most at layer 1;
    ``epic-<k>``: the first k tokens of every chunk but the first (``starts`` are token indices)."""
    out: dict[str, Selection] = {
        f"cacheblend-{pct:g}": DeviationSelection(pct / 100, candidates) for pct in cacheblend
    }
    for k in epic:
        out[f"epic-{k}"] = FixedSelection(first_tokens(starts[1:], lengths[1:], k))
    return out


# --- serving baselines: a full prefill and an exact-prefix cache, as an engine runs them --


PIECE_TOKENS = 1024


def first_token(adapter: ModelAdapter, question: TextInput, cache: Any, start: int) -> tuple[int, float]:
    t = time.perf_counter()
    logits = adapter.next_logits(question, cache, start)
    return int(logits.argmax()), time.perf_counter() - t


def feed(adapter: ModelAdapter, chunks: list[ChunkInput], cache: Any, start: int) -> tuple[int, int]:
    """Prefill ``chunks`` in order onto ``cache`` as a serving engine would (text runs joined into
    one forward pass, last-token logits only, no KV taken out). Returns the next start and the
    greedy token after the last chunk.

    On a cache that already holds tokens, a long text run goes in pieces of ``PIECE_TOKENS``
    (chunked prefill): transformers builds a dense ``new x (past + new)`` mask there and takes a
    slower attention path than the causal one it uses on an empty cache, so one pass of 8k new
    tokens after a short reused prefix would cost about twice a re-prefill of everything.
    """
    runs: list[ChunkInput] = []
    for c in chunks:
        if runs and isinstance(c, TextInput) and isinstance(runs[-1], TextInput):
            runs[-1] = adapter.text(torch.cat([runs[-1].ids, c.ids]))
        else:
            runs.append(c)
    token = -1
    for c in runs:
        pieces = [c]
        if isinstance(c, TextInput) and adapter.cache_length(cache) > 0:
            pieces = [adapter.text(p) for p in c.ids.split(PIECE_TOKENS)]
        for piece in pieces:
            token = int(adapter.next_logits(piece, cache, start).argmax())
            start += adapter.chunk_positions(piece)[1]
    return start, token


def forget_images(adapter: ModelAdapter) -> None:
    """Empty the vision feature cache, so the next image prefill runs the encoder as a baseline would."""
    if isinstance(adapter, VisionAdapter):
        adapter.clear_vision_cache()


def reprefill(
    adapter: ModelAdapter, prefix: ChunkInput, window: list[ChunkInput], q: TextInput
) -> tuple[int, float]:
    forget_images(adapter)
    t = time.perf_counter()
    _, tok = feed(adapter, [prefix, *window, q], adapter.empty_cache(), 0)
    return tok, time.perf_counter() - t


class PrefixCache:
    """Exact-prefix reuse over earlier windows: the longest common leading run of chunk ids."""

    def __init__(self, adapter: ModelAdapter, keep: int = 6) -> None:
        self.adapter, self.keep = adapter, keep
        self.entries: list[tuple[list[str], Any, list[int]]] = []  # ids, cache, cumulative extents

    def run(
        self, prefix: ChunkInput, ids: list[str], window: list[ChunkInput], q: TextInput
    ) -> tuple[int, float, int]:
        forget_images(self.adapter)
        key = ["prefix", *ids]
        best, best_len = None, 0
        for entry in self.entries:
            n = 0
            while n < min(len(entry[0]), len(key)) and entry[0][n] == key[n]:
                n += 1
            if n > best_len:
                best, best_len = entry, n
        chunks = [prefix, *window]
        # the reused prefix is taken as is (a radix cache shares its pages; the copy made
        # here so the entry stays intact is not timed)
        if best is None:
            cache, start, done = self.adapter.empty_cache(), 0, 0
        else:
            cache = copy.deepcopy(best[1])
            start = best[2][best_len - 1]
            cache.crop(start - self.adapter.cache_length(cache))  # drop what follows the shared run
            done = best_len
        t = time.perf_counter()
        todo = chunks[done:]
        _, tok = feed(self.adapter, [*todo, q], cache, start)
        elapsed = time.perf_counter() - t
        extents = list(itertools.accumulate(self.adapter.chunk_positions(c)[1] for c in chunks))
        cache.crop(-q.n_tokens)
        snapshot = copy.deepcopy(cache)
        self.entries = [*self.entries[-(self.keep - 1) :], (key, snapshot, extents)]
        return tok, elapsed, sum(c.n_tokens for c in chunks[done:])
