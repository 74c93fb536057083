"""The context manager's vocabulary: where a window chunk's KV came from, the window's config,
what a user sees of a chunk, what the window did (counters), and its slots (a chunk's placement
in the window with what the manager knows of it).

Not here: the operations (``agent/context.py``), what a chunk leaves in the store
(``agent/keep.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, NamedTuple

from agent.adapters.base import ChunkInput, ImageInput
from agent.modes import (
    DEFAULT_MODE,
    REPAIR_DEPTH_UNIT,
    REPAIR_MARGIN,
    REPAIR_MARGIN_CAP,
    REPAIR_MAX_RATIO,
    REPAIR_RATIO,
    REPAIR_RESIDUAL_UNIT,
    ReuseMode,
    check_mode,
    give_up_residual,
)
from cache.keys import DigestChain, digest_key
from cache.patch import PatchConfig
from cache.rank import rank_strategy
from cache.rope import KERNELS
from cache.window import Placement


class Source(StrEnum):
    """Where a window chunk's KV came from."""

    PREFIX = "prefix"  # the pinned prefix, prefilled once at position 0
    PREFILLED = "prefilled"  # prefilled in this window: exact conditioned KV
    ROTATED = "rotated"  # a survivor of a slide or reorder: its conditioned KV, moved
    PATCHED = "canonical+patch"  # recalled: canonical + the patch for its original antecedents
    ORBIT = "canonical+orbit"  # reordered: canonical + the orbit patch of the window's set
    CANONICAL = "canonical"  # no patch found: canonical KV alone (blind reuse)
    CONDITIONED = "conditioned"  # recalled: its stored conditioned KV (exact for its old antecedents)


# KV that equals a fresh prefill's (to rounding) while the chunks in front of it are those it was
# computed after: exact where it was prefilled, moved by rotation alone, or stored conditioned
EXACT_SOURCES = frozenset({Source.PREFIX, Source.PREFILLED, Source.ROTATED, Source.CONDITIONED})


@dataclass(frozen=True)
class WindowConfig:
    """budget_tokens: most tokens the window holds, prefix included. patch: how patches are fitted
    and stored. rope_kernel: rotation kernel name (``cache.rope.KERNELS``). headroom_tokens: spare
    room kept after the window in its buffer for a step's new tokens (it grows if a step needs
    more). max_offset: the largest position shift of the window in the live cache (default: the
    budget; 0 keeps the window at position 0, rotating survivors on every slide). orbit_orderings:
    orderings sampled per orbit fit. keep: what an evicted chunk leaves in the store:
    ``canonical+patch`` (its canonical KV, shared by every context it appears in, plus a small
    patch for its antecedents; one extra forward pass of the chunk alone) or ``conditioned``
    (its KV as computed in the window: exact on recall, no extra pass, but one full entry per
    context; for streams such as video where content rarely repeats in another context).
    reuse: how a step answers on the window: ``repair`` (the window's KV, moved and patched, with
    decoding guarded: a greedy step closer than the guard's margin goes to a fresh prefill of the
    window, :meth:`ContextManager.fresh_cache`), ``fast`` (the window's KV, unguarded) or
    ``exact`` (the window's KV where it is exact as it stands, every chunk computed after the
    chunks now in front of it; otherwise a fresh prefill of the window, vision features still
    reused by content). Repair is chat completions' (``agent.modes``): of the tokens of every
    chunk after the window's exact leading run, the repair_ratio share deviating most at layer 1
    is recomputed in the window (up to repair_max_ratio while the deviation left is above
    repair_residual_unit; :meth:`ContextManager.repair`); the guard's margin is repair_margin at a
    residual of repair_residual_unit and a depth of repair_depth_unit, scaled by the square root of
    the residual left times the depth the recomputed tokens measured (``agent.modes.guard_margin``);
    a window
    whose residual calls for more than repair_margin_cap is answered on a fresh prefill from the
    start, and so is one whose chance of a close call at its margin makes going on cost more than
    that prefill (repair_must_pay, ``agent/engine/close_calls.py``)."""

    budget_tokens: int = 4096
    patch: PatchConfig = field(default_factory=lambda: PatchConfig(rank=rank_strategy("fixed", rank=16)))
    rope_kernel: str = "auto"
    headroom_tokens: int = 256
    max_offset: int | None = None
    orbit_orderings: int = 4
    tenant_salt: str = ""
    keep: str = "canonical+patch"
    reuse: ReuseMode = DEFAULT_MODE
    repair_ratio: float = REPAIR_RATIO
    repair_max_ratio: float = REPAIR_MAX_RATIO
    repair_margin: float = REPAIR_MARGIN
    repair_residual_unit: float = REPAIR_RESIDUAL_UNIT
    repair_margin_cap: float = REPAIR_MARGIN_CAP
    repair_depth_unit: float = REPAIR_DEPTH_UNIT
    repair_must_pay: bool = True

    def __post_init__(self) -> None:
        if self.keep not in ("canonical+patch", "conditioned"):
            raise ValueError(f"keep must be 'canonical+patch' or 'conditioned', got {self.keep!r}")
        if self.budget_tokens <= 0:
            raise ValueError(f"budget_tokens must be positive, got {self.budget_tokens}")
        if self.headroom_tokens < 0 or (self.max_offset is not None and self.max_offset < 0):
            raise ValueError("headroom_tokens and max_offset must not be negative")
        if self.orbit_orderings < 1:
            raise ValueError("orbit_orderings must be at least 1")
        check_mode(self.reuse)
        if not 0.0 <= self.repair_ratio <= self.repair_max_ratio <= 1.0:
            raise ValueError(
                "need 0 <= repair_ratio <= repair_max_ratio <= 1, "
                f"got {self.repair_ratio} and {self.repair_max_ratio}"
            )
        for name in ("repair_margin", "repair_residual_unit", "repair_margin_cap", "repair_depth_unit"):
            if not 0.0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.rope_kernel not in KERNELS:
            raise ValueError(f"unknown rope_kernel {self.rope_kernel!r}; choose from {sorted(KERNELS)}")

    @property
    def give_up_residual(self) -> float:
        """The residual beyond which the guard's margin would exceed ``repair_margin_cap``."""
        return give_up_residual(self.repair_margin, self.repair_residual_unit, self.repair_margin_cap)


