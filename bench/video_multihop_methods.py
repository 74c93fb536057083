"""The contexts video-multihop compares: each method's KV for one case, from the shared builders
of ``bench/methods.py``.

``reprefill`` is the reference; ``patch-r<m>`` fits its patches to the pieces' KV in that very
prefill, an **oracle**; ``blind``, ``stored-r<m>`` (patches from where each piece was first
encoded), ``cacheblend-<pct>`` and ``epic-<k>`` are deployable. :class:`Built` carries the mark.

Not here: asking the questions and scoring them (``video_multihop_eval.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from agent.adapters.base import ChunkInput, ImageInput, TextInput
from agent.adapters.qwen_vl import QwenVLAdapter
from agent.recompute import selective_recompute
from bench.methods import (
    KV_STORAGE_BYTES,
    concat_kv,
    delta,
    full_prefill,
    patch_and_place,
    place,
    recompute_selections,
)
from bench.video_multihop_layout import (
    SCENARIOS,
    Case,
    Piece,
)
from cache.layout import ChunkKV
from cache.patch import PatchConfig
from cache.rank import rank_strategy


@dataclass(frozen=True)
class VideoConfig:
    """What to compare. cacheblend: % of piece tokens recomputed; epic: first-k per piece."""

    ranks: tuple[int, ...] = (8, 16, 32)
    cacheblend: float = 15.0
    epic: int = 1
    stored: bool = True
    max_new_tokens: int = 2
    scenarios: tuple[str, ...] = SCENARIOS
    seed: int = 0  # the reorder scenario's permutation (video_multihop_layout.shuffled_order)

    def __post_init__(self) -> None:
        if not self.ranks or any(r <= 0 for r in self.ranks):
            raise ValueError(f"ranks must be positive, got {self.ranks}")
        if not 0 < self.cacheblend <= 100 or self.epic <= 0:
            raise ValueError("cacheblend lies in (0, 100] and epic k is positive")
        bad = [s for s in self.scenarios if s not in SCENARIOS]
        if bad or not self.scenarios:
            raise ValueError(f"scenarios must be among {SCENARIOS}, got {self.scenarios}")
        if self.max_new_tokens <= 0:
            raise ValueError("max_new_tokens must be positive")

    def method_names(self) -> list[str]:
        names = ["reprefill", "blind", *[f"patch-r{m}" for m in self.ranks]]
        if self.stored:
            names.append(f"stored-r{max(self.ranks)}")
        return [*names, f"cacheblend-{self.cacheblend:g}", f"epic-{self.epic}"]


class ContextPass(NamedTuple):
    """A full prefill of prefix + pieces: post-RoPE ``k, v [L, H, N, D]``, each piece's
    conditioned KV (pre-RoPE) by name, wall time and vision encoder runs."""

    k: torch.Tensor
    v: torch.Tensor
    conditioned: dict[str, ChunkKV]
    seconds: float
    encoder_calls: int


class Placement(NamedTuple):
    """Where pieces go: ``starts`` in position units (extents), ``token_starts`` in the cache,
    ``positions`` int64 ``[3, N]`` of the whole context, ``end`` the question's start."""

    starts: list[int]
    token_starts: list[int]
    lengths: list[int]
    positions: torch.Tensor
    end: int
    n_prefix: int


def context_pass(adapter: QwenVLAdapter, prefix: TextInput, pieces: Sequence[Piece]) -> ContextPass:
    """Prefill the prefix, then each piece in order on one cache."""
    calls = adapter.vision_encoder_calls
    ref = full_prefill(adapter, prefix, [piece.chunk for piece in pieces])
    conditioned = {piece.name: kv for piece, kv in zip(pieces, ref.conditioned, strict=True)}
    return ContextPass(ref.k, ref.v, conditioned, ref.seconds, adapter.vision_encoder_calls - calls)


def placement(adapter: QwenVLAdapter, prefix: TextInput, pieces: Sequence[Piece]) -> Placement:
    rel, pos = adapter.chunk_positions(prefix)
    positions, starts, token_starts, lengths = [rel], [], [], []
    tokens = prefix.n_tokens
    for piece in pieces:
        rel, extent = adapter.chunk_positions(piece.chunk)
        starts.append(pos)
        token_starts.append(tokens)
        lengths.append(piece.chunk.n_tokens)
        positions.append(rel + pos)
        pos += extent
        tokens += piece.chunk.n_tokens
    return Placement(starts, token_starts, lengths, torch.cat(positions, dim=1), pos, prefix.n_tokens)


