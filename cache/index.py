"""The two indexes the planner consults: an exact-prefix radix tree and a content index.

``RadixTree`` maps token sequences under a namespace (``RadixKey.extra_key``) to the opaque
payloads that hold their KV, edge by edge: a node's edge is ``length`` tokens at ``offset`` in
the sequence of its ``payload``. Leaves are evicted by a policy chosen by name.

``ContentIndex`` maps a chunk's content key to an entry that keeps the chunk's token ids (or a
fingerprint of them); a lookup compares them and refuses a key whose tokens differ, counting
it, so a forged or accidental collision never serves foreign KV.

What this module does not do: compute keys (``cache/keys.py``), chunk (``cache/cdc.py``) or
hold KV tensors; payloads are handles the caller gives and gets back.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch

from cache.keys import ContentKey, digest_key, token_bytes


class RadixKey(NamedTuple):
    """Token ids under a namespace; sequences of different ``extra_key`` never share a prefix."""

    token_ids: Sequence[int] | np.ndarray | torch.Tensor
    extra_key: bytes | str = b""


class Segment(NamedTuple):
    """``length`` tokens stored at ``offset`` in the sequence whose handle is ``payload``."""

    payload: object
    offset: int
    length: int


class RadixNode:
    """One edge of the tree. Internal state; read ``depth``, ``segment`` and ``last_access``."""

    __slots__ = ("children", "depth", "hits", "last_access", "offset", "parent", "payload", "tokens")

    def __init__(
        self, tokens: np.ndarray, parent: RadixNode | None, payload: object, offset: int, clock: int
    ) -> None:
        self.tokens: np.ndarray = tokens  # edge label [E] int64
        self.parent: RadixNode | None = parent
        self.children: dict[int, RadixNode] = {}
        self.payload: object = payload
        self.offset: int = offset
        self.depth: int = (parent.depth if parent else 0) + len(tokens)
        self.last_access: int = clock
        self.hits: int = 0

    @property
    def segment(self) -> Segment:
        return Segment(self.payload, self.offset, len(self.tokens))


class MatchResult(NamedTuple):
    matched_len: int
    node: RadixNode | None  # deepest node reached (the match may end inside its edge)
    segments: tuple[Segment, ...]  # cover tokens [0, matched_len) in order

    @property
    def payload(self) -> object:
        """Handle holding the last matched tokens (None when nothing matched)."""
        return self.segments[-1].payload if self.segments else None


class InsertResult(NamedTuple):
    prefix_len: int  # tokens already in the tree
    new_tokens: int


class EvictResult(NamedTuple):
    evicted_tokens: int
    segments: tuple[Segment, ...]  # what the caller may now release


EvictionPolicy = Callable[[RadixNode], tuple[int, ...]]
EVICTION_POLICIES: dict[str, EvictionPolicy] = {
    "lru": lambda n: (n.last_access,),
    "lfu": lambda n: (n.hits, n.last_access),
}


def _as_ids(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


def _common_len(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


class RadixTree:
    """Exact-prefix index. Every method is O(matched edges); ``evict`` is O(leaves log leaves)."""

    def __init__(self, policy: str = "lru") -> None:
        if policy not in EVICTION_POLICIES:
            raise KeyError(f"unknown eviction policy {policy!r}; known: {sorted(EVICTION_POLICIES)}")
        self._priority = EVICTION_POLICIES[policy]
        self._roots: dict[bytes | str, RadixNode] = {}
        self._clock = 0
        self.total_tokens = 0

    def _root(self, extra_key: bytes | str) -> RadixNode:
        if extra_key not in self._roots:
            self._roots[extra_key] = RadixNode(np.zeros(0, dtype=np.int64), None, None, 0, self._clock)
        return self._roots[extra_key]

    def _walk(self, key: RadixKey, split: bool) -> tuple[RadixNode, int, list[Segment], RadixNode | None]:
        """Follow ``key`` down; return (last full node, matched length, segments, partial child)."""
        self._clock += 1
        ids = _as_ids(key.token_ids)
        node, i, segments = self._root(key.extra_key), 0, []
        while i < len(ids) and (child := node.children.get(int(ids[i]))) is not None:
            c = _common_len(child.tokens, ids[i:])
            child.last_access, child.hits = self._clock, child.hits + 1
            segments.append(Segment(child.payload, child.offset, c))
            i += c
            if c < len(child.tokens):
                if not split:
                    return node, i, segments, child
                child = self._split(child, c)
            node = child
        return node, i, segments, None

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut ``child``'s edge after ``at`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None  # the root is never split: its edge is empty
        upper = RadixNode(child.tokens[:at], parent, child.payload, child.offset, child.last_access)
        upper.hits = child.hits
        parent.children[int(child.tokens[0])] = upper
        child.tokens, child.offset, child.parent = child.tokens[at:], child.offset + at, upper
        upper.children[int(child.tokens[0])] = child
        return upper

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest stored prefix of ``key``; refreshes the access time of the nodes on it."""
        node, n, segments, partial = self._walk(key, split=False)
        deepest = partial or (node if node.parent is not None else None)
        return MatchResult(n, deepest, tuple(segments))

    def payloads_below(self, node: RadixNode | None, limit: int = 8) -> tuple[object, ...]:
        """Up to ``limit`` distinct payloads of ``node`` and the nodes under it, nearest first
        and, among siblings, the last used first: the stored sequences that go on past where a
        match ended (a node keeps the payload of the sequence that made its edge)."""
        out: list[object] = []
        seen: set[int] = set()
        level = [node] if node is not None and node.parent is not None else []
        while level and len(out) < limit:
            for n in level:
                if n.payload is not None and id(n.payload) not in seen:
                    seen.add(id(n.payload))
                    out.append(n.payload)
                    if len(out) == limit:
                        break
            level = sorted(
                (c for n in level for c in n.children.values()), key=lambda c: c.last_access, reverse=True
            )
        return tuple(out)

    def insert(self, key: RadixKey, payload: object) -> InsertResult:
        """Add ``key``'s tokens; new tokens are stored as ``payload`` at their offsets in ``key``.

        Tokens already present keep their existing payload.
        """
        ids = _as_ids(key.token_ids)
        node, n, _, _ = self._walk(key, split=True)
        if n < len(ids):
            leaf = RadixNode(ids[n:].copy(), node, payload, n, self._clock)
            node.children[int(ids[n])] = leaf
            self.total_tokens += len(ids) - n
        return InsertResult(n, len(ids) - n)

    def evict(self, n_tokens: int) -> EvictResult:
        """Remove leaves, lowest policy priority first, until ``n_tokens`` are freed or none are left."""
        heap = [(self._priority(n), id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        freed, segments = 0, []
        while heap and freed < n_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[int(leaf.tokens[0])]
            freed += len(leaf.tokens)
            segments.append(leaf.segment)
            if not parent.children and parent.parent is not None:
                heapq.heappush(heap, (self._priority(parent), id(parent), parent))
        self.total_tokens -= freed
        return EvictResult(freed, tuple(segments))

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                out.append(n)
        return out


@dataclass(frozen=True)
class ContentEntry:
    """A stored chunk: where its KV lives (``payload``) and where it sat when stored."""

    key: ContentKey
    n_tokens: int
    check: bytes  # token bytes, or their fingerprint
    payload: object
    source_start: int


class Lookup(NamedTuple):
    status: Literal["hit", "miss", "collision"]
    entry: ContentEntry | None


_MISS = Lookup("miss", None)
_COLLISION = Lookup("collision", None)


@dataclass
class IndexStats:
    hits: int = 0
    misses: int = 0
    collisions: int = 0  # same key, different tokens: refused
    inserts: int = 0
    evictions: int = 0


def fingerprint(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> bytes:
    """16 bytes of the token ids' digest, a key kind of its own, so independent of the content key."""
    return _fingerprint(token_bytes(tokens))


def _fingerprint(data: bytes) -> bytes:
    return digest_key("fingerprint", [data]).digest[:16]


TokenIds = Sequence[int] | np.ndarray | torch.Tensor


class ContentIndex:
    """Content key -> entry, verified on every hit; LRU-bounded when ``max_entries`` is set.

    verify: "tokens" keeps the ids (exact), "fingerprint" a 16-byte hash of them (smaller).
    Entries are held by digest (bytes hash and compare in C; ``ContentKey`` would go through
    Python-level ``__hash__`` and ``__eq__`` on every probe).
    """

    def __init__(self, verify: Literal["tokens", "fingerprint"] = "tokens", max_entries: int | None = None):
        if verify not in ("tokens", "fingerprint"):
            raise ValueError(f"verify must be 'tokens' or 'fingerprint', got {verify!r}")
        if max_entries is not None and max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.verify = verify
        self.max_entries = max_entries
        self.stats = IndexStats()
        self._entries: OrderedDict[bytes, ContentEntry] = OrderedDict()

    def _check(self, chunk: bytes) -> bytes:
        """What an entry keeps to verify a hit, from the chunk's token bytes."""
        return chunk if self.verify == "tokens" else _fingerprint(chunk)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, ContentKey) and key.digest in self._entries

    def lookup(self, key: ContentKey, tokens: TokenIds) -> Lookup:
        """Entry for ``key`` if its stored tokens equal ``tokens``; counts hit, miss or collision."""
        return self._lookup(key, token_bytes(tokens))

    def lookup_many(
        self, keys: Sequence[ContentKey], tokens: TokenIds, spans: Sequence[tuple[int, int]]
    ) -> list[Lookup]:
        """``lookup(keys[i], tokens[s:e])`` for each ``(s, e) = spans[i]``, in order; tokens [T].

        The token bytes are built once and sliced per chunk.
        """
        data = token_bytes(tokens)
        return [self._lookup(k, data[8 * s : 8 * e]) for k, (s, e) in zip(keys, spans, strict=True)]

    def _lookup(self, key: ContentKey, chunk: bytes) -> Lookup:
        entry = self._entries.get(key.digest)
        if entry is None:
            self.stats.misses += 1
            return _MISS
        if entry.check != self._check(chunk):
            self.stats.collisions += 1
            return _COLLISION
        self.stats.hits += 1
        self._entries.move_to_end(key.digest)
        return Lookup("hit", entry)

    def insert(self, key: ContentKey, tokens: TokenIds, payload: object, source_start: int = 0) -> Lookup:
        """Store a chunk. An existing entry with the same tokens is kept ("hit"); one with other
        tokens under the same key is left alone and the insert refused ("collision")."""
        return self._insert(key, token_bytes(tokens), payload, source_start)

    def insert_many(
        self,
        keys: Sequence[ContentKey],
        tokens: TokenIds,
        spans: Sequence[tuple[int, int]],
        payload: object,
        refresh: bool = False,
    ) -> list[Lookup]:
        """``insert(keys[i], tokens[s:e], payload, s)`` for each ``(s, e) = spans[i]``; tokens [T].
        refresh: an existing entry with the same tokens is pointed at ``payload`` (and its start
        there) instead of kept as it was."""
        data = token_bytes(tokens)
        return [
            self._insert(k, data[8 * s : 8 * e], payload, s, refresh)
            for k, (s, e) in zip(keys, spans, strict=True)
        ]

    def _insert(
        self, key: ContentKey, chunk: bytes, payload: object, source_start: int, refresh: bool = False
    ) -> Lookup:
        check = self._check(chunk)
        old = self._entries.get(key.digest)
        if old is not None:
            if old.check != check:
                self.stats.collisions += 1
                return _COLLISION
            if refresh:
                old = ContentEntry(old.key, old.n_tokens, old.check, payload, source_start)
                self._entries[key.digest] = old
                self._entries.move_to_end(key.digest)
            return Lookup("hit", old)
        entry = ContentEntry(key, len(chunk) // 8, check, payload, source_start)
        self._entries[key.digest] = entry
        self.stats.inserts += 1
        if self.max_entries is not None and len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.stats.evictions += 1
        return Lookup("miss", entry)

    def remove(self, key: ContentKey) -> ContentEntry | None:
        return self._entries.pop(key.digest, None)
