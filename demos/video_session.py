"""One video played through one agent window: frames in as they are decoded, questions answered
on demand, and the re-prefill and re-encoding baselines measured on the same windows.

Each sampled frame is preprocessed, run through the vision encoder once (the adapter caches
features by content) and appended to the window as its own chunk, with its timestamp; the
context manager slides the oldest frames out when the token budget is reached. A question picks
the frames it needs with a retrieval strategy (``demos/retrieval.py``) and brings back the
evicted ones with ``ContextManager.recall``: no vision encoder, no prefill of the frame. That is
``--ingest eager``; under ``--ingest lazy`` (the default) a frame is kept as decoded, keyed by its
pixels, and is preprocessed, encoded and prefilled only when a question first picks it.

On the labelled layout (the world model's) a question's window is its frames, each after a
``frame k`` label, prefilled with the question from cached features; eager ingest there encodes
each frame as it comes and prefills nothing, since a frame's KV without its label is never read.

Eager ingest with ``anchor=W`` re-anchors the window instead of sliding it: frames accumulate from
W to 2W, and the frame that would make 2W + 1 sends the oldest to the store and the newest W are
prefilled again, once, in one pass from their cached features. Every window a question finds is
then what a fresh prefill of it computes (``ContextManager.exact``).

Not here: decoding the video or parsing the command line (``video_qa.py``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from agent.adapters.base import ChunkInput, ImageInput, ModelAdapter, TextInput
from agent.adapters.loading import WORLD_VL, WORLD_VL_LONG
from agent.adapters.vision import encoder_calls
from agent.context import ContextManager, WindowConfig
from agent.engine.chat import ChatML
from agent.loop import Agent
from cache.keys import digest_key
from demos.retrieval import FrameRecord, make_retrieval
from demos.vl_model import UsageError, encode_text, fresh_adapter
from tools.world import WORLD_VL_DIR, WORLD_VL_LONG_DIR

SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass
class Asked:
    index: int
    question: str
    at: float | None  # None: after the last frame
    expected: str | None = None  # the right answer, when the questions file gives it
    answer: str = ""
    ttft_ms: float = 0.0
    answer_ms: float = 0.0
    asked_at: float = 0.0
    frame_times: list[float] = field(default_factory=list)
    recalled_times: list[float] = field(default_factory=list)
    exact_chunks: int = 0  # window chunks (frames and labels) reused as a fresh prefill has them
    window_ids: list[str] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)
    reencoded: tuple[float, str, int] | None = None  # re-encoding's seconds, answer, encoder runs


class LabelledFrames(ChatML):
    """The embedded world model's layout: one user turn holds the frames, each after ``frame k``
    (k: its place among the question's frames, in time order), then the question.

    ``system`` opens that user turn after the system message; ``instruction`` continues it with
    the question and opens the assistant's turn.
    """

    def system(self, text: str) -> str:
        return f"<|im_start|>system\n{text}<|im_end|>\n<|im_start|>user\n"

    def instruction(self, text: str) -> str:
        return f"{text}<|im_end|>\n<|im_start|>assistant\n"


LAYOUTS = ("auto", "chat", "labelled")


class VideoSession:
    """One video played through one agent window; frames in, questions answered on demand."""

    def __init__(self, adapter: ModelAdapter, args: argparse.Namespace, anchor: int | None = None) -> None:
        """``anchor``: re-anchor the window at 2 x ``anchor`` frames down to the newest ``anchor``
        (eager ingest; the budget must hold 2 x ``anchor`` frames); None: slide by the budget."""
        if anchor is not None and (anchor <= 0 or args.ingest != "eager"):
            raise UsageError(f"a window re-anchors at > 0 frames under eager ingest, not {anchor}")
        self.adapter = adapter
        self.args = args
        self.labelled = layout_of(args) == "labelled"
        self.chat = LabelledFrames() if self.labelled else ChatML()
        self.agent = Agent(
            adapter,
            args.system,
            WindowConfig(budget_tokens=args.budget, keep=args.keep, reuse=args.reuse_mode),
            policy="text",
            chat=self.chat,
            max_new_tokens=args.max_new_tokens,
            finalize=False,  # canonical KV and patches are fitted when a chunk slides out, not per answer
        )
        self.retrieval = make_retrieval(args.retrieval)
        self.lazy = args.ingest == "lazy"
        # a question's window built as a fresh prefill has it (see _place_exact): always when
        # frames enter only when asked for, and when reuse must be exact; in repair mode on the
        # labelled layout too, where a frame's KV depends on the label in front of it and moving
        # labels by rotation changes answers (docs/video_qa.md)
        # and on a re-anchored window, which is exact as it stands
        self.anchor = anchor
        self.exact_window = (
            self.lazy
            or anchor is not None
            or args.reuse_mode == "exact"
            or (self.labelled and args.reuse_mode == "repair")
        )
        self.reanchors = 0
        self.frames: list[FrameRecord] = []
        self.inputs: dict[str, ChunkInput] = {}  # frames and labels by chunk id
        self.reprefill: dict[str, Any] | None = None
        self.pending: list[tuple[ImageInput, float]] = []
        self.prefix_tokens = self.cm.view()[0].n_tokens  # the pinned system prompt
        self.preprocess_s = 0.0  # the image processor's time as frames come (eager: on every one)
        self._labels: dict[int, tuple[str, TextInput]] = {}
        # lazy ingest: decoded frames by pixel key, and those a question picked, preprocessed
        self.decoded: dict[str, Any] = {}
        self.prepared: dict[str, ImageInput] = {}
        self._tokens_by_size: dict[tuple[int, int], int] = {}

    @property
    def cm(self) -> ContextManager:
        return self.agent.context

    def add_frame(self, image: Any, t: float) -> None:
        """Take a decoded frame. Lazy: keep it as decoded, keyed by its pixels; it is preprocessed,
        encoded and prefilled if and when a question picks it. Eager: preprocess it and queue it;
        every ``--ingest-batch`` frames go into the window together (one vision encoder batch, one
        forward pass), and before a question."""
        if self.lazy:
            key = digest_key("frame", [repr((image.mode, image.size)).encode(), image.tobytes()]).hex
            self.decoded[key] = image
            self.frames.append(FrameRecord(key, t, self._frame_tokens(key, image), None))
            return
        t0 = time.perf_counter()
        chunk = self.adapter.image(image)  # type: ignore[attr-defined]
        self.preprocess_s += time.perf_counter() - t0
        self._check_fits(chunk.n_tokens)
        self.pending.append((chunk, t))
        if len(self.pending) >= self.args.ingest_batch:
            self.flush()

    def _check_fits(self, n_tokens: int) -> None:
        if n_tokens + self.prefix_tokens > self.args.budget:
            raise UsageError(
                f"a frame is {n_tokens} tokens: --budget {self.args.budget} cannot hold one "
                "frame after the system prompt"
            )

    def _frame_tokens(self, key: str, image: Any) -> int:
        """A decoded frame's token count, which depends on its size alone: the first frame of each
        size is preprocessed to learn it (and kept)."""
        if image.size not in self._tokens_by_size:
            t0 = time.perf_counter()
            chunk = self.adapter.image(image)  # type: ignore[attr-defined]
            self.preprocess_s += time.perf_counter() - t0
            self._check_fits(chunk.n_tokens)
            self._tokens_by_size[image.size] = chunk.n_tokens
            self.prepared[key] = chunk
        return self._tokens_by_size[image.size]

    def frame_input(self, frame: FrameRecord) -> ChunkInput:
        """A frame's preprocessed chunk (lazy ingest: preprocessed now, the first time it is asked
        for, and kept)."""
        chunk = self.prepared.get(frame.chunk_id) if self.lazy else self.inputs[frame.chunk_id]
        if chunk is None:
            chunk = self.adapter.image(self.decoded[frame.chunk_id])  # type: ignore[attr-defined]
            self.prepared[frame.chunk_id] = chunk
        return chunk

    def flush(self) -> None:
        """Put the queued frames into the window; on the labelled layout's exact windows, encode
        them only (:meth:`_encode_pending`)."""
        if self.labelled and self.exact_window:
            self._encode_pending()
            return
        while self.pending:
            room = self.args.budget - self.prefix_tokens
            batch, tokens = [], 0
            while self.pending and tokens + self.pending[0][0].n_tokens <= room:
                tokens += self.pending[0][0].n_tokens
                batch.append(self.pending.pop(0))
            again = [] if self.anchor is None else self._reanchor(self.anchor, len(batch))
            self._make_room(tokens)
            metas = [meta for _, meta in again] + [{"kind": "frame", "t": t} for _, t in batch]
            ids = self.cm.append_many([c for c, _ in again] + [c for c, _ in batch], metas)
            for cid, (chunk, t) in zip(ids[len(again) :], batch, strict=True):
                self.inputs[cid] = chunk
                embedding = None
                if self.retrieval.name == "similarity":  # a hit in the feature cache: no encoder run
                    embedding = self.adapter.image_features(chunk).float().mean(0)  # type: ignore[attr-defined]
                self.frames.append(FrameRecord(cid, t, chunk.n_tokens, embedding))

    def _encode_pending(self) -> None:
        """Run the vision encoder over the queued frames (one batch) and keep their features, with
        nothing prefilled. A labelled window is built per question, each frame after its
        ``frame k`` label (:meth:`_place_exact`), so the KV a frame gets in the stream without its
        label is never read: prefilling it would only cost time. A question then prefills its
        labelled frames from the cached features (no encoder run)."""
        self.adapter.encode_images([chunk for chunk, _ in self.pending])  # type: ignore[attr-defined]
        salt = self.cm.config.tenant_salt
        for chunk, t in self.pending:
            cid = self.adapter.chunk_key(chunk, salt)
            self.inputs[cid] = chunk
            embedding = None
            if self.retrieval.name == "similarity":  # a hit in the feature cache: no encoder run
                embedding = self.adapter.image_features(chunk).float().mean(0)  # type: ignore[attr-defined]
            self.frames.append(FrameRecord(cid, t, chunk.n_tokens, embedding))
        self.pending.clear()

    def _reanchor(self, anchor: int, incoming: int) -> list[tuple[ChunkInput, dict[str, Any]]]:
        """Where ``incoming`` more frames would take the window past 2 x ``anchor`` frames, send
        the chunks before the newest ``anchor`` frames (counting the incoming) to the store,
        recallable, and drop the survivors (their KV was computed after frames now gone); returns
        the survivors' inputs and metadata, to be prefilled again in one pass with the incoming
        frames (cached features: no encoder run)."""
        view = self.cm.view()
        held = [i for i, v in enumerate(view) if v.kind == "frame"]
        if len(held) + incoming <= 2 * anchor:
            return []
        stay = held[len(held) - (anchor - incoming) :] if incoming < anchor else []
        self.cm.slide((stay[0] if stay else len(view)) - 1)
        self.cm.cut(0, store=False)
        self.reanchors += 1
        return [(self.inputs[view[i].chunk_id], view[i].meta) for i in stay]

    def _make_room(self, n_tokens: int) -> None:
        """Slide out at least ``--evict-batch`` chunks once the window is full: survivors are
        rotated and the live cache rebuilt once per batch rather than once per frame."""
        excess = self.cm.tokens + n_tokens - self.args.budget
        if excess <= 0:
            return
        view = self.cm.view()[1:]
        count, freed = 0, 0
        while freed < excess:
            freed += view[count].n_tokens
            count += 1
        self.cm.slide(max(count, min(self.args.evict_batch, len(view))))

    def question_embedding(self, question: str) -> torch.Tensor | None:
        if self.retrieval.name != "similarity":
            return None
        ids = encode_text(self.adapter, question).ids.to(self.adapter.device)
        with torch.inference_mode():
            emb = self.adapter.embed_ids(ids)
        return emb.float().mean(0).cpu()

    def answer(self, q: Asked, now: float) -> None:
        self.flush()  # frames already decoded are part of what the question may look at
        t0 = time.perf_counter()
        if self.retrieval.name == "similarity" and self.lazy:  # scored frames keep their embedding
            self.frames = [self._with_embedding(f) for f in self.frames]
        latest: dict[str, FrameRecord] = {f.chunk_id: f for f in self.frames}  # one per content
        candidates = sorted(latest.values(), key=lambda f: f.t)
        prompt = self.agent.prompt(q.question)  # tokenized once: its length here, prefilled by the step
        room = self.args.budget - self.prefix_tokens - prompt.n_tokens
        k, used = 0, 0
        for f in sorted(candidates, key=lambda f: f.n_tokens):  # how many frames fit at most
            cost = f.n_tokens + (self._label(k + 1).n_tokens if self.labelled else 0)
            if k >= self.args.frames_per_question or used + cost > room:
                break
            k, used = k + 1, used + cost
        picked = self.retrieval.select(candidates, k, self.question_embedding(q.question))
        chosen = [candidates[i] for i in picked]
        rest: list[tuple[ChunkInput, dict[str, Any]]] = []  # prefilled with the question
        if self.exact_window:
            q.exact_chunks, rest = self._place_exact(chosen)
        else:
            q.recalled_times = self._bring_in(chosen)
            if self.labelled:
                self._relabel(chosen)
        prepare_ms = 1000 * (time.perf_counter() - t0)
        # each question is asked of its frames alone, as re-encoding asks it: no earlier turns
        result = self.agent.step([], prompt, keep_turn=False, chunks=rest)
        for cid, (chunk, _) in zip(result.chunk_ids, rest, strict=True):
            self.inputs[cid] = chunk
        window = self.cm.view()[1:]
        q.frame_times = [float(v.meta["t"]) for v in window if v.kind == "frame"]
        q.window_ids = [v.chunk_id for v in window if v.kind in ("frame", "label")]
        if self.anchor is not None and not self.labelled:
            self._drop_lookback()
        q.answer = result.output.strip()
        q.ttft_ms = prepare_ms + result.report.ttft_ms
        q.answer_ms = prepare_ms + result.report.total_ms
        q.asked_at = now
        q.report = result.as_dict()["report"]
        if self.reprefill is None:
            self.reprefill = self._measure_reprefill(q, prompt)

    def _with_embedding(self, frame: FrameRecord) -> FrameRecord:
        """``frame`` with its mean-pooled vision features (an encoder run the first time; the
        features stay in the adapter's cache, so prefilling the frame later runs no encoder)."""
        if frame.embedding is not None:
            return frame
        features = self.adapter.image_features(self.frame_input(frame))  # type: ignore[attr-defined]
        return replace(frame, embedding=features.float().mean(0))

    def _place_exact(
        self, chosen: Sequence[FrameRecord]
    ) -> tuple[int, list[tuple[ChunkInput, dict[str, Any]]]]:
        """Make the window the start of what a fresh prefill of the question's window holds: the
        chosen frames in time order (each after its ``frame k`` label in the labelled layout).

        The longest leading run of the window that already holds those chunks, each computed
        after exactly the chunks in front of it (``ContextManager.exact_run``), stays as it is;
        everything after it slides out. Returns the number of chunks kept and the rest, to be
        prefilled in context with the question in one pass (``Agent.step``'s ``chunks``). A frame
        seen before runs no vision encoder (its features are kept by content)."""
        pieces: list[tuple[str, ChunkInput, dict[str, Any]]] = []
        salt = self.cm.config.tenant_salt
        order = sorted(chosen, key=lambda f: f.t)
        if self.anchor is not None and not self.labelled:
            # the re-anchored window first, as it stands; a look-back's frames after it, with the
            # question (in time order, they would come first and nothing could be kept)
            present = {v.chunk_id for v in self.cm.view()}
            order.sort(key=lambda f: f.chunk_id not in present)
        for k, f in enumerate(order, 1):
            if self.labelled:
                label_id, label = self._label_piece(k)
                pieces.append((label_id, label, {"kind": "label"}))
            chunk = self.frame_input(f)
            pieces.append((self.adapter.chunk_key(chunk, salt), chunk, {"kind": "frame", "t": f.t}))
        keep = self.cm.exact_run([cid for cid, _, _ in pieces])
        self.cm.cut(keep, store=False)  # what leaves is prefilled again if asked for: features kept
        return keep, [(chunk, meta) for _, chunk, meta in pieces[keep:]]

    def _drop_lookback(self) -> None:
        """After a question on a re-anchored window: the look-back frames it prefilled after the
        window (older than the window's newest) leave it unstored, as ``_place_exact`` drops what
        it re-prefills; the window is again the stream's frames in time order."""
        times = [float(v.meta["t"]) for v in self.cm.view()[1:]]
        back = next((i for i in range(1, len(times)) if times[i] < times[i - 1]), None)
        if back is not None:
            self.cm.cut(back, store=False)

    def _bring_in(self, chosen: Sequence[FrameRecord]) -> list[float]:
        """Make the chosen frames present: evict unchosen chunks (oldest first) to make room, then
        recall each evicted chosen frame at its place in time. Returns the recalled timestamps."""
        ids = {f.chunk_id for f in chosen}
        present = {v.chunk_id for v in self.cm.view()}
        missing = [f for f in chosen if f.chunk_id not in present]
        need = sum(f.n_tokens for f in missing)
        while self.cm.tokens + need > self.args.budget:
            victim = next((i for i, v in enumerate(self.cm.view()) if i and v.chunk_id not in ids), None)
            if victim is None:
                break
            self.cm.slide_at(victim)
        for f in missing:
            view = self.cm.view()
            at = 1 + max(
                (i for i, v in enumerate(view) if i and v.kind == "frame" and float(v.meta["t"]) <= f.t),
                default=0,
            )
            self.cm.recall(f.chunk_id, at=at)
        return [f.t for f in missing]

    def _label(self, k: int) -> TextInput:
        return self._label_piece(k)[1]

    def _label_piece(self, k: int) -> tuple[str, TextInput]:
        """``frame k`` as a chunk and its content key, tokenized and hashed once per session."""
        if k not in self._labels:
            label = encode_text(self.adapter, f"frame {k}")
            self._labels[k] = (self.adapter.chunk_key(label, self.cm.config.tenant_salt), label)
        return self._labels[k]

    def _relabel(self, chosen: Sequence[FrameRecord]) -> None:
        """Leave only the chosen frames in the window, each after its ``frame k`` label.

        Earlier turns and labels slide out; the labels go in as one batch after the frames and
        are then moved in front of theirs by rotation (their KV is conditioned on the frames
        before them, not on the frames' new order: the approximation the cache makes)."""
        ids = {f.chunk_id for f in chosen}
        view = self.cm.view()
        for i in range(len(view) - 1, 0, -1):
            if view[i].kind != "frame" or view[i].chunk_id not in ids:
                self.cm.slide_at(i)
        frames = [v.chunk_id for v in self.cm.view()[1:]]
        labels = [self._label(k) for k in range(1, len(frames) + 1)]
        label_ids = self.cm.append_many(labels, [{"kind": "label"} for _ in labels])
        for cid, label in zip(label_ids, labels, strict=True):
            self.inputs[cid] = label
        self.cm.reorder([c for pair in zip(label_ids, frames, strict=True) for c in pair])

    def _prefix(self) -> TextInput:
        return encode_text(self.adapter, self.chat.system(self.args.system))

    def _measure_reprefill(self, q: Asked, prompt: TextInput) -> dict[str, Any]:
        """Full prefill of the same window (frames' features cached) and the question's first token."""
        chunks: list[ChunkInput] = [self._prefix(), *(self.inputs[c] for c in q.window_ids)]
        ms, answer = full_answer(self.adapter, chunks, prompt, self.args.max_new_tokens)
        return {"ttft_ms": ms, "answer": answer, "same_answer": answer.strip() == q.answer}

    def reencode_one(self, q: Asked, images: dict[float, Any] | None = None) -> None:
        """Answer ``q`` again from scratch on its window, vision encoder included (a fresh adapter
        keeps no features). ``images``: the decoded frames by timestamp, preprocessed here as a
        tool without the cache must (``None``: the session's preprocessed frames)."""
        t0 = time.perf_counter()
        fresh = fresh_adapter(self.adapter)
        times = iter(q.frame_times)
        chunks: list[ChunkInput] = [self._prefix()]
        for cid in q.window_ids:
            chunk = self.inputs[cid]
            if isinstance(chunk, ImageInput):
                t = next(times)
                chunk = chunk if images is None else fresh.image(images[t])  # type: ignore[attr-defined]
            chunks.append(chunk)
        _, answer = full_answer(fresh, chunks, self.agent.prompt(q.question), self.args.max_new_tokens)
        q.reencoded = (time.perf_counter() - t0, answer.strip(), encoder_calls(fresh))

    def reencode(self, asked: Sequence[Asked]) -> dict[str, Any]:
        """Re-encoding's figures over ``asked``: each question answered from scratch on its window
        (by :meth:`reencode_one`: in the re-encoding pass, or now for one that was not)."""
        for q in asked:
            if q.reencoded is None:
                self.reencode_one(q)
        runs = [q.reencoded for q in asked if q.reencoded is not None]
        answers = [a for _, a, _ in runs]
        return {
            "reencode_total_s": sum(s for s, _, _ in runs),
            "reencode_vision_encoder_calls": sum(c for _, _, c in runs),
            "reencode_answers": answers,
            "reencode_same_answers": sum(a == q.answer for a, q in zip(answers, asked, strict=True)),
            "reencode_correct": sum(
                a == q.expected for a, q in zip(answers, asked, strict=True) if q.expected is not None
            ),
        }


def full_answer(
    adapter: ModelAdapter, chunks: Sequence[ChunkInput], prompt: TextInput, max_new_tokens: int
) -> tuple[float, str]:
    """Prefill ``chunks`` and ``prompt`` on an empty cache in one forward pass (the images in one
    encoder batch), as the session prefills a question's new frames with the question, and
    decode greedily.

    Returns the time to first token in milliseconds and the answer text.
    """
    t0 = time.perf_counter()
    cache = adapter.empty_cache()
    _, first = adapter.prefill_and_ask(chunks, prompt, cache, 0)
    start = sum(adapter.chunk_positions(chunk)[1] for chunk in chunks)
    gen = adapter.generate(prompt, cache, start, max_new_tokens, first_logits=first)
    ttft_ms = 1000 * (time.perf_counter() - t0) - 1000 * (gen.total_s - gen.first_token_s)
    return ttft_ms, adapter.tokenizer.decode(gen.tokens, skip_special_tokens=True)


def layout_of(args: argparse.Namespace) -> str:
    """The prompt layout ``--layout`` asks for (``auto``: labelled on the embedded world models)."""
    if args.layout != "auto":
        return str(args.layout)
    worlds = {Path(WORLD_VL_DIR).resolve(), Path(WORLD_VL_LONG_DIR).resolve()}
    is_world = args.model in (None, WORLD_VL, WORLD_VL_LONG) or Path(args.model).resolve() in worlds
    return "labelled" if is_world else "chat"