def content_id(chunk: ChunkInput) -> str:
    if isinstance(chunk, ImageInput):
        return chunk.content_key
    return "text:" + ",".join(str(i) for i in chunk.ids.tolist())


class Store:
    """Canonical KV (each chunk encoded alone at 0) by content; the encoder runs once per frame."""

    def __init__(self, adapter: QwenVLAdapter) -> None:
        self.adapter = adapter
        self.canonical: dict[str, ChunkKV] = {}

    def get(self, chunk: ChunkInput) -> ChunkKV:
        key = content_id(chunk)
        if key not in self.canonical:
            self.canonical[key] = self.adapter.encode(chunk)
        return self.canonical[key]

    def embeds(self, chunks: Sequence[ChunkInput]) -> torch.Tensor:
        """Input embeddings ``[N, hidden]``: vision features from the feature cache at image pads."""
        return torch.cat([self.adapter.embed(chunk) for chunk in chunks])


class Built(NamedTuple):
    """A method's context KV (post-RoPE ``[L, H, N, D]``), build time, share of piece tokens
    recomputed, offline patch-fitting time, patch bytes over the pieces' KV bytes (both at
    float16), and whether it is an oracle (built from this very prompt's full prefill)."""

    k: torch.Tensor
    v: torch.Tensor
    seconds: float
    recompute: float = 0.0
    fit_seconds: float = 0.0
    bytes_ratio: float = 0.0
    oracle: bool = False


def build_methods(
    adapter: QwenVLAdapter,
    store: Store,
    case: Case,
    prefix: TextInput,
    ref: ContextPass,
    origin: dict[str, ChunkKV],
    config: VideoConfig,
) -> dict[str, Built]:
    """Every method's context for the case's target; ``origin``: conditioned KV where first seen."""
    at = placement(adapter, prefix, case.target)
    pk = (ref.k[:, :, : at.n_prefix], ref.v[:, :, : at.n_prefix])
    spec = adapter.spec
    out = {"reprefill": Built(ref.k, ref.v, ref.seconds, recompute=1.0)}  # timed by direct_ttft

    canon = [store.get(p.chunk) for p in case.target]  # the store's, encoded before any question
    t0 = time.perf_counter()
    blind = concat_kv(pk, [place(c, s, spec).kv for c, s in zip(canon, at.starts, strict=True)])
    out["blind"] = Built(*blind, time.perf_counter() - t0)

    def patched(conditioned: dict[str, ChunkKV], rank: int, oracle: bool) -> Built:
        cfg = PatchConfig(rank=rank_strategy("fixed", rank=rank))
        placed = [
            patch_and_place(c, delta(conditioned[piece.name], c), start, spec, cfg)
            for piece, c, start in zip(case.target, canon, at.starts, strict=True)
        ]
        kv_bytes = sum(KV_STORAGE_BYTES * (c.k.numel() + c.v.numel()) for c in canon)
        ratio = sum(pl.patch_bytes for pl in placed) / max(1, kv_bytes)
        fit_s, apply_s = sum(pl.fit_s for pl in placed), sum(pl.place_s for pl in placed)
        k, v = concat_kv(pk, [pl.kv for pl in placed])
        return Built(k, v, apply_s, fit_seconds=fit_s, bytes_ratio=ratio, oracle=oracle)

    for m in config.ranks:  # fitted to the pieces' KV in this very prompt's full prefill
        out[f"patch-r{m}"] = patched(ref.conditioned, m, oracle=True)
    if config.stored:  # fitted where each piece was first encoded: what a store holds
        out[f"stored-r{max(config.ranks)}"] = patched(origin, max(config.ranks), oracle=False)

    n = int(ref.k.shape[2])
    candidates = torch.arange(at.n_prefix, n)
    selections = recompute_selections(
        [config.cacheblend], [config.epic], candidates, at.token_starts, at.lengths
    )
    for name, selection in selections.items():
        t0 = time.perf_counter()
        embeds = store.embeds([prefix, *[p.chunk for p in case.target]])
        rec = selective_recompute(adapter, embeds, at.positions, *blind, selection)
        seconds = out["blind"].seconds + time.perf_counter() - t0
        out[name] = Built(rec.k, rec.v, seconds, recompute=rec.selected.numel() / max(1, candidates.numel()))
    return out
