"""A chat request's prompt as planning units, and the keys its KV is filed under.

A prompt (``chat.render``) becomes *planning units*: one per text token and one per image, so an
image is atomic (:class:`Prompt`, made by :func:`build_prompt`). Its KV is stored in *segments* cut
at fixed points (:meth:`Prompt.cuts`: multiples of a block size and every image's edges), the
grain of the store's keys (exact reuse itself may end at any token, ``reuse.Finder``). The
prefill runs the segments in passes (:func:`passes`: as few as a bound allows, breaking at image
edges); the model's attention runs fixed blocks whole however a pass cuts them
(``agent/adapters/attention.py``), so the KV does not depend on how segments were grouped.

:class:`PromptKeys` names what is stored: a segment's KV under a key of its content and its
whole context (``chain_key(context, span)``), a chunk's alias under its content alone, and the
fingerprint each entry certifies (``cache.keys.fingerprint``: its token ids and images' content
keys). A committed prompt is a :class:`Record`: which entry holds the KV of each unit span.

Not here: reusing and prefilling (``prompt_cache.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from agent.adapters.base import ChunkInput, ImageInput, ModelAdapter, TextInput
from agent.adapters.vision import VisionAdapter
from agent.engine.chat import ImagePiece, Piece, TextPiece
from cache.keys import ContentKey, Namespace, chain_key, fingerprint, span_key
from cache.layout import ChunkKV
from cache.store import record_key


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

    def has_image(self, a: int, b: int) -> bool:
        """Whether units [a, b) hold an image."""
        return any(
            isinstance(inp, ImageInput) and int(self.piece_unit[p]) < b and int(self.piece_unit[p + 1]) > a
            for p, inp in enumerate(self.inputs)
        )

    def cuts(self, block_tokens: int | None) -> np.ndarray:
        """Unit offsets where prefill segments may start and end, sorted: 0, the end, every unit
        that starts on a multiple of ``block_tokens`` tokens (None: none), and both edges of
        every image."""
        starts = self.tok_off[:-1]
        edges = [0, len(self.units)]
        if block_tokens is not None:
            edges += np.flatnonzero(starts % block_tokens == 0).tolist()
        for p, inp in enumerate(self.inputs):
            if isinstance(inp, ImageInput):
                edges += [int(self.piece_unit[p]), int(self.piece_unit[p + 1])]
        return np.unique(np.asarray(edges, dtype=np.int64))

    def text_rows(self, a: int, b: int) -> torch.Tensor:
        """Token indices of the text units among units [a, b) (an image's tokens left out)."""
        rows: list[torch.Tensor] = []
        for p, inp in enumerate(self.inputs):
            s, e = int(self.piece_unit[p]), int(self.piece_unit[p + 1])
            lo, hi = max(a, s), min(b, e)
            if lo < hi and not isinstance(inp, ImageInput):
                rows.append(torch.from_numpy(self.tok_off[lo:hi].astype(np.int64)))
        return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)

    def key_parts(self, a: int, b: int) -> list[np.ndarray | str]:
        """Units [a, b) as ``span_key`` parts: text token ids, images by content key."""
        out: list[np.ndarray | str] = []
        for p, inp in enumerate(self.inputs):
            s, e = int(self.piece_unit[p]), int(self.piece_unit[p + 1])
            lo, hi = max(a, s), min(b, e)
            if lo < hi:
                out.append(inp.content_key if isinstance(inp, ImageInput) else self.units[lo:hi])
        return out

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
            if not isinstance(adapter, VisionAdapter):
                raise NoImagesError(f"model {adapter.info.name} takes no image or video input")
            inp = adapter.image(piece.image)
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


class TableRow(NamedTuple):
    """Units [start, end) of a record are the entry at ``key``'s tokens from ``token``, whose
    positions there count from ``position``; ``tokens``: what the whole entry certifies (the
    fingerprint of the units it was computed for, :meth:`PromptKeys.fingerprint`)."""

    start: int
    end: int
    key: str
    token: int
    position: int
    tokens: str


@dataclass(eq=False)
class Record:
    """A committed prompt: where the KV of each unit span lives, its unit offsets, how many
    leading units hold KV exactly as a full prefill computes it, and its units (to follow a run
    of reused chunks on past the chunks the index found; None where not kept)."""

    table: tuple[TableRow, ...]
    tok_off: np.ndarray
    pos_off: np.ndarray
    exact_units: int
    units: np.ndarray | None = None


