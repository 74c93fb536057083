"""What a prompt reuses, found in the store: the plan as steps of reused KV and misses.

The exact prefix comes first: the radix tree's segments, cut back to a segment edge, then carried
on by the store keys of the segments after it (which the store may hold from before a restart or
from another process). Then, unless the mode is ``exact``, each later chunk found by content: in
the content index (moved, or after other antecedents) or, not indexed here, by its content alias
(another process's work). Every entry is read through ``cache.records`` with the fingerprint of
the units it must hold: a misfiled or damaged entry is a miss.

Reused KV comes as *parts* laid end to end, each in the frame it was stored in: the window
(``cache.window``) places them, copying bit for bit or moving by ``R(δ)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from agent.server.prompt import (
    Prompt,
    PromptKeys,
    Record,
    TableRow,
    clip,
    cut_back,
    fits,
    offsets,
    units_of,
)
from cache import records
from cache.layout import ChunkKV
from cache.planner import Plan
from cache.store import TieredStore, record_key


class Step(NamedTuple):
    start: int
    end: int
    parts: tuple[ChunkKV, ...]  # reused KV laid end to end (each placed or pre-RoPE); () for a miss
    refs: tuple[TableRow, ...]  # where the reused KV lives, in this prompt's units
    delta: int
    exact: bool  # the exact prefix


class Finder:
    """Reads what a prompt may reuse from one store. ``min_reuse_tokens``: content hits shorter
    than this are recomputed unless the mode is ``fast``."""

    def __init__(self, store: TieredStore, min_reuse_tokens: int) -> None:
        self.store, self.min_reuse_tokens = store, min_reuse_tokens

    def steps(self, prompt: Prompt, plan: Plan, ctx: PromptKeys, mode: str) -> tuple[list[Step], int]:
        """The plan as steps, reused KV fetched: the exact prefix cut back to a segment edge
        (and carried on by the keys of the segments after it, which the store may hold from
        before a restart or from another process), then what ``mode`` reuses by content;
        misses merged; the last unit always a miss."""
        n_units, cuts = len(prompt.units), ctx.cuts
        segments = [(at, seg) for at, seg in offsets(plan.prefix) if isinstance(seg.payload, Record)]
        limit = min(plan.prefix_len, n_units - 1)
        found_parts, refs, got = self.fetch_prefix(segments, 0, limit)
        edge = cut_back(cuts, got)
        lost = int(got < limit and cut_back(cuts, limit) > edge)
        parts = _cut(found_parts, int(prompt.tok_off[edge]), int(prompt.pos_off[edge])) if edge else []
        rows = list(clip(refs, edge)) if parts else []
        edge = edge if parts else 0
        for a, b in ctx.segments(edge, n_units - 1):
            if b != cut_back(cuts, b):  # the segment ending before the last unit is not whole
                break
            key = ctx.store_key(a, b, exact=True)
            tokens = ctx.fingerprint(a, b)
            found = records.load_kv(self.store, key, tokens) if key in self.store else None
            if found is None or found.placed_at != int(prompt.pos_off[a]) or not fits(prompt, a, b, [found]):
                break
            parts.append(found)
            rows.append(TableRow(a, b, key, 0, 0, tokens))
            edge = b
        steps: list[Step] = []
        if edge > 0:
            steps.append(Step(0, edge, tuple(parts), tuple(rows), 0, True))
        for c in plan.chunks:
            s, e = max(c.start, edge), min(c.end, n_units)
            if s >= e:
                continue
            if e == n_units:
                e -= 1
            big = prompt.tok_off[e] - prompt.tok_off[s] >= self.min_reuse_tokens
            if mode == "exact" or e <= s or not (mode == "fast" or big) or c.status == "prefix-hit":
                steps.append(Step(s, c.end, (), (), 0, False))
                continue
            reused, delta = None, 0
            if c.status == "relocated-hit" and isinstance(c.payload, Record) and c.source_start is not None:
                src = c.source_start + s - c.start
                reused = self.fetch(c.payload, src, src + e - s, s - src)
                delta = c.start - c.source_start
                lost += int(reused is None)
            elif s == c.start:  # not in the indexes: the store may hold it from another process
                alias = self.alias(ctx, c.start, c.end)
                if alias is not None:
                    reused = self.fetch(alias, 0, e - s, s)
            if reused is not None and not fits(prompt, s, e, reused[0]):
                reused = None
            if reused is None:
                steps.append(Step(s, c.end, (), (), 0, False))
                continue
            steps.append(Step(s, e, tuple(reused[0]), reused[1], delta, False))
            if e < c.end:
                steps.append(Step(e, c.end, (), (), 0, False))
        return _merge_misses(steps), lost

    def fetch_prefix(
        self, segments: list[tuple[int, Any]], a: int, b: int
    ) -> tuple[list[ChunkKV], list[TableRow], int]:
        """KV of units [a, b) from the radix segments, as far as the store still has it: parts
        laid end to end, their rows, and the unit they reach."""
        parts: list[ChunkKV] = []
        refs: list[TableRow] = []
        got = a
        for at, seg in segments:
            lo, hi = max(a, at), min(b, at + seg.length)
            if lo >= hi:
                continue
            if lo != got:
                break
            rec = seg.payload
            src = seg.offset + lo - at
            part = self.fetch(rec, src, seg.offset + hi - at, at - seg.offset, True)
            if part is None:
                break
            parts.extend(part[0])
            refs.extend(part[1])
            got = lo + units_of(part[1])
            if got < hi:
                break
        return parts, refs, got

    def fetch(
        self, rec: Record, a: int, b: int, shift: int, partial: bool = False
    ) -> tuple[list[ChunkKV], tuple[TableRow, ...]] | None:
        """KV of units [a, b) of ``rec`` as parts laid end to end (each in the frame it was
        stored in: the window places them), and its rows moved by ``shift`` units; None if any
        entry is gone (``partial``: what is there from ``a`` on, None if nothing)."""
        parts: list[ChunkKV] = []
        refs: list[TableRow] = []
        for row in rec.table:
            if row.end <= a or row.start >= b:
                continue
            lo, hi = max(a, row.start), min(b, row.end)
            kv = records.load_kv(self.store, row.key, row.tokens)
            t0 = row.token + int(rec.tok_off[lo] - rec.tok_off[row.start])
            t1 = t0 + int(rec.tok_off[hi] - rec.tok_off[lo])
            if kv is None or t1 > kv.n_tokens or (parts and lo != refs[-1].end - shift):
                if partial and parts:
                    break
                return None
            p0 = row.position + int(rec.pos_off[lo] - rec.pos_off[row.start])
            parts.append(kv.sliced(t0, t1, p0, int(rec.pos_off[hi] - rec.pos_off[lo])))
            refs.append(TableRow(lo + shift, hi + shift, row.key, t0, p0, row.tokens))
        if not parts or (not partial and refs[-1].end - shift != b) or refs[0].start - shift != a:
            return None
        return parts, tuple(refs)

    def prefetch(self, prompt: Prompt, plan: Plan, ctx: PromptKeys, mode: str) -> frozenset[str]:
        """Two round trips to the store's shared tier (Redis), for what this prompt may reuse and
        no local tier holds: the keys of its exact prefix's segments and of the rows its radix
        and content hits point at, the aliases of its misses, then the rows those aliases point
        at. Returns the keys brought in (another replica's work)."""
        if getattr(self.store, "shared", None) is None:
            return frozenset()
        n_units = len(prompt.units)
        keys = [
            ctx.store_key(a, b, exact=True)
            for a, b in ctx.segments(0, n_units - 1)
            if b == cut_back(ctx.cuts, b)
        ]
        for _, seg in offsets(plan.prefix):
            if isinstance(seg.payload, Record):
                keys += [
                    r.key
                    for r in seg.payload.table
                    if r.end > seg.offset and r.start < seg.offset + seg.length
                ]
        aliases = []
        for c in plan.chunks:
            if mode == "exact":
                break
            if c.status == "relocated-hit" and isinstance(c.payload, Record) and c.source_start is not None:
                lo, hi = c.source_start, c.source_start + c.n_tokens
                keys += [r.key for r in c.payload.table if r.end > lo and r.start < hi]
            elif c.status == "miss":
                aliases.append(record_key(ctx.content_key(c.start, c.end).hex, "alias"))
        fetched = set(self.store.prefetch([*keys, *aliases]))
        rows = []
        for key in aliases:
            entry = self.store.get(key) if key in fetched else None
            if entry is not None:
                rows += [str(r[2]) for r in entry.meta.get("rows", ()) if isinstance(r, list) and len(r) > 2]
        if rows:
            fetched |= self.store.prefetch(rows)
        return frozenset(fetched)

    def alias(self, ctx: PromptKeys, a: int, b: int) -> Record | None:
        """The stored alias of units [a, b) by their content alone: where some prompt, in this
        process or another, keeps their KV (computed after its own antecedents)."""
        entry = self.store.get(record_key(ctx.content_key(a, b).hex, "alias"), ctx.fingerprint(a, b))
        if entry is None:
            return None
        meta = entry.meta
        try:
            table = tuple(
                TableRow(int(r[0]), int(r[1]), str(r[2]), int(r[3]), int(r[4]), str(r[5]))
                for r in meta["rows"]
            )
            tok, pos = np.asarray(meta["tok_off"], np.int64), np.asarray(meta["pos_off"], np.int64)
        except (KeyError, TypeError, ValueError, IndexError):
            return None
        if len(tok) != b - a + 1 or len(pos) != b - a + 1:
            return None
        return Record(table, tok, pos, 0)


def _cut(parts: list[ChunkKV], n_tokens: int, extent: int) -> list[ChunkKV]:
    """The first ``n_tokens`` tokens (``extent`` positions) of ``parts`` laid end to end."""
    out: list[ChunkKV] = []
    tokens = ext = 0
    for kv in parts:
        if tokens + kv.n_tokens <= n_tokens:
            out.append(kv)
            tokens, ext = tokens + kv.n_tokens, ext + kv.extent
            continue
        if tokens < n_tokens:
            out.append(kv.sliced(0, n_tokens - tokens, 0, extent - ext))
        break
    return out


def _merge_misses(steps: list[Step]) -> list[Step]:
    out: list[Step] = []
    for st in steps:
        if not st.parts and out and not out[-1].parts and out[-1].end == st.start:
            out[-1] = out[-1]._replace(end=st.end)
        else:
            out.append(st)
    return out
