"""Asking an episode's questions on every method's context, scoring them, and pooling the records
per method over scenarios.

Not here: building the contexts (``video_multihop_methods.py``), the CLI and tables
(``video_multihop.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from agent.adapters.base import ChunkInput, ImageInput, TextInput
from agent.adapters.qwen_vl import QwenVLAdapter
from bench.answers import Codec
from bench.methods import kl_divergence
from bench.video_multihop_layout import (
    PREFIX,
    TAIL,
    Case,
    Encoders,
    build_case,
    pairs,
    text_encoder,
)
from bench.video_multihop_methods import (
    Built,
    Store,
    VideoConfig,
    build_methods,
    content_id,
    context_pass,
    placement,
)
from cache.layout import ChunkKV
from tools.world.render import Episode, Question, WorldConfig, episode_seed, make_episode


class Answer(NamedTuple):
    tokens: list[int]
    text: str
    first_logits: torch.Tensor
    seconds: float


def ask(
    adapter: QwenVLAdapter, codec: Codec, built: Built, tail: TextInput, start: int, max_new: int
) -> Answer:
    """Prefill the question on the method's context and decode greedily; the cache takes the
    context buffers over without writing them."""
    cache = adapter.new_cache([(built.k, built.v)])
    t0 = time.perf_counter()
    logits = adapter.prefill(tail, cache, start).logits[-1]
    int(logits.argmax())
    seconds = time.perf_counter() - t0
    gen = adapter.generate(tail, cache, start, max_new, first_logits=logits)
    return Answer(gen.tokens, codec.decode(gen.tokens).strip(), logits, seconds)


def direct_ttft(adapter: QwenVLAdapter, chunks: Sequence[ChunkInput]) -> float:
    """Seconds to the first token of one plain HF forward over the whole prompt, vision encoder
    included: re-prefill's time to first token (its answers come from the chunked pass, which
    the tests hold equal to this forward)."""
    t0 = time.perf_counter()
    int(adapter.reference_logits(chunks, last_only=True)[-1].argmax())
    return time.perf_counter() - t0


class Record(NamedTuple):
    scenario: str
    method: str
    kind: str
    template: str
    correct: bool
    agree: bool
    kl_first: float
    ttft_s: float
    recompute: float
    fit_s: float
    bytes_ratio: float
    oracle: bool  # built from this very prompt's full prefill (bench/methods.py)


def evaluate_case(
    adapter: QwenVLAdapter,
    reference: QwenVLAdapter,
    store: Store,
    codec: Codec,
    case: Case,
    questions: Sequence[Question],
    config: VideoConfig,
) -> tuple[list[Record], int]:
    """Every method on every question of one episode under one scenario; also the encoder runs
    of one re-prefill of this prompt."""
    prefix = text_encoder(codec)(PREFIX)
    ref = context_pass(reference, prefix, case.target)
    origin: dict[str, ChunkKV] = {}
    for layout in case.origins:
        if any(p.name not in origin for p in layout):
            passed = context_pass(reference, prefix, layout).conditioned
            origin.update({k: v for k, v in passed.items() if k not in origin})
    built = build_methods(adapter, store, case, prefix, ref, origin, config)
    end = placement(adapter, prefix, case.target).end
    records = []
    for q in questions:
        tail = text_encoder(codec)(TAIL.format(question=q.text))
        answers = {
            name: ask(model, codec, b, tail, end, config.max_new_tokens)
            for name, b in built.items()
            for model in [reference if name == "reprefill" else adapter]
        }
        gold = answers["reprefill"]
        prompt = [prefix, *[p.chunk for p in case.target], tail]
        ttft = {name: b.seconds + answers[name].seconds for name, b in built.items()}
        ttft["reprefill"] = direct_ttft(reference, prompt)
        for name, a in answers.items():
            b = built[name]
            records.append(
                Record(
                    case.scenario,
                    name,
                    q.kind,
                    q.template,
                    a.text == q.answer,
                    a.tokens == gold.tokens,
                    kl_divergence(gold.first_logits, a.first_logits),
                    ttft[name],
                    b.recompute,
                    b.fit_seconds,
                    b.bytes_ratio,
                    b.oracle,
                )
            )
    return records, ref.encoder_calls


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def aggregate(records: Sequence[Record], calls: dict[str, int], questions: int) -> dict[str, dict[str, Any]]:
    """Per method: the JSON numbers (see the module docstring)."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r.method for r in records):
        rs = [r for r in records if r.method == name]
        single, multi = [r for r in rs if r.kind == "single"], [r for r in rs if r.kind == "multi"]
        out[name] = {
            "acc_single": _mean([float(r.correct) for r in single]),
            "acc_multi": _mean([float(r.correct) for r in multi]),
            "agree_single": _mean([float(r.agree) for r in single]),
            "agree_multi": _mean([float(r.agree) for r in multi]),
            "kl_first": _mean([r.kl_first for r in rs]),
            "ttft_ms": 1e3 * (_mean([r.ttft_s for r in rs]) or 0.0),
            "encoder_calls": calls[name],
            "encoder_calls_per_question": calls[name] / max(1, questions),
            "recompute": _mean([r.recompute for r in rs]),
            "fit_ms": 1e3 * (_mean([r.fit_s for r in rs]) or 0.0),
            "patch_bytes_ratio": _mean([r.bytes_ratio for r in rs]),
            "n_single": len(single),
            "n_multi": len(multi),
            "oracle": rs[0].oracle,
        }
    return out