@dataclass(frozen=True)
class ChunkView:
    """One chunk of the window as a user sees it."""

    chunk_id: str
    kind: str
    n_tokens: int
    extent: int
    start: int
    source: Source
    meta: dict[str, Any]


@dataclass
class Counters:
    """What the window did, cumulatively. ``tokens_reused``: window tokens that a step's new
    tokens attended to without recomputing them (kept by whoever runs the steps)."""

    tokens_prefilled: int = 0
    tokens_reused: int = 0
    tokens_rotated: int = 0
    patches_applied: int = 0
    patches_fitted: int = 0
    canonical_encodes: int = 0
    fresh_prefills: int = 0  # steps answered on a fresh prefill of the window (exact, or a fallback)
    fresh_tokens: int = 0  # tokens those prefilled
    tokens_repaired: int = 0  # tokens of moved chunks recomputed through every layer (repair)
    recompute_on_miss: int = 0
    assemblies: int = 0
    rebuilds: int = 0
    slides: int = 0
    chunks_evicted: int = 0
    fit_ms: float = 0.0
    assemble_ms: float = 0.0


def context_key(chunk_ids: Iterable[str]) -> str:
    return digest_key("context", [cid.encode() for cid in chunk_ids]).hex


def set_key(chunk_ids: Iterable[str]) -> str:
    return "set-" + context_key(sorted(chunk_ids))


class ContextKeys:
    """:func:`context_key` of every prefix of a window's chunk ids, kept between calls: each id
    is hashed once while it and the ids before it stay in place, so asking for the keys of the
    window again, or after a chunk is appended, costs no hashing beyond the new ids."""

    def __init__(self) -> None:
        self.chain = DigestChain("context")

    def prefixes(self, chunk_ids: Sequence[str]) -> list[str]:
        """``context_key(chunk_ids[:i])`` for i = 0..len(chunk_ids)."""
        return [k.hex for k in self.chain.keys([cid.encode() for cid in chunk_ids])]


class RecallError(KeyError):
    """The chunk was never in this window, or is in it now."""


class Ensured(NamedTuple):
    """What :meth:`ContextManager.ensure` did: the chunk's id and how it got its place."""

    chunk_id: str
    how: Literal["present", "moved", "recalled", "appended"]


@dataclass(frozen=True)
class Evicted:
    """What an evicted chunk leaves behind: enough to find (or, on a store miss, rebuild) its KV."""

    chunk_id: str
    input: ChunkInput
    context_key: str
    meta: dict[str, Any]


@dataclass(eq=False, kw_only=True)  # a slot is itself: the same chunk may sit in the window twice
class Slot(Placement):
    """A window chunk: its placement (``kv``: the pre-RoPE KV this window uses for it) and what
    the context manager knows of it."""

    chunk_id: str
    input: ChunkInput
    source: Source
    context_key: str  # the antecedents it was prefilled after (its patch's key)
    meta: dict[str, Any]
    finalized: bool = False
    repaired: bool = False  # tokens of it recomputed in this window: its KV there is not what was stored


def slot_kind(slot: Slot) -> str:
    if slot.source == Source.PREFIX:
        return "prefix"
    return str(slot.meta.get("kind", "image" if isinstance(slot.input, ImageInput) else "text"))


def exact_run(slots: Sequence[Slot], chunk_ids: Sequence[str], contexts: Sequence[str]) -> int:
    """How many of ``slots`` after the first (the prefix) are ``chunk_ids``' leading ones with the
    KV a fresh prefill computes: each prefilled (or stored) after exactly the chunks now in front
    of it, in that order. Moved-and-patched KV, KV conditioned on other antecedents, or KV
    repaired in the window (tokens of it recomputed) ends it.
    ``contexts[i]``: the context key of ``slots[:i]`` (:meth:`ContextKeys.prefixes`)."""
    n = 0
    for i, (slot, cid) in enumerate(zip(slots[1:], chunk_ids, strict=False), 1):
        if (
            slot.chunk_id != cid
            or slot.source not in EXACT_SOURCES
            or slot.context_key != contexts[i]
            or slot.repaired
        ):
            break
        n += 1
    return n