class PromptKeys:
    """Segments and context-chained store keys of one prompt. ``cuts``: its segment edges
    (:meth:`Prompt.cuts`); without them only content keys and fingerprints can be asked for."""

    def __init__(self, prompt: Prompt, namespace: Namespace, cuts: np.ndarray | None = None) -> None:
        self.prompt, self.namespace = prompt, namespace
        self.cuts = cuts if cuts is not None else np.zeros(0, np.int64)
        self._chain: dict[int, ContentKey | None] = {0: None}

    def segments(self, a: int, b: int) -> list[tuple[int, int]]:
        return between(self.cuts, a, b)

    def _span(self, a: int, b: int) -> ContentKey:
        return span_key(self.namespace, self.prompt.key_parts(a, b))

    def fingerprint(self, a: int, b: int) -> str:
        """What an entry of units [a, b) certifies: their token ids and images' content keys."""
        return fingerprint(self.prompt.key_parts(a, b))

    def content_key(self, a: int, b: int) -> ContentKey:
        """Key of units [a, b) by their content alone (images by content key)."""
        return self._span(a, b)

    def context(self, a: int) -> ContentKey | None:
        """Key of units [0, a): chained over the segment edges, so it depends on content only."""
        c = int(self.cuts[np.searchsorted(self.cuts, a, side="right") - 1])
        if c not in self._chain:
            i = int(np.searchsorted(self.cuts, c))
            known = max(j for j in range(i + 1) if int(self.cuts[j]) in self._chain)
            for j in range(known, i):
                lo, hi = int(self.cuts[j]), int(self.cuts[j + 1])
                self._chain[hi] = chain_key(self._chain[lo], self._span(lo, hi))
        base = self._chain[c]
        return base if c == a else chain_key(base, self._span(c, a))

    def store_key(self, a: int, b: int, exact: bool) -> str:
        key = chain_key(self.context(a), self._span(a, b))
        return record_key(key.hex, "exact" if exact else "approx")


def between(cuts: np.ndarray, a: int, b: int) -> list[tuple[int, int]]:
    """Units [a, b) split at the ``cuts`` inside them."""
    inner = cuts[(cuts > a) & (cuts < b)].tolist()
    return list(itertools.pairwise([a, *inner, b]))


def passes(
    prompt: Prompt,
    segments: Sequence[tuple[int, int]],
    cap: Callable[[int], int | None],
    join: bool = True,
) -> Iterator[list[tuple[int, int]]]:
    """``segments`` (consecutive unit spans) grouped into forward passes, one at a time: text
    segments join one pass while it stays within ``cap(tokens before it)`` tokens, asked as each
    pass begins (None: no bound; a segment longer than the cap runs alone); an image segment is a
    pass of its own, so passes begin and end at image edges. ``join`` False (a model whose KV
    depends on how its prefill was cut): one pass a segment."""
    group: list[tuple[int, int]] = []
    tokens, text = 0, True
    bound = cap(int(prompt.tok_off[segments[0][0]])) if len(segments) else None
    for a, b in segments:
        n = int(prompt.tok_off[b] - prompt.tok_off[a])
        is_text = not prompt.has_image(a, b)
        if group and (not (join and is_text and text) or (bound is not None and tokens + n > bound)):
            yield group
            group, tokens, bound = [], 0, cap(int(prompt.tok_off[a]))
        group.append((a, b))
        tokens += n
        text = is_text
    if group:
        yield group


def split_pass(
    prompt: Prompt, group: Sequence[tuple[int, int]], kv: ChunkKV
) -> list[tuple[int, int, ChunkKV]]:
    """The KV of one pass over ``group``'s segments, one (start, end, KV) per segment: views of
    the pass's KV (the store copies what it keeps into storage of its own, ``TieredStore.put``)."""
    if len(group) == 1:
        return [(group[0][0], group[0][1], kv)]
    a0 = group[0][0]
    out = []
    for a, b in group:
        t0, t1 = int(prompt.tok_off[a] - prompt.tok_off[a0]), int(prompt.tok_off[b] - prompt.tok_off[a0])
        p0 = int(prompt.pos_off[a] - prompt.pos_off[a0])
        out.append((a, b, kv.sliced(t0, t1, p0, int(prompt.pos_off[b] - prompt.pos_off[a]))))
    return out


def cut_back(cuts: np.ndarray, at: int) -> int:
    """The last segment edge at or before unit ``at``."""
    return int(cuts[np.searchsorted(cuts, at, side="right") - 1])


def fits(prompt: Prompt, s: int, e: int, parts: Sequence[ChunkKV]) -> bool:
    """Whether ``parts`` laid end to end hold units [s, e) of ``prompt``: tokens and extent."""
    return bool(
        sum(p.n_tokens for p in parts) == prompt.tok_off[e] - prompt.tok_off[s]
        and sum(p.extent for p in parts) == prompt.pos_off[e] - prompt.pos_off[s]
    )


def ids_upto(prompt: Prompt, n_tokens: int) -> torch.Tensor:
    parts = [inp.ids for inp in prompt.inputs]
    return torch.cat(parts)[:n_tokens] if parts else torch.zeros(0, dtype=torch.int64)
