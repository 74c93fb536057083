"""Content-addressed prompt reuse across chat requests.

A request's prompt (``chat.render``) becomes *planning units*: one per text token and one per
image, so an image is atomic. An image's unit id is interned from its content key: ids above the
vocabulary, handed out once and never reused (when they run out the indexes start afresh), so
two different images never share an id. (The CDC hash tables ids up to the largest one, which
rules out using the content hash itself as the id.)

The planner (``cache/planner.py``) cuts the units at piece boundaries and by content-defined
chunking, matches the exact prefix in its radix tree, then looks up each later chunk by content.
Execution walks the plan in order:

- a reused chunk (prefix hit, or relocated hit moved by δ) takes its KV from the store, pre-RoPE,
  and is rotated to its start in this prompt; no forward pass, no vision encoder;
- a run of misses is prefilled on the cache assembled from everything before it, so it attends
  to the reused KV exactly as it would to its own;
- the prompt's last token is always prefilled, for the logits of the first generated token.

What is stored: each chunk's KV *as computed in the request that first prefilled it*, pre-RoPE,
under ``record_key(content key, "conditioned")``. A relocated hit reuses it blind (without a
conditioning patch): the simplest sound choice, whose error DESIGN.md measures (next-token KL
about 0.04 on SmolLM2 for a 256-token chunk moved behind other text). An exact-prefix hit is the
same KV at the same positions, so it is exact. Content keys carry the tenant's salt
(``Namespace.tenant_salt``): tenants never share an entry, a radix root or an index key.

Every prompt is committed as a :class:`Record` (its chunk table: unit span -> store key), the
payload the radix tree and content index point at. A reused chunk whose store entry was
evicted becomes a miss and is prefilled and stored again. Each entry certifies the tokens it was
computed for (:meth:`PromptCache.fingerprint`, images by content key), and every read asks the
store for exactly those: an entry found under the wrong key is refused and prefilled instead. A
chunk the indexes do not know but the store holds (written before a restart, or by another
process on a shared disk tier) is found by its key and reused like a relocated hit.

Replicas: with a shared tier in the store (Redis), the keys a plan needs and no local tier holds,
its misses' included, are asked for in one round trip before the chunks are fetched
(``TieredStore.prefetch``). A miss found there was prefilled by another replica: the store now
holds it, so it is reused like any chunk the store holds but the indexes do not, and counted in
``shared_tokens``. Its source position is unknown, so it is not counted in ``rotated_tokens``.

Not here: patches for relocated chunks, sampling (``generation.py``), threads (``runtime.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from agent.adapters.base import ChunkInput, ImageInput, ModelAdapter
from agent.server.chat import ImagePiece, Piece, TextPiece
from cache.index import ContentIndex, RadixTree
from cache.keys import Namespace, token_bytes, token_key
from cache.layout import ChunkKV, place_window
from cache.planner import Plan, Planner, PlannerConfig
from cache.rope import KERNELS
from cache.store import Entry, EntryTooLargeError, TieredStore, TierFullError, record_key


class NoImagesError(ValueError):
    """The model takes no image input."""


@dataclass(frozen=True)
class Prompt:
    """A prompt as planning units. ``tok_off``/``pos_off`` [U + 1]: tokens and positions before
    each unit (an image's extent is not its token count under M-RoPE)."""

    units: np.ndarray  # [U] int64
    inputs: tuple[ChunkInput, ...]  # one per piece
    piece_unit: np.ndarray  # [P + 1] unit offset of each piece
    tok_off: np.ndarray  # [U + 1]
    pos_off: np.ndarray  # [U + 1]

    @property
    def n_tokens(self) -> int:
        return int(self.tok_off[-1])

    @property
    def n_images(self) -> int:
        return sum(isinstance(i, ImageInput) for i in self.inputs)

    def inputs_between(self, a: int, b: int) -> list[ChunkInput]:
        """Model inputs covering units [a, b): text of adjacent pieces merged, images whole."""
        out: list[ChunkInput] = []
        text: list[torch.Tensor] = []
        for p, inp in enumerate(self.inputs):
            s, e = int(self.piece_unit[p]), int(self.piece_unit[p + 1])
            lo, hi = max(a, s), min(b, e)
            if lo >= hi:
                continue
            if isinstance(inp, ImageInput):
                if text:
                    out.append(_text_input(text))
                    text = []
                out.append(inp)
            else:
                text.append(inp.ids[lo - s : hi - s])
        if text:
            out.append(_text_input(text))
        return out


def _text_input(parts: list[torch.Tensor]) -> ChunkInput:
    from agent.adapters.base import TextInput

    return TextInput(torch.cat(parts) if len(parts) > 1 else parts[0])


def build_prompt(adapter: ModelAdapter, pieces: Sequence[Piece], image_unit: Callable[[str], int]) -> Prompt:
    """Pieces to model inputs (images preprocessed, not encoded) and planning units."""
    inputs: list[ChunkInput] = []
    units: list[int] = []
    n_tok: list[int] = []
    ext: list[int] = []
    piece_unit = [0]
    for piece in pieces:
        if isinstance(piece, TextPiece):
            inputs.append(adapter.text(list(piece.ids)))
            units.extend(piece.ids)
            n_tok.extend([1] * len(piece.ids))
            ext.extend([1] * len(piece.ids))
        elif isinstance(piece, ImagePiece):
            image_of = getattr(adapter, "image", None)
            if image_of is None:
                raise NoImagesError(f"model {adapter.info.name} takes no image or video input")
            inp = image_of(piece.image)
            inputs.append(inp)
            units.append(image_unit(inp.content_key))
            n_tok.append(inp.n_tokens)
            ext.append(adapter.chunk_positions(inp)[1])
        piece_unit.append(len(units))
    return Prompt(
        units=np.asarray(units, dtype=np.int64),
        inputs=tuple(inputs),
        piece_unit=np.asarray(piece_unit, dtype=np.int64),
        tok_off=np.concatenate([[0], np.cumsum(n_tok, dtype=np.int64)]),
        pos_off=np.concatenate([[0], np.cumsum(ext, dtype=np.int64)]),
    )


def slice_kv(kv: ChunkKV, t0: int, t1: int, p0: int, extent: int) -> ChunkKV:
    """Tokens [t0, t1) of ``kv``, positions counted from ``p0``."""
    if t0 == 0 and t1 == kv.n_tokens and p0 == 0:
        return kv
    return ChunkKV(kv.k[:, :, t0:t1], kv.v[:, :, t0:t1], kv.positions[..., t0:t1] - p0, extent, kv.family)


def concat_kv(parts: Sequence[ChunkKV]) -> ChunkKV:
    """Chunks laid end to end, each starting where the previous one's extent ends."""
    if len(parts) == 1:
        return parts[0]
    offsets = np.cumsum([0] + [p.extent for p in parts])
    return ChunkKV(
        torch.cat([p.k for p in parts], dim=2),
        torch.cat([p.v for p in parts], dim=2),
        torch.cat([p.positions + int(o) for p, o in zip(parts, offsets, strict=False)], dim=-1),
        int(offsets[-1]),
        parts[0].family,
    )


@dataclass(eq=False)
class Record:
    """A committed prompt: its chunks (unit span, store key), unit offsets and units."""

    chunks: tuple[tuple[int, int, str], ...]
    tok_off: np.ndarray
    pos_off: np.ndarray
    units: np.ndarray  # what each entry must certify (see PromptCache.fingerprint)


@dataclass(frozen=True)
class PromptCacheConfig:
    """planner: chunking and verification. max_radix_tokens / max_index_entries bound the two
    indexes (their payloads are small records; the KV itself is in the store's budget).
    rope_kernel: rotation kernel (``cache.rope.KERNELS``). max_tenants: planners kept."""

    planner: PlannerConfig = field(default_factory=PlannerConfig)
    max_radix_tokens: int = 1 << 20
    max_index_entries: int = 1 << 16
    rope_kernel: str = "auto"
    max_tenants: int = 1024

    def __post_init__(self) -> None:
        if min(self.max_radix_tokens, self.max_index_entries, self.max_tenants) < 1:
            raise ValueError("prompt cache bounds must be positive")
        if self.rope_kernel not in KERNELS:
            raise ValueError(f"unknown rope_kernel {self.rope_kernel!r}; choose from {sorted(KERNELS)}")


class PromptUsage(NamedTuple):
    prompt_tokens: int
    prefix_tokens: int  # reused from the exact prefix
    relocated_tokens: int  # reused by content, moved by rotation
    prefilled_tokens: int
    rotated_tokens: int  # reused tokens whose position changed (δ != 0)
    lost_entries: int  # planned reuse whose store entry was gone (prefilled instead)
    vision_encoder_calls: int
    shared_tokens: int = 0  # reused tokens whose KV came from the shared tier (another replica)

    @property
    def cached_tokens(self) -> int:
        return self.prefix_tokens + self.relocated_tokens


class _Step(NamedTuple):
    start: int
    end: int
    kv: ChunkKV | None  # reused KV; None for a miss
    delta: int
    prefix: bool
    shared: bool = False  # its KV came from the shared tier on this request


@dataclass
class Prepared:
    """A prefilled prompt: generate from ``logits`` at ``position`` on ``cache``, then commit."""

    cache: Any
    logits: torch.Tensor
    position: int
    usage: PromptUsage
    prompt: Prompt
    plan: Plan
    planner: Planner
    chunks: list[tuple[int, int, ChunkKV]]
    stored: bool = False


class PromptCache:
    """Plans, assembles and commits prompts of one model on a shared store. One caller at a time."""

    def __init__(
        self, adapter: ModelAdapter, store: TieredStore, config: PromptCacheConfig | None = None
    ) -> None:
        self.adapter, self.store = adapter, store
        self.config = config or PromptCacheConfig()
        self.radix = RadixTree(self.config.planner.eviction)
        self.index = ContentIndex(self.config.planner.verify, self.config.max_index_entries)
        self._planners: OrderedDict[str, Planner] = OrderedDict()
        vocab = getattr(getattr(adapter, "model", None), "get_input_embeddings", lambda: None)()
        size = int(getattr(vocab, "num_embeddings", 1 << 20))
        self._image_base = 1 << max(16, size.bit_length())
        self._image_ids: dict[str, int] = {}
        self._image_keys: dict[int, str] = {}

    def image_unit(self, content_key: str) -> int:
        """The planning id of an image: one per distinct content key, never reused."""
        unit = self._image_ids.get(content_key)
        if unit is None:
            if len(self._image_ids) >= self._image_base:  # ids used up: forget every index entry
                self.reset()
            unit = self._image_base + len(self._image_ids)
            self._image_ids[content_key] = unit
            self._image_keys[unit] = content_key
        return unit

    def fingerprint(self, units: np.ndarray) -> str:
        """What a stored chunk of ``units`` [n] certifies: its token ids and, for each image, its
        content key (image ids are interned per process, so two processes sharing a disk tier, or
        one restarted, may give one id to two different images)."""
        h = hashlib.blake2b(token_bytes(units), digest_size=16, person=b"kamera-entry")
        for unit in units[units >= self._image_base]:
            h.update(self._image_keys[int(unit)].encode())
        return h.hexdigest()

    def reset(self) -> None:
        """Empty the indexes (store entries stay until evicted, unreachable)."""
        self.radix = RadixTree(self.config.planner.eviction)
        self.index = ContentIndex(self.config.planner.verify, self.config.max_index_entries)
        self._planners.clear()
        self._image_ids.clear()
        self._image_keys.clear()

    def namespace(self, tenant_salt: str) -> Namespace:
        info = self.adapter.info
        return Namespace(
            model=info.fingerprint, dtype=str(info.dtype).removeprefix("torch."), tenant_salt=tenant_salt
        )

    def planner(self, tenant_salt: str) -> Planner:
        planner = self._planners.get(tenant_salt)
        if planner is None:
            planner = Planner(self.namespace(tenant_salt), self.config.planner, self.radix, self.index)
            self._planners[tenant_salt] = planner
            if len(self._planners) > self.config.max_tenants:
                self._planners.popitem(last=False)
        self._planners.move_to_end(tenant_salt)
        return planner

    # --- prepare: plan, fetch, rotate, prefill misses -----------------------------------

    def prepare(self, prompt: Prompt, tenant_salt: str = "") -> Prepared:
        if len(prompt.units) == 0:
            raise ValueError("empty prompt")
        planner = self.planner(tenant_salt)
        encoder_before = int(getattr(self.adapter, "vision_encoder_calls", 0))
        plan = planner.plan(prompt.units, prompt.piece_unit.tolist())
        fetched = self._prefetch(plan)
        plan = self._from_store(plan, prompt)
        steps, lost = self._steps(prompt, plan, fetched)
        split = plan.chunks[-1].status != "miss" and plan.chunks[-1].n_tokens > 1
        spec, kernel = self.adapter.spec, self.config.rope_kernel
        placed: list[tuple[ChunkKV, int]] = []  # reused or prefilled chunks and their starts
        chunks: list[tuple[int, int, ChunkKV]] = []
        cache: Any = None
        logits: torch.Tensor | None = None
        counts = {"prefix": 0, "relocated": 0, "prefilled": 0, "rotated": 0, "shared": 0}
        i = 0
        while i < len(steps):
            step = steps[i]
            start = int(prompt.pos_off[step.start])
            n_tok = int(prompt.tok_off[step.end] - prompt.tok_off[step.start])
            if step.kv is not None:
                placed.append((step.kv, start))
                chunks.append((step.start, step.end, step.kv))
                counts["prefix" if step.prefix else "relocated"] += n_tok
                counts["rotated"] += n_tok if step.delta else 0
                counts["shared"] += n_tok if step.shared else 0
                cache = None
                i += 1
                continue
            j = i  # a run of misses is prefilled in one pass
            while j + 1 < len(steps) and steps[j + 1].kv is None:
                j += 1
            a, b = step.start, steps[j].end
            if cache is None:
                cache = (
                    self.adapter.cache_from(*place_window(placed, spec, kernel))
                    if placed
                    else self.adapter.empty_cache()
                )
            parts, pos = [], start
            for inp in prompt.inputs_between(a, b):
                out = self.adapter.prefill(inp, cache, pos)
                parts.append(out.kv)
                pos += out.kv.extent
                logits = out.logits[-1]
            run = concat_kv(parts)
            counts["prefilled"] += run.n_tokens
            t_a, p_a = int(prompt.tok_off[a]), int(prompt.pos_off[a])
            for s in steps[i : j + 1]:
                t0, t1 = int(prompt.tok_off[s.start]) - t_a, int(prompt.tok_off[s.end]) - t_a
                p0 = int(prompt.pos_off[s.start]) - p_a
                extent = int(prompt.pos_off[s.end] - prompt.pos_off[s.start])
                kv = slice_kv(run, t0, t1, p0, extent)
                chunks.append((s.start, s.end, kv))
                if j + 1 < len(steps):  # reused chunks follow: the cache will be rebuilt
                    placed.append((kv, int(prompt.pos_off[s.start])))
            i = j + 1
        if logits is None or cache is None:  # _steps always leaves the last unit a miss
            raise RuntimeError("the prompt's last token was not prefilled")
        if split and len(chunks) >= 2:  # store the split final chunk whole, under its planned key
            (s0, _, kv0), (_, e1, kv1) = chunks[-2:]
            chunks[-2:] = [(s0, e1, concat_kv([kv0, kv1]))]
        usage = PromptUsage(
            prompt_tokens=prompt.n_tokens,
            prefix_tokens=counts["prefix"],
            relocated_tokens=counts["relocated"],
            prefilled_tokens=counts["prefilled"],
            rotated_tokens=counts["rotated"],
            lost_entries=lost,
            vision_encoder_calls=int(getattr(self.adapter, "vision_encoder_calls", 0)) - encoder_before,
            shared_tokens=counts["shared"],
        )
        return Prepared(cache, logits, int(prompt.pos_off[-1]), usage, prompt, plan, planner, chunks)

    def _steps(self, prompt: Prompt, plan: Plan, fetched: frozenset[str]) -> tuple[list[_Step], int]:
        """The plan as steps with their reused KV fetched; the last unit always a miss."""
        raw = [(c.start, c.end, c.status, c.source_start, c.payload) for c in plan.chunks]
        s, e, status, src, payload = raw[-1]
        if status != "miss":
            raw[-1:] = [(s, e - 1, status, src, payload)] if e - 1 > s else []
            raw.append((e - 1, e, "miss", None, None))
        segments = self._prefix_map(plan)
        steps, lost = [], 0
        for s, e, status, src, payload in raw:
            kv, keys = None, []
            if status == "prefix-hit":
                kv = self._prefix_kv(segments, s, e)
                keys = _prefix_keys(segments, s, e)
            elif status == "relocated-hit" and isinstance(payload, Record) and src is not None:
                kv = self._record_kv(payload, src, src + e - s)
                keys = _overlap(payload, src, src + e - s)
            if kv is not None and (
                kv.n_tokens != prompt.tok_off[e] - prompt.tok_off[s]
                or kv.extent != prompt.pos_off[e] - prompt.pos_off[s]
            ):
                kv = None
            lost += int(status != "miss" and kv is None)
            delta = 0 if status == "prefix-hit" or src is None else s - src
            shared = kv is not None and not fetched.isdisjoint(keys)
            steps.append(_Step(s, e, kv, delta, status == "prefix-hit", shared))
        return steps, lost

    def _from_store(self, plan: Plan, prompt: Prompt) -> Plan:
        """``plan`` with each miss the store holds (by its key) turned into a relocated hit on a
        record of this prompt: chunks written before a restart or by another process."""
        found = [
            (c.start, c.end, record_key(c.key.hex, "conditioned"))
            for c in plan.chunks
            if c.status == "miss" and record_key(c.key.hex, "conditioned") in self.store
        ]
        if not found:
            return plan
        rec = Record(tuple(found), prompt.tok_off, prompt.pos_off, prompt.units)
        spans = {(s, e) for s, e, _ in found}
        chunks = tuple(
            c._replace(status="relocated-hit", source_start=c.start, payload=rec)
            if c.status == "miss" and (c.start, c.end) in spans
            else c
            for c in plan.chunks
        )
        return plan._replace(chunks=chunks)

    def _prefetch(self, plan: Plan) -> frozenset[str]:
        """One round trip to the store's shared tier for every entry the plan needs that no local
        tier holds (its misses' too: another replica may have prefilled them); the keys found."""
        if self.store.shared is None:
            return frozenset()
        misses = [record_key(c.key.hex, "conditioned") for c in plan.chunks if c.status == "miss"]
        keys = [*misses, *_prefix_keys(self._prefix_map(plan), 0, plan.prefix_len)]
        for c in plan.chunks:
            if c.status == "relocated-hit" and isinstance(c.payload, Record) and c.source_start is not None:
                keys += _overlap(c.payload, c.source_start, c.source_start + c.n_tokens)
        return self.store.prefetch(keys)

    @staticmethod
    def _prefix_map(plan: Plan) -> list[tuple[int, int, Record, int]]:
        out, at = [], 0
        for seg in plan.prefix:
            if isinstance(seg.payload, Record):
                out.append((at, at + seg.length, seg.payload, seg.offset))
            at += seg.length
        return out

    def _prefix_kv(self, segments: list[tuple[int, int, Record, int]], s: int, e: int) -> ChunkKV | None:
        parts = []
        for lo, hi, rec, offset in segments:
            a, b = max(s, lo), min(e, hi)
            if a >= b:
                continue
            kv = self._record_kv(rec, offset + a - lo, offset + b - lo)
            if kv is None:
                return None
            parts.append(kv)
        covered = sum(min(e, hi) - max(s, lo) for lo, hi, _, _ in segments if min(e, hi) > max(s, lo))
        return concat_kv(parts) if parts and covered == e - s else None

    def _record_kv(self, rec: Record, a: int, b: int) -> ChunkKV | None:
        """KV of units [a, b) of a committed prompt, from the store; None if any entry is gone."""
        parts = []
        for cs, ce, key in rec.chunks:
            if ce <= a or cs >= b:
                continue
            entry = self.store.get(key, self.fingerprint(rec.units[cs:ce]))
            if entry is None:
                return None
            t = entry.tensors
            kv = ChunkKV(t["k"], t["v"], t["positions"], int(entry.meta["extent"]), entry.meta["family"])
            if kv.n_tokens != rec.tok_off[ce] - rec.tok_off[cs]:
                return None
            lo, hi = max(a, cs), min(b, ce)
            parts.append(
                slice_kv(
                    kv,
                    int(rec.tok_off[lo] - rec.tok_off[cs]),
                    int(rec.tok_off[hi] - rec.tok_off[cs]),
                    int(rec.pos_off[lo] - rec.pos_off[cs]),
                    int(rec.pos_off[hi] - rec.pos_off[lo]),
                )
            )
        return concat_kv(parts) if parts else None

    # --- commit: store new chunks, index the prompt -------------------------------------

    def commit(self, prepared: Prepared) -> int:
        """Store the KV of every chunk not already stored and index the prompt; entries written."""
        if prepared.stored:
            return 0
        prepared.stored = True
        ns = prepared.planner.namespace
        units = prepared.prompt.units
        table, written = [], 0
        for s, e, kv in prepared.chunks:
            key = record_key(token_key(ns, units[s:e]).hex, "conditioned")
            table.append((s, e, key))
            if key in self.store:
                continue
            entry = Entry(
                {"k": kv.k, "v": kv.v, "positions": kv.positions},
                {"n_tokens": kv.n_tokens, "extent": kv.extent, "family": kv.family},
                tokens=self.fingerprint(units[s:e]),
            )
            with contextlib.suppress(EntryTooLargeError, TierFullError):
                self.store.put(key, entry)
                written += 1
        record = Record(tuple(table), prepared.prompt.tok_off, prepared.prompt.pos_off, units)
        prepared.planner.commit(prepared.plan, units, record)
        excess = self.radix.total_tokens - self.config.max_radix_tokens
        if excess > 0:
            self.radix.evict(excess)
        prepared.chunks = []  # the tensors now live in the store (or were refused)
        return written


def _overlap(rec: Record, a: int, b: int) -> list[str]:
    """Store keys of the chunks of ``rec`` that overlap units [a, b)."""
    return [key for cs, ce, key in rec.chunks if ce > a and cs < b]


def _prefix_keys(segments: list[tuple[int, int, Record, int]], s: int, e: int) -> list[str]:
    """Store keys holding prefix units [s, e), through the plan's prefix segments."""
    out = []
    for lo, hi, rec, off in segments:
        a, b = max(s, lo), min(e, hi)
        if a < b:
            out += _overlap(rec, off + a - lo, off + b - lo)
    return out


def elapsed_ms(t0: float) -> float:
    return 1000 * (time.perf_counter() - t0)
