"""One window of chunks in one arena: where each chunk's tokens sit and what their keys carry.

Every product places chunks through a :class:`Window`: the context manager (``agent/context.py``,
a window that slides, reorders and recalls) and the HTTP prompt cache
(``agent/engine/prompt_cache.py``, a window a request fills once, in order). The window knows
chunks only as :class:`Placement` s (a ``ChunkKV`` and the logical start it takes); which chunk
goes where, and why, is its owner's business.

A placement's tokens live in one :class:`~cache.arena.KVArena`, in one or more physical
*segments* (``segs``: ``(arena index, tokens)``, in token order). Attention over a cache (every
cached token visible to every new query) does not depend on where a key sits in memory, only on
the position its rotation encodes, so :meth:`Window.sync` brings the arena up to a new layout
with the least work:

- a placement whose keys already carry its place is not touched;
- one that moved has its keys rotated again (from its pre-RoPE KV, or by ``R(δ)`` from the frame
  it was stored in), its values left where they are;
- a new one is written into the room evicted ones left, then after the last used token, and the
  holes that remain are filled from the arena's physical end (:meth:`Window._compact`);
- the whole window may sit at a constant position ``offset`` (at most ``shift_limit``):
  attention depends on relative positions only, so after a slide moving the few prefix tokens
  is cheaper than moving every survivor.

A placement's KV is pre-RoPE (``kv.placed_at is None``: rotated to its place on write) or as the
model rotated it (``placed_at``: copied bit for bit where it starts there, moved by the
difference elsewhere). Tokens the model wrote itself into the arena's spare room join the window
with :meth:`Window.adopt`, without being written again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from cache.arena import KVArena
from cache.layout import ChunkKV
from cache.rope import RopeSpec, relocate, rotate_many


class ArenaDims(NamedTuple):
    """The per-layer shapes of a model's KV: ``k [L, H_k, T, D_k]``, ``v [L, H_v, T, D_v]``."""

    n_layers: int
    k: tuple[int, int]  # (H_k, D_k)
    v: tuple[int, int]  # (H_v, D_v)
    dtype: torch.dtype
    device: torch.device


@dataclass(eq=False)  # a placement is itself: the same chunk may sit in a window twice
class Placement:
    """A chunk in a window: its KV, the logical start it takes, and where its tokens sit."""

    kv: ChunkKV
    start: int = 0  # logical start in the window: positions from start + the window's offset
    placed_start: int | None = None  # the position its keys carry in the arena (None: not written)
    segs: list[tuple[int, int]] = field(default_factory=list)  # (arena index, tokens), in token order


