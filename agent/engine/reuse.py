"""What a prompt reuses, found in the store: the plan as steps of reused KV and misses.

The exact prefix comes first, found segment by segment by its store keys (a key names a segment's
bounds, its content and its whole context, so the entry under it is the KV this prompt's own
prefill would compute there, bit for bit; the store may hold it from this process, from before a
restart or from another process). Where the next segment is not stored as such, the exact prefix
goes on to the token where the radix tree's match ends, taken from the entries of the earlier
prompt it matched: the prefill attention runs every block whole however a pass cuts it, so the
first tokens of a prompt have the KV of any prompt that begins with them
(``agent/adapters/attention.py``). Then, unless the mode is ``exact``, each later chunk found by
content: in the content index (moved, or after other antecedents) or, not indexed here, by its
content alias (another process's work). Every entry is read through ``cache.records`` with the
fingerprint of the units it must hold: a misfiled or damaged entry is a miss.

Reused KV comes as *parts* laid end to end, each in the frame it was stored in: the window
(``cache.window``) places them, copying bit for bit or moving by ``R(δ)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from agent.engine.prompt import (
    Prompt,
    PromptKeys,
    Record,
    TableRow,
    cut_back,
    fits,
)
from cache import records
from cache.keys import chain_key, fingerprint, span_key
from cache.layout import ChunkKV
from cache.planner import Plan, PlannedChunk
from cache.store import Entry, TieredStore, record_key


class Step(NamedTuple):
    start: int
    end: int
    parts: tuple[ChunkKV, ...]  # reused KV laid end to end (each placed or pre-RoPE); () for a miss
    refs: tuple[TableRow, ...]  # where the reused KV lives, in this prompt's units
    delta: int
    exact: bool  # the exact prefix
    run: int = -1  # content reuse: the index of the planned chunk its run starts at (-1: none)


class Finder:
    """Reads what a prompt may reuse from one store. ``min_reuse_tokens``: content hits shorter
    than this are recomputed unless the mode is ``fast``; hits that continue one another in the
    same stored prompt count as one (:func:`run_tokens`)."""

    def __init__(self, store: TieredStore, min_reuse_tokens: int, to_the_token: bool = False) -> None:
        self.store, self.min_reuse_tokens = store, min_reuse_tokens
        # whether a prompt's first tokens have the KV of any prompt that begins with them (the
        # prefill attention runs every block whole: ``agent/adapters/attention.py``), so the exact
        # prefix may end at any token; False: at a segment edge (a model not ``cut_invariant``)
        self.to_the_token = to_the_token
        # the shared tier's own copies of pointer entries this prompt asked for (another replica
        # may have rewritten one since this process stored its own): read beside the local copy,
        # and merged into what this prompt's commit writes (``PromptCache._write_pointers``)
        self.pointers: dict[str, Entry] = {}

    @staticmethod
    def chunks(prompt: Prompt, plan: Plan, ctx: PromptKeys, mode: str) -> list[PlannedChunk]:
        """The plan's chunks as ``mode`` reuses them: runs followed on (:func:`follow_runs`)
        unless the mode is ``exact``."""
        return follow_runs(prompt, ctx, plan.chunks) if mode != "exact" else list(plan.chunks)

    def steps(
        self,
        prompt: Prompt,
        plan: Plan,
        ctx: PromptKeys,
        mode: str,
        chunks: Sequence[PlannedChunk] | None = None,
    ) -> tuple[list[Step], int]:
        """The plan as steps, reused KV fetched: the exact prefix by its segments' keys, then
        what ``mode`` reuses by content; misses merged; the last unit always a miss. Also the
        count of planned reuse whose entries were gone. ``chunks``: :meth:`chunks`, if made."""
        n_units, cuts = len(prompt.units), ctx.cuts
        parts: list[ChunkKV] = []
        rows: list[TableRow] = []
        edge = 0
        for _, b in ctx.segments(0, n_units - 1):
            # the segment under its own key; else, to the token, the rows of an earlier prompt
            # that held [0, edge) (this process's radix tree, or the pointer any process left
            # after that context), then the rest as a pass that began there stored it
            while edge < b:
                found = self._stored(prompt, ctx, edge, b)
                if found is not None:
                    parts.append(found[0])
                    rows.append(found[1])
                    edge = b
                    break
                # whichever reaches further: this process's radix tree may know a shorter match
                # (another conversation's) than the pointer another process left
                here = self._inside_block(prompt, plan, ctx, edge)
                reached = here is not None and here[1][-1].end >= min(b, n_units - 1)
                options = [m for m in (here, None if reached else self._after(prompt, ctx, edge, b)) if m]
                if not options:
                    break
                more = max(options, key=lambda m: m[1][-1].end)
                parts.extend(more[0])
                rows.extend(more[1])
                edge = more[1][-1].end
            if edge < b:
                break
        # the radix tree knew a longer exact prefix than the store still holds
        known = min(plan.prefix_len, n_units - 1)
        lost = int((known if self.to_the_token else cut_back(cuts, known)) > edge)
        steps: list[Step] = []
        if edge > 0:
            steps.append(Step(0, edge, tuple(parts), tuple(rows), 0, True))
        if chunks is None:
            chunks = self.chunks(prompt, plan, ctx, mode)
        run_of = run_starts(prompt, chunks)
        runs = run_tokens(prompt, chunks, edge, run_of)
        for c, run, rid in zip(chunks, runs, run_of, strict=True):
            s, e = max(c.start, edge), min(c.end, n_units)
            if s >= e:
                continue
            if e == n_units:
                e -= 1
            big = run >= self.min_reuse_tokens
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
            steps.append(Step(s, e, tuple(reused[0]), reused[1], delta, False, rid))
            if e < c.end:
                steps.append(Step(e, c.end, (), (), 0, False))
        if mode != "fast":
            steps = self._whole_runs(prompt, steps)
        return _merge_misses(steps), lost

    def _stored(self, prompt: Prompt, ctx: PromptKeys, a: int, b: int) -> tuple[ChunkKV, TableRow] | None:
        """The exact KV of units [a, b) stored under their own key, or None. [a, b) must end at a
        segment edge: the segment ending before the last unit is not whole, never stored so."""
        if b != cut_back(ctx.cuts, b):
            return None
        key = ctx.store_key(a, b, exact=True)
        if key not in self.store and not (a != cut_back(ctx.cuts, a) and self._bring_in(key)):
            return None  # (a whole segment's key was asked for in the prefetch already)
        tokens = ctx.fingerprint(a, b)
        found = records.load_kv(self.store, key, tokens)
        if found is None or found.placed_at != int(prompt.pos_off[a]) or not fits(prompt, a, b, [found]):
            return None
        return found, TableRow(a, b, key, 0, 0, tokens)

    def _bring_in(self, key: str) -> bool:
        """Fetch ``key`` from the store's shared tier (Redis), where there is one: a key inside a
        segment, which could not be known before the walk reached it (:meth:`prefetch` asked for
        the segments' own). Whether the store holds it now."""
        if getattr(self.store, "shared", None) is None:
            return False
        return key in self.store.prefetch([key])

    def _inside_block(
        self, prompt: Prompt, plan: Plan, ctx: PromptKeys, edge: int
    ) -> tuple[list[ChunkKV], tuple[TableRow, ...]] | None:
        """The exact prefix on from unit ``edge`` to the token where the radix tree's match ends
        (at most to the next segment edge): the leading rows of an entry of an earlier prompt
        the tree matched (the one that made the matched edge, or one that went on past it), or
        None. The prefill attention runs every block whole however a pass cuts it
        (``attention.blocked_forward``), so the KV of a prompt's first tokens is the KV of any
        prompt that begins with them, to the token. Text only: an image is reused whole."""
        if not self.to_the_token or not plan.prefix:
            return None
        n_units = len(prompt.units)
        later = ctx.cuts[ctx.cuts > edge]
        p = min(plan.prefix_len, n_units - 1, int(later[0]) if len(later) else n_units)
        if p <= edge or prompt.has_image(edge, p):
            return None
        deepest = plan.prefix[-1]
        candidates = [deepest.payload] if deepest.offset == plan.prefix_len - deepest.length else []
        tried: set[int] = set()
        for rec in (*candidates, *plan.continuations):
            if id(rec) in tried or not isinstance(rec, Record) or len(rec.tok_off) <= p:
                continue
            tried.add(id(rec))
            found = self.fetch(rec, edge, p, 0)
            if found is None or not fits(prompt, edge, p, found[0]):
                continue
            if found[0][0].placed_at == int(prompt.pos_off[edge]):
                return found
        return None

    def _after(
        self, prompt: Prompt, ctx: PromptKeys, edge: int, b: int
    ) -> tuple[list[ChunkKV], tuple[TableRow, ...]] | None:
        """The exact prefix on from unit ``edge`` (at most to ``b``, never the last unit) by the
        pointer prompts that held the same units [0, edge) left at commit (:func:`after_key`, any
        process): of the exact rows of text from ``edge`` it lists, the one that agrees with this
        prompt's tokens the furthest, as far as they agree. A row's key is checked to be the one
        this prompt's context and the pointer's tokens make, and its entry to hold those tokens,
        so a stale or misfiled pointer is a miss; None. Text only."""
        if not self.to_the_token or edge >= len(prompt.units) - 1:
            return None
        where = after_key(ctx, edge)
        inside = edge != cut_back(ctx.cuts, edge)
        if inside and where not in self.pointers and getattr(self.store, "shared", None) is not None:
            # inside a segment: not known before the walk got here (a segment start's was prefetched)
            self.pointers.update(self.store.fetch_shared([where]))
        for n, key, ids in self._agreeing(prompt, ctx, edge, b):
            if inside and key not in self.store:  # (a segment start's rows were prefetched)
                self._bring_in(key)
            kv = records.load_kv(self.store, key, fingerprint([ids]), len(ids))
            if kv is None or kv.placed_at != int(prompt.pos_off[edge]):
                continue
            part = kv.sliced(0, n, 0, int(prompt.pos_off[edge + n] - prompt.pos_off[edge]))
            if fits(prompt, edge, edge + n, [part]):
                return [part], (TableRow(edge, edge + n, key, 0, 0, fingerprint([ids])),)
        return None

    def _agreeing(
        self, prompt: Prompt, ctx: PromptKeys, edge: int, b: int
    ) -> list[tuple[int, str, np.ndarray]]:
        """The rows the pointer after units [0, ``edge``) lists (this process's copy and the
        shared tier's) that agree with this prompt's first tokens from ``edge`` (at most to
        ``b``, never the last unit) and whose key this prompt's context and their tokens make:
        (tokens agreed, key, token ids), the furthest first. Text only."""
        stop_at = min(b, len(prompt.units) - 1)
        if stop_at <= edge or prompt.has_image(edge, stop_at):
            return []
        where = after_key(ctx, edge)
        ours = prompt.units[edge:stop_at]
        agreed = []
        for key, ids in pointer_rows(self.store.get(where), self.pointers.get(where)):
            head = ids[: len(ours)]
            parted = np.flatnonzero(head != ours[: len(head)])
            n = int(parted[0]) if parted.size else len(head)
            if n > 0 and key == exact_key(ctx, edge, ids):
                agreed.append((n, key, ids))
        return sorted(agreed, key=lambda t: -t[0])

    def _whole_runs(self, prompt: Prompt, steps: list[Step]) -> list[Step]:
        """Steps with each stretch of a run actually reused (a run's chunks are fetched and
        checked one by one, so one may be gone) reused only if it still holds
        ``min_reuse_tokens``; a shorter stretch is a miss."""
        out = list(steps)
        i = 0
        while i < len(out):
            j = i + 1
            if out[i].run >= 0:
                while j < len(out) and out[j].run == out[i].run and out[j].start == out[j - 1].end:
                    j += 1
                if prompt.tok_off[out[j - 1].end] - prompt.tok_off[out[i].start] < self.min_reuse_tokens:
                    out[i:j] = [Step(st.start, st.end, (), (), 0, False) for st in out[i:j]]
            i = j
        return out

    def fetch(
        self, rec: Record, a: int, b: int, shift: int
    ) -> tuple[list[ChunkKV], tuple[TableRow, ...]] | None:
        """KV of units [a, b) of ``rec`` as parts laid end to end (each in the frame it was
        stored in: the window places them), and its rows moved by ``shift`` units; None if any
        entry is gone."""
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
                return None
            p0 = row.position + int(rec.pos_off[lo] - rec.pos_off[row.start])
            parts.append(kv.sliced(t0, t1, p0, int(rec.pos_off[hi] - rec.pos_off[lo])))
            refs.append(TableRow(lo + shift, hi + shift, row.key, t0, p0, row.tokens))
        if not parts or refs[-1].end - shift != b or refs[0].start - shift != a:
            return None
        return parts, tuple(refs)

    def prefetch(
        self,
        prompt: Prompt,
        plan: Plan,
        ctx: PromptKeys,
        mode: str,
        chunks: Sequence[PlannedChunk] | None = None,
    ) -> frozenset[str]:
        """Two round trips to the store's shared tier (Redis), for what this prompt may reuse and
        no local tier holds: the keys of its exact prefix's segments and of the rows its content
        hits point at, the aliases of its misses, then the rows those aliases point
        at. Returns the keys brought in (another replica's work). ``chunks``: :meth:`chunks`."""
        if getattr(self.store, "shared", None) is None:
            return frozenset()
        n_units = len(prompt.units)
        keys = [
            ctx.store_key(a, b, exact=True)
            for a, b in ctx.segments(0, n_units - 1)
            if b == cut_back(ctx.cuts, b)
        ]
        aliases = []
        if chunks is None:
            chunks = self.chunks(prompt, plan, ctx, mode)
        for c in chunks if mode != "exact" else ():
            if c.status == "relocated-hit" and isinstance(c.payload, Record) and c.source_start is not None:
                lo, hi = c.source_start, c.source_start + c.n_tokens
                keys += [r.key for r in c.payload.table if r.end > lo and r.start < hi]
            elif c.status == "miss":
                aliases.append(record_key(ctx.content_key(c.start, c.end).hex, "alias"))
        # the pointers left after each segment's start (exact reuse to the token): the shared
        # tier's copies whether or not this process holds its own, then of the rows they list
        # the one that agrees with this prompt the furthest (each a segment's KV: the others,
        # which this prompt would not read, are not brought in)
        segments = ctx.segments(0, n_units - 1) if self.to_the_token else []
        pointers = [after_key(ctx, a) for a, _ in segments]
        placed, fresh = self.store.prefetch_fresh([*keys, *aliases], pointers)
        fetched = set(placed)
        self.pointers.update(fresh)
        rows = []
        for key in aliases:
            entry = self.store.get(key) if key in fetched else None
            if entry is not None:
                rows += [str(r[2]) for r in entry.meta.get("rows", ()) if isinstance(r, list) and len(r) > 2]
        for a, b in segments:
            rows += [key for _, key, _ in self._agreeing(prompt, ctx, a, b)[:1]]
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


def follow_runs(prompt: Prompt, ctx: PromptKeys, chunks: Sequence[PlannedChunk]) -> list[PlannedChunk]:
    """The planned chunks with each run of relocated hits followed on in the prompt it came from:
    a chunk after a hit from a :class:`Record` that holds the same units right after it is taken
    from there (found elsewhere or not found at all: a fragment repeated all over the prompt, or
    the last chunk of an earlier prompt, cut where that prompt ended); a missed chunk that does so
    for only its first units is split there. Exact-prefix chunks are left as they are."""
    out: list[PlannedChunk] = []
    for c in chunks:
        prev = out[-1] if out else None
        rec = prev.payload if prev is not None and prev.status == "relocated-hit" else None
        if not isinstance(rec, Record) or rec.units is None or prev is None or prev.source_start is None:
            out.append(c)
            continue
        if c.status == "prefix-hit" or prev.end != c.start:
            out.append(c)
            continue
        src = prev.source_start + prev.n_tokens
        want = prompt.units[c.start : c.end]
        have = rec.units[src : src + len(want)]
        same = int(np.argmin(np.append(want[: len(have)] == have, False)))  # units alike in a row
        if same == len(want):
            out.append(c._replace(status="relocated-hit", source_start=src, payload=rec))
        elif same > 0 and c.status == "miss":
            cut = c.start + same
            head = c._replace(end=cut, key=ctx.content_key(c.start, cut), source_start=src, payload=rec)
            out.append(head._replace(status="relocated-hit"))
            out.append(c._replace(start=cut, key=ctx.content_key(cut, c.end)))
        else:
            out.append(c)
    return out


def run_tokens(
    prompt: Prompt, chunks: Sequence[PlannedChunk], edge: int, starts: Sequence[int] | None = None
) -> list[int]:
    """For each planned chunk, the prompt tokens after ``edge`` (the exact prefix) and before the
    last unit of the run it belongs to: relocated hits laid end to end here that lay end to end
    in the same stored prompt, moved by the same shift (one stretch of an earlier prompt cut in
    several chunks, reused whole or not at all), or the chunk alone. ``starts``:
    :func:`run_starts`, if made."""
    last = len(prompt.units) - 1

    def size(c: PlannedChunk) -> int:
        s, e = max(c.start, edge), min(c.end, last)
        return int(prompt.tok_off[e] - prompt.tok_off[s]) if e > s else 0

    if starts is None:
        starts = run_starts(prompt, chunks)
    total: dict[int, int] = {}
    for c, r in zip(chunks, starts, strict=True):
        total[r] = total.get(r, 0) + size(c)
    return [total[r] for r in starts]


def run_starts(prompt: Prompt, chunks: Sequence[PlannedChunk]) -> list[int]:
    """For each planned chunk, the index of the first chunk of its run (:func:`run_tokens`). A
    chunk holding an image is a run of its own: repair does not measure images, so text next to
    one is not reused on its account."""
    image = [prompt.has_image(c.start, c.end) for c in chunks] if prompt.n_images else [False] * len(chunks)
    out: list[int] = []
    for i, c in enumerate(chunks):
        joined = i > 0 and continues(chunks[i - 1], c) and not image[i - 1] and not image[i]
        out.append(out[-1] if joined else i)
    return out


def continues(a: PlannedChunk, b: PlannedChunk) -> bool:
    """Whether relocated hit ``b`` continues ``a`` in the prompt and in the same stored one."""
    return (
        a.status == b.status == "relocated-hit"
        and b.payload is a.payload
        and b.start == a.end
        and a.source_start is not None
        and b.source_start == a.source_start + a.n_tokens
    )


def _merge_misses(steps: list[Step]) -> list[Step]:
    out: list[Step] = []
    for st in steps:
        if not st.parts and out and not out[-1].parts and out[-1].end == st.start:
            out[-1] = out[-1]._replace(end=st.end)
        else:
            out.append(st)
    return out


def after_key(ctx: PromptKeys, a: int) -> str:
    """Where a prompt leaves a pointer to its exact row of text that starts at unit ``a``: a key
    of its content before ``a`` (``PromptKeys.context``), so any prompt that holds the same units
    [0, a) finds it."""
    context = ctx.context(a) or span_key(ctx.namespace, [])  # [0, 0): the namespace's own
    return record_key(context.hex, "after")


def exact_key(ctx: PromptKeys, a: int, ids: np.ndarray) -> str:
    """The store key of the exact KV of text ``ids`` right after this prompt's units [0, a)."""
    return record_key(chain_key(ctx.context(a), span_key(ctx.namespace, [ids])).hex, "exact")


# The most rows one pointer lists: prompts that share a context part after it in many ways (one
# system prompt, many conversations), and a row another prompt parts from early reaches less
POINTER_ROWS = 8


def read_pointer(meta: object) -> list[tuple[str, np.ndarray]]:
    """The rows a pointer entry's metadata lists (:func:`after_key`), newest first: each row's key
    and token ids. A damaged pointer lists none, a damaged row in it is left out: a miss."""
    if not isinstance(meta, Mapping) or not isinstance(meta.get("rows"), list):
        return []
    out = []
    for item in meta["rows"]:
        if not isinstance(item, list) or len(item) != 2:
            continue
        key, ids = item
        if not isinstance(key, str) or not isinstance(ids, list) or not ids:
            continue
        if not all(type(i) is int and 0 <= i < 1 << 62 for i in ids):
            continue
        out.append((key, np.asarray(ids, np.int64)))
    return out


def pointer_rows(*entries: Entry | None) -> list[tuple[str, np.ndarray]]:
    """The rows the pointer ``entries`` list (this process's copy, the shared tier's), each key once."""
    seen: dict[str, np.ndarray] = {}
    for entry in entries:
        for key, ids in read_pointer(entry.meta) if entry is not None else ():
            seen.setdefault(key, ids)
    return list(seen.items())


def pointer_meta(new: tuple[str, np.ndarray], old: list[tuple[str, np.ndarray]]) -> dict[str, object]:
    """A pointer's metadata with row ``new`` first, then the ``old`` rows it does not supersede
    (a row whose tokens begin the new row's: the new one reaches as far and further), at most
    :data:`POINTER_ROWS`."""
    key, ids = new
    kept = [(key, ids)]
    for k, i in old:
        if k == key or (len(i) <= len(ids) and np.array_equal(i, ids[: len(i)])):
            continue
        kept.append((k, i))
    return {"rows": [[k, i.tolist()] for k, i in kept[:POINTER_ROWS]]}