def fresh_adapter(adapter: QwenVLAdapter, vision_cache_size: int) -> QwenVLAdapter:
    """Another adapter on the same weights with its own vision feature cache and counter."""
    return adapter.fresh(vision_cache_size)


def frame_encoder(adapter: QwenVLAdapter) -> Callable[[Episode, int], ChunkInput]:
    images: dict[tuple[str, int], ImageInput] = {}

    def encode(episode: Episode, index: int) -> ChunkInput:
        key = (episode.seed, index)
        if key not in images:
            images[key] = adapter.image(episode.frames[index])
        return images[key]

    return encode


def previous_episode(index: int, world: WorldConfig) -> Episode:
    """The other episode of slide and recall: validation episode ``index`` (never a test one)."""
    return make_episode(episode_seed("val", index), world)


def run(
    adapter: QwenVLAdapter,
    episodes: Sequence[Episode],
    config: VideoConfig,
    world: WorldConfig | None = None,
    progress: Any = None,
) -> dict[str, Any]:
    """All scenarios on ``episodes``; the report's ``scenarios`` and pooled ``methods``."""
    codec = Codec(adapter.tokenizer)
    enc = Encoders(text_encoder(codec), frame_encoder(adapter))
    reference = fresh_adapter(adapter, vision_cache_size=0)
    scenarios: dict[str, Any] = {}
    all_records: list[Record] = []
    all_calls: dict[str, int] = dict.fromkeys(config.method_names(), 0)
    all_questions = 0
    if episodes:  # warm the kernels up so the first method timed does not pay for it
        context_pass(fresh_adapter(adapter, 0), enc.text(PREFIX), pairs(episodes[0], enc))
    for scenario in config.scenarios:
        reuse = fresh_adapter(adapter, vision_cache_size=4096)
        store = Store(reuse)
        records: list[Record] = []
        prefill_calls, frames = 0, set[str]()
        for i, ep in enumerate(episodes):
            case = build_case(scenario, ep, previous_episode(i, world or WorldConfig()), enc, config.seed)
            frames |= {content_id(p.chunk) for p in case.target if isinstance(p.chunk, ImageInput)}
            recs, pass_calls = evaluate_case(reuse, reference, store, codec, case, ep.questions, config)
            records += recs
            prefill_calls += pass_calls * len(ep.questions)
            if progress is not None:
                progress()
        questions = sum(len(ep.questions) for ep in episodes)
        calls = dict.fromkeys(config.method_names(), reuse.vision_encoder_calls)
        calls["reprefill"] = prefill_calls
        scenarios[scenario] = {
            "questions": questions,
            "distinct_frames": len(frames),
            "methods": aggregate(records, calls, questions),
        }
        all_records += records
        all_questions += questions
        for name, c in calls.items():
            all_calls[name] += c
    return {"scenarios": scenarios, "methods": aggregate(all_records, all_calls, all_questions)}
