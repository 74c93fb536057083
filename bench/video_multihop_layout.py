"""Prompt layouts of ``kamera bench video-multihop``: the world model's chat format, cut into chunks.

A question is laid out as the world model was trained (``docs/world_model.md``): the system
turn, one user turn with ``frame k`` followed by frame k as an image for every frame, then the
question, the end of the user turn and the assistant header. Here that text is cut into chunks:

- the *pinned prefix*: system turn and the user header (exact KV in every method);
- *pieces*: each ``frame k`` label and each frame is a chunk of its own (text, image);
- the *tail*: the question and the assistant header, the only new tokens of a question.

A scenario says where the episode's pieces sit in the prompt (the *target*) and where they sat
when they were first encoded (their *origins*, whose in-context KV gives the stored patches):

- ``slide``: first seen after the frames of a previous episode; that episode was evicted, so
  the frames now start right after the prefix.
- ``recall``: first seen in the plain prompt; evicted and recalled into a later turn, after a
  previous exchange about another episode (its frames, its question and answer).
- ``reorder``: first seen in order; now the (label, frame) pairs come in a shuffled order, so
  ``frame k`` still names the frame it was shown with and every question stays answerable.

Not here: running the model or scoring (``bench/video_multihop.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from PIL import Image

from agent.adapters.base import ChunkInput, TextInput
from agent.adapters.vision import VisionAdapter
from tools.world.render import Episode

SYSTEM_PROMPT = "You are a helpful assistant."
PREFIX = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
TAIL = "{question}<|im_end|>\n<|im_start|>assistant\n"
TURN = "{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n<|im_start|>user\n"
SCENARIOS: tuple[str, ...] = ("slide", "recall", "reorder")


@dataclass(frozen=True)
class Piece:
    """One chunk of a prompt; ``name`` says which (``"<seed>/frame 3"``, ``"<seed>/label 3"``)
    so that the same piece is found again in another layout."""

    name: str
    chunk: ChunkInput


class Case(NamedTuple):
    """One episode under one scenario: the target pieces and the layouts they were first seen in.

    A target piece's origin is the first layout of ``origins`` holding a piece of its name.
    """

    scenario: str
    target: list[Piece]
    origins: list[list[Piece]]


class Encoders(NamedTuple):
    """Text to a text chunk, and an episode's frame index (0-based) to its image chunk."""

    text: Callable[[str], TextInput]
    frame: Callable[[Episode, int], ChunkInput]


def pairs(episode: Episode, enc: Encoders, order: Sequence[int] | None = None) -> list[Piece]:
    """``frame k`` + frame k for each k (1-based) in ``order`` (default: in order)."""
    out = []
    for k in order or range(1, len(episode.frames) + 1):
        out.append(Piece(f"{episode.seed}/label {k}", enc.text(f"frame {k}")))
        out.append(Piece(f"{episode.seed}/frame {k}", enc.frame(episode, k - 1)))
    return out


def shuffled_order(episode: Episode, seed: int = 0) -> list[int]:
    """A permutation of the frame numbers that is never the identity, drawn from the episode's
    seed and ``seed`` (0: the episode's seed alone, the permutation of the runs in the docs).
    ``random.Random`` hashes a string seed with SHA-512, not ``hash()``: the same on every run."""
    n = len(episode.frames)
    rng = random.Random(f"reorder/{episode.seed}" if seed == 0 else f"reorder/{seed}/{episode.seed}")
    order = list(range(1, n + 1))
    while order == sorted(order):
        rng.shuffle(order)
    return order


def build_case(scenario: str, episode: Episode, previous: Episode, enc: Encoders, seed: int = 0) -> Case:
    """The target and origin layouts of ``episode``; ``previous`` is the other episode that came
    before it (slide) or that the previous exchange was about (recall); ``seed``: the reorder
    scenario's permutation (:func:`shuffled_order`)."""
    plain = pairs(episode, enc)
    if scenario == "slide":
        return Case(scenario, plain, [pairs(previous, enc) + plain])
    if scenario == "recall":
        q = previous.questions[0]
        turn = Piece(f"{previous.seed}/turn", enc.text(TURN.format(question=q.text, answer=q.answer)))
        target = [*pairs(previous, enc), turn, *plain]
        return Case(scenario, target, [plain, target])
    if scenario == "reorder":
        return Case(scenario, pairs(episode, enc, shuffled_order(episode, seed)), [plain])
    raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")


def text_encoder(codec: Any) -> Callable[[str], TextInput]:
    """Text to a chunk with the model's tokenizer (bytes for the tiny random models)."""

    def encode(text: str) -> TextInput:
        return TextInput(torch.tensor(codec.encode(text), dtype=torch.int64))

    return encode


def processor_ids(adapter: VisionAdapter, episode: Episode, question: str) -> torch.Tensor | None:
    """The plain prompt's token ids as the world model's own processor lays it out, or None when
    the processor has no chat template (the tiny models)."""
    content: list[str | Image.Image] = []
    for k in range(1, len(episode.frames) + 1):
        content += [f"frame {k}", episode.frames[k - 1]]
    content.append(question)
    return adapter.processor_ids(content)
