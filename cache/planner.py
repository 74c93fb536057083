"""The reuse plan of a prompt: which spans come from the exact prefix, which are found by
content and moved, and which must be prefilled.

A prompt is cut at its structural boundaries and, inside them, by content-defined chunking.
The longest stored exact prefix is reused as it is (``prefix-hit``); every chunk after it is
looked up by its content key and, on a verified hit, relocated from where it was stored
(``relocated-hit``, shift ``start - source_start``); the rest are misses. A chunk that straddles
the end of the exact prefix is split there, so every planned span is either fully inside the
prefix or fully after it; its tail is a relocated hit when the whole chunk is found by content
(the tail of the stored chunk), else it is looked up on its own. ``commit`` records a prefilled
prompt so its chunks hit next time.

What this module does not do: run a model, hold KV tensors, or decide what to evict; payloads
are opaque handles the caller gives (e.g. a store key for the prompt's KV).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import torch

from cache.cdc import CDCConfig, as_token_array, chunk_bounds, spans
from cache.index import ContentIndex, RadixKey, RadixTree, Segment
from cache.keys import ContentKey, KeyMemo, Namespace, token_key

Status = Literal["prefix-hit", "relocated-hit", "miss"]
STATUSES: tuple[Status, ...] = ("prefix-hit", "relocated-hit", "miss")


class PlannedChunk(NamedTuple):
    start: int  # span [start, end) in the prompt
    end: int
    key: ContentKey  # content key of exactly these tokens
    status: Status
    source_start: int | None  # where the reused tokens sat in ``payload``'s sequence
    payload: object  # handle holding a relocated hit's KV; None otherwise (see Plan.prefix)

    @property
    def n_tokens(self) -> int:
        return self.end - self.start

    @property
    def delta(self) -> int:
        """Positions to move the reused KV by (0 for a prefix hit; 0 also for a miss)."""
        return 0 if self.source_start is None else self.start - self.source_start


class Plan(NamedTuple):
    chunks: tuple[PlannedChunk, ...]
    prefix_len: int
    n_tokens: int
    prefix: tuple[Segment, ...]  # where the KV of tokens [0, prefix_len) lies, in order
    # stored sequences that hold tokens [0, prefix_len) and may go on past it, nearest first
    # (``RadixTree.payloads_below``)
    continuations: tuple[object, ...] = ()

    def tokens_by_status(self) -> dict[Status, int]:
        out: dict[Status, int] = dict.fromkeys(STATUSES, 0)
        for c in self.chunks:
            out[c.status] += c.n_tokens
        return out

    @property
    def reused_tokens(self) -> int:
        return sum(c.n_tokens for c in self.chunks if c.status != "miss")


class CommitResult(NamedTuple):
    new_prefix_tokens: int  # tokens added to the radix tree
    new_chunks: int  # entries added to the content index
    collisions: int  # chunks refused because their key held other tokens


@dataclass(frozen=True)
class PlannerConfig:
    """Chunking strategy and sizes, how the content index verifies hits, and how many chunk
    keys the planner remembers (``KeyMemo``)."""

    chunker: str = "gear"
    cdc: CDCConfig = field(default_factory=CDCConfig)
    verify: Literal["tokens", "fingerprint"] = "tokens"
    eviction: str = "lru"
    key_memo_entries: int = 1 << 16


class Planner:
    """Plans and commits prompts of one namespace against a radix tree and a content index.

    ``plan`` only reads (and refreshes access times); ``commit`` writes. The two indexes may be
    shared by planners of other namespaces: keys and radix roots never mix across namespaces.
    """

    def __init__(
        self,
        namespace: Namespace,
        config: PlannerConfig | None = None,
        radix: RadixTree | None = None,
        index: ContentIndex | None = None,
    ) -> None:
        self.namespace = namespace
        self.config = config or PlannerConfig()
        self.radix = radix if radix is not None else RadixTree(self.config.eviction)
        self.index = index if index is not None else ContentIndex(self.config.verify)
        self._root_key = namespace.encoded
        self._keys = KeyMemo(namespace, self.config.key_memo_entries)

    def plan(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, boundaries: Iterable[int] = ()) -> Plan:
        """Reuse plan for ``tokens`` [T] with structural ``boundaries`` (offsets in [0, T])."""
        ids = as_token_array(tokens)
        match = self.radix.match_prefix(RadixKey(ids, self._root_key))
        p = match.matched_len
        bounds = chunk_bounds(ids, self.config.cdc, boundaries, self.config.chunker)
        ranges = spans(bounds)
        keys = self._keys.token_keys(ids, ranges)
        n_prefix = int(np.searchsorted(bounds[1:], p, side="right"))  # chunks that end by p
        chunks = [
            PlannedChunk(s, e, k, "prefix-hit", s, None)
            for (s, e), k in zip(ranges[:n_prefix], keys[:n_prefix], strict=True)
        ]
        rest = n_prefix
        if rest < len(ranges) and ranges[rest][0] < p:
            chunks.extend(self._split_at_prefix_end(ids, ranges[rest], keys[rest], p))
            rest += 1
        found = self.index.lookup_many(keys[rest:], ids, ranges[rest:])
        for (s, e), k, r in zip(ranges[rest:], keys[rest:], found, strict=True):
            if r.entry is None:
                chunks.append(PlannedChunk(s, e, k, "miss", None, None))
            else:
                chunks.append(PlannedChunk(s, e, k, "relocated-hit", r.entry.source_start, r.entry.payload))
        below = self.radix.payloads_below(match.node) if p else ()
        return Plan(tuple(chunks), p, len(ids), match.segments, below)

    def _split_at_prefix_end(
        self, ids: np.ndarray, span: tuple[int, int], key: ContentKey, p: int
    ) -> list[PlannedChunk]:
        """A chunk [s, e) with s < p < e: the prefix part, then the rest, found in the whole chunk."""
        s, e = span
        whole = self.index.lookup(key, ids[s:e]).entry
        head = PlannedChunk(s, p, token_key(self.namespace, ids[s:p]), "prefix-hit", s, None)
        if whole is not None:
            tail_key = token_key(self.namespace, ids[p:e])
            return [
                head,
                PlannedChunk(p, e, tail_key, "relocated-hit", whole.source_start + p - s, whole.payload),
            ]
        return [head, self._lookup(ids, p, e)]

    def _lookup(self, ids: np.ndarray, s: int, e: int) -> PlannedChunk:
        key = token_key(self.namespace, ids[s:e])
        entry = self.index.lookup(key, ids[s:e]).entry
        if entry is None:
            return PlannedChunk(s, e, key, "miss", None, None)
        return PlannedChunk(s, e, key, "relocated-hit", entry.source_start, entry.payload)

    def commit(
        self,
        plan: Plan,
        tokens: Sequence[int] | np.ndarray | torch.Tensor,
        payload: object,
        prefix_len: int | None = None,
        refresh: bool = False,
    ) -> CommitResult:
        """Record that ``payload`` now holds the KV of all of ``tokens`` (the planned prompt).

        Misses and prefix pieces become content entries at their positions in ``payload``;
        relocated hits keep their existing entries. ``prefix_len``: only the first tokens enter
        the radix tree (those whose KV is what a full prefill computes); all by default.
        refresh: every chunk, relocated hits and chunks already indexed included, points at
        ``payload`` from now on (the prompt seen last holds each chunk beside the neighbours it
        has now, so runs of chunks found there lie end to end as they did).
        """
        ids = as_token_array(tokens)
        if len(ids) != plan.n_tokens:
            raise ValueError(f"plan covers {plan.n_tokens} tokens, got {len(ids)}")
        n = len(ids) if prefix_len is None else max(0, min(prefix_len, len(ids)))
        ins = self.radix.insert(RadixKey(ids[:n], self._root_key), payload) if n else None
        stored = [c for c in plan.chunks if refresh or c.status != "relocated-hit"]
        done = self.index.insert_many(
            [c.key for c in stored], ids, [(c.start, c.end) for c in stored], payload, refresh
        )
        statuses = [r.status for r in done]
        new = ins.new_tokens if ins is not None else 0
        return CommitResult(new, statuses.count("miss"), statuses.count("collision"))
