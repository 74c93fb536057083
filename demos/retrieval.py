"""Frame retrieval: which of the frames seen so far a question should look at. Chosen by name.

``recent``: the last ``k`` frames. ``even``: ``k`` frames evenly spaced over the video so far
(first and last included). ``similarity``: the ``k`` frames whose embedding is closest (cosine)
to the question's; the embeddings come from the model itself (mean-pooled vision features that
the adapter computed anyway, and mean-pooled input embeddings of the question's tokens), so no
extra model runs. Every strategy returns indices in time order.

Not here: where the frames' KV lives or how an evicted frame comes back (``demos/video_session.py``,
``agent/context.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class FrameRecord:
    """One sampled frame as retrieval sees it. ``embedding``: ``[hidden]`` float32, or None."""

    chunk_id: str
    t: float
    n_tokens: int
    embedding: torch.Tensor | None = None


class Retrieval(Protocol):
    """Pick at most ``k`` of ``frames`` (in time order) for a question; returns sorted indices.

    ``question``: the question's embedding ``[hidden]`` (strategies that ignore it accept None).
    """

    @property
    def name(self) -> str: ...

    def select(self, frames: Sequence[FrameRecord], k: int, question: torch.Tensor | None) -> list[int]: ...


@dataclass(frozen=True)
class Recent:
    name: str = "recent"

    def select(self, frames: Sequence[FrameRecord], k: int, question: torch.Tensor | None) -> list[int]:
        return list(range(max(0, len(frames) - k), len(frames)))


@dataclass(frozen=True)
class Even:
    name: str = "even"

    def select(self, frames: Sequence[FrameRecord], k: int, question: torch.Tensor | None) -> list[int]:
        n = len(frames)
        if k <= 0 or n == 0:
            return []
        if k >= n:
            return list(range(n))
        if k == 1:
            return [n - 1]
        return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


@dataclass(frozen=True)
class Similarity:
    name: str = "similarity"

    def select(self, frames: Sequence[FrameRecord], k: int, question: torch.Tensor | None) -> list[int]:
        if question is None:
            raise ValueError("similarity retrieval needs the question's embedding")
        if any(f.embedding is None for f in frames):
            raise ValueError("similarity retrieval needs every frame's embedding")
        if k <= 0 or not frames:
            return []
        emb = torch.stack([f.embedding for f in frames if f.embedding is not None])  # [N, hidden]
        scores = torch.nn.functional.cosine_similarity(emb, question[None].to(emb.dtype), dim=-1)
        # ties (identical frames) go to the later frame: stable sort on -score, then reversed index
        order = sorted(range(len(frames)), key=lambda i: (-float(scores[i]), -i))
        return sorted(order[:k])


RETRIEVALS: dict[str, Callable[[], Retrieval]] = {"recent": Recent, "even": Even, "similarity": Similarity}


def make_retrieval(name: str) -> Retrieval:
    if name not in RETRIEVALS:
        raise ValueError(f"unknown retrieval {name!r}; choose from {sorted(RETRIEVALS)}")
    return RETRIEVALS[name]()