class Window:
    """Placements in one arena, kept up to date in place. One owner, not thread-safe.

    ``headroom``: spare tokens kept after the window for a step's new tokens (the arena grows if a
    step needs more). ``shift_limit``: the largest constant position offset the window may sit
    at (0: always at position 0). ``dims``: the arena's shapes; taken from the first placement
    synced when not given.
    """

    def __init__(
        self, spec: RopeSpec, kernel: str = "auto", headroom: int = 256, shift_limit: int = 0,
        dims: ArenaDims | None = None,
    ) -> None:
        if headroom < 0 or shift_limit < 0:
            raise ValueError("headroom and shift_limit must not be negative")
        self.spec, self.kernel, self.headroom, self.shift_limit = spec, kernel, headroom, shift_limit
        self.dims = dims
        self.arena: KVArena | None = None
        self.holders: list[Placement] = []  # placements whose tokens are in the arena
        self.used = 0  # arena tokens the window occupies
        self.base = 0  # the window's position offset in the arena
        self.tokens_rotated = 0  # tokens whose keys were written (rotated, relocated or copied)
        self.rebuilds = 0

    @property
    def offset(self) -> int:
        """The window's position offset: a placement's tokens carry ``start + offset`` on."""
        return self.base

    def retire(self) -> None:
        """Model caches made over the arena so far refuse to write (the window changed)."""
        if self.arena is not None:
            self.arena.retire()

    def sync(self, items: Sequence[Placement], reserve: int = 0) -> KVArena:
        """The arena showing ``items`` (in window order, their ``start`` set) with the least work,
        its used length reset to the window's (caches made before refuse to write). ``reserve``:
        the least capacity a rebuilt arena takes (besides the headroom)."""
        if not self._sync(items):
            self._rebuild(items, reserve)
        assert self.arena is not None
        self.arena.reset(self.used)
        return self.arena

    def adopt(self, item: Placement) -> bool:
        """Take ``item`` as the arena's next tokens after the window, where the model wrote them
        (its values, copied out unchanged, are checked at its last token in every layer: one
        comparison, which KV of another place or pass fails). False, and nothing recorded, if
        they are not there: the next :meth:`sync` writes them."""
        arena, kv, at = self.arena, item.kv, self.used
        n = kv.n_tokens
        if arena is None or min(arena.lengths) < at + n:
            return False
        if not torch.equal(arena.v[:, :, at + n - 1], kv.v[:, :, n - 1]):
            return False
        item.segs, item.placed_start = [(at, n)], self.base + item.start
        self.used += n
        self.holders.append(item)
        return True

    def placed_kv(self, item: Placement) -> tuple[torch.Tensor, torch.Tensor]:
        """``item``'s keys and values as the arena holds them (copies, ``[L, H, T, D]``)."""
        if self.arena is None or not item.segs:
            raise ValueError("the placement is not in the arena: sync the window first")
        ks = [self.arena.k[:, :, p : p + n] for p, n in item.segs]
        vs = [self.arena.v[:, :, p : p + n] for p, n in item.segs]
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    # --- layout ------------------------------------------------------------------------

    def _new_arena(self, tokens: int, like: ChunkKV | None) -> KVArena:
        dims = self.dims
        if dims is None:
            if like is None:
                raise ValueError("an empty window needs its arena dims")
            dims = ArenaDims(
                like.k.shape[0], (like.k.shape[1], like.k.shape[3]), (like.v.shape[1], like.v.shape[3]),
                like.k.dtype, like.k.device,
            )
            self.dims = dims
        return KVArena(dims.n_layers, dims.k, dims.v, tokens + self.headroom, dims.dtype, dims.device)

    def _rebuild(self, items: Sequence[Placement], reserve: int) -> None:
        """Every placement written afresh, in window order from physical 0, at offset 0."""
        total = sum(p.kv.n_tokens for p in items)
        if self.arena is None or self.arena.capacity < total + self.headroom:
            self.arena = self._new_arena(max(total, reserve), items[0].kv if items else None)
        offset = 0
        for item in items:
            item.segs, item.placed_start = [(offset, item.kv.n_tokens)], None
            offset += item.kv.n_tokens
        self.holders, self.used, self.base = list(items), offset, 0
        self.rebuilds += 1
        self._write(items)

    def _sync(self, items: Sequence[Placement]) -> bool:
        """Bring the arena up to ``items`` in place; False when a rebuild is the better way."""
        arena = self.arena
        if arena is None:
            return False
        live = {id(p) for p in items}
        holes: list[tuple[int, int]] = []
        for item in self.holders:
            if id(item) not in live:
                holes += item.segs
                item.segs, item.placed_start = [], None
        # the offset most tokens already sit at (within the allowed shift)
        votes: dict[int, int] = {}
        for item in items:
            if item.segs and item.placed_start is not None:
                b = item.placed_start - item.start
                votes[b] = votes.get(b, 0) + item.kv.n_tokens
        valid = {b: w for b, w in votes.items() if 0 <= b <= self.shift_limit}
        base = max(valid, key=lambda b: (valid[b], -b)) if valid else 0
        # new placements go into the holes first, then after the last used token
        holes = merge_ranges(holes)
        used = self.used
        for item in items:
            if item.segs:
                continue
            need, segs = item.kv.n_tokens, []
            while need and holes:
                h, n = holes.pop(0)
                take = min(n, need)
                segs.append((h, take))
                need -= take
                if n > take:
                    holes.insert(0, (h + take, n - take))
            if need:
                segs.append((used, need))
                used += need
            item.segs, item.placed_start = segs, None
        arena.reserve(used + self.headroom)
        used = self._compact(items, holes, used)
        if sum(len(p.segs) for p in items) > 2 * len(items) + 16:
            return False  # too fragmented: one contiguous rewrite is cheaper from here on
        self.holders, self.used, self.base = list(items), used, base
        self._write(items)
        return True

    def _compact(self, items: Sequence[Placement], holes: list[tuple[int, int]], used: int) -> int:
        """Fill ``holes`` (sorted, disjoint, below ``used``) with tokens from the physical end."""
        assert self.arena is not None
        ends: dict[int, Placement] = {p + n: item for item in items for p, n in item.segs}
        while holes:
            h, n = holes[-1]
            if h + n >= used:  # a hole at the end: just give it up
                holes.pop()
                used = min(used, h)
                continue
            h, n = holes[0]
            owner = ends.pop(used)
            i = next(j for j, (p, m) in enumerate(owner.segs) if p + m == used)
            p, m = owner.segs[i]
            take = min(m, n)
            if owner.placed_start is not None:  # its data is valid: move it (else it is rewritten anyway)
                self.arena.move(used - take, h, take)
            owner.segs[i : i + 1] = [seg for seg in ((p, m - take), (h, take)) if seg[1]]
            if m > take:
                ends[used - take] = owner
            ends[h + take] = owner
            used -= take
            holes[0:1] = [(h + take, n - take)] if n > take else []
        return used

    def _write(self, items: Sequence[Placement]) -> None:
        """Write the keys of every placement not at its place (values too for new ones): all
        pre-RoPE ones rotated in one hand-off, placed ones copied or moved by the difference."""
        assert self.arena is not None
        rotations = []
        for item in items:
            at = self.base + item.start
            if item.placed_start == at:
                continue
            kv, values = item.kv, item.placed_start is None
            positions = kv.placed_positions(at) if kv.placed_at is None else None
            t = 0
            for p, n in item.segs:
                out = self.arena.k[:, :, p : p + n]
                if positions is not None:
                    rotations.append((kv.k[:, :, t : t + n], positions[..., t : t + n], out))
                elif kv.placed_at == at:
                    out.copy_(kv.k[:, :, t : t + n])
                else:
                    assert kv.placed_at is not None
                    relocate(kv.k[:, :, t : t + n], at - kv.placed_at, self.spec, self.kernel, out)
                if values:
                    self.arena.v[:, :, p : p + n] = kv.v[:, :, t : t + n]
                t += n
            item.placed_start = at
            self.tokens_rotated += kv.n_tokens
        if rotations:
            rotate_many(rotations, self.spec, self.kernel)


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint ``(start, length)`` ranges with touching ones joined."""
    out: list[tuple[int, int]] = []
    for p, n in sorted(ranges):
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((p, n))
    return out
