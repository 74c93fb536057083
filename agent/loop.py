"""The agent loop: ``step(observations, instruction) -> StepResult`` over a sliding window.

A step appends each observation (text, an image, a group of video frames) to the window, each
prefilled in context (images reuse their vision features by content), prefills the instruction,
generates (under the policy's grammar when it has one, so the action policy's replies always
parse), parses the output with the policy, and records the exchange as a chunk of the window
straight from the model cache (no second prefill). Canonical KV and patches of the new chunks
are fitted after the answer, off the path to the first token.

The window's reuse mode (``WindowConfig.reuse``) says what the answer may rest on: in ``repair``
(the default) the window's moved and patched KV, repaired as chat completions repair a prompt
(the most deviating tokens of the chunks that are not exact recomputed in the window,
``ContextManager.repair``), with decoding guarded (``agent.engine.generation.Guard``) by a margin
scaled by the residual the repair left: the first step too close to call moves to a fresh
prefill of the window (``ContextManager.fresh_cache``), where the tokens so far are replayed and
checked, so from there the answer is a re-prefill's; a residual beyond the cap is answered on
that prefill from the start. ``fast`` is the window's KV unguarded; ``exact``
answers on the window's KV only while it is exact as it stands (nothing moved, patched or
computed after other chunks: ``ContextManager.exact``), else on a fresh prefill. An exact window
needs no guard in any mode.

Not here: window mechanics (``agent/context.py``), how the model holds KV (``agent/adapters``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from PIL import Image

from agent.adapters.base import ChunkInput, ModelAdapter, TextInput
from agent.adapters.vision import VisionAdapter, encoder_calls
from agent.context import ContextManager, WindowConfig
from agent.engine.chat import ChatML, TemplateError, chat_format
from agent.engine.close_calls import CloseCalls
from agent.engine.generation import SamplingParams, decode
from agent.engine.prompt_cache import Served
from agent.grammar import Constraint, GrammarEngine
from agent.modes import depth_unit_for, guard_margin
from agent.policies import Policy, make_policy
from agent.recompute import DeviationSelection
from cache.store import StoreConfig, TieredStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TextObservation:
    text: str


@dataclass(frozen=True)
class ImageObservation:
    """A screenshot or a picture; ``label`` is shown before it (e.g. a URL or a caption)."""

    image: Image.Image
    label: str = ""


@dataclass(frozen=True)
class FramesObservation:
    """A group of video frames with their timestamps in seconds; each frame is its own chunk."""

    frames: Sequence[Image.Image]
    timestamps: Sequence[float]
    labels: Sequence[str] | None = None  # optional text before each frame (e.g. "frame 3")

    def __post_init__(self) -> None:
        if len(self.frames) != len(self.timestamps):
            raise ValueError("one timestamp per frame")
        if self.labels is not None and len(self.labels) != len(self.frames):
            raise ValueError("one label per frame")


Observation = TextObservation | ImageObservation | FramesObservation


class ChatFormat(Protocol):
    """How text turns are laid out for a model (its chat template, applied piecewise)."""

    def system(self, text: str) -> str: ...
    def user_text(self, text: str) -> str: ...
    def instruction(self, text: str) -> str: ...
    def end_of_turn(self) -> str: ...


@dataclass(frozen=True)
class StepReport:
    """What one step cost and reused. Times in milliseconds."""

    ttft_ms: float
    total_ms: float
    finalize_ms: float
    tokens_prefilled: int
    tokens_reused: int
    tokens_rotated: int
    patches_applied: int
    vision_encoder_calls: int
    window_tokens: int
    evicted: tuple[str, ...]
    # how the answer was served, in the server's classes (``agent.engine.prompt_cache.SERVED``):
    # on a window exact as it stands or on a fresh prefill of it (prefix), on moved or patched KV
    # (moved), on a fresh prefill after the guard's close call (fallback), or on one from the
    # start because the window's residual called for a margin beyond the cap (given_up)
    served: str = "prefix"
    repair_residual: float | None = None  # the deviation the inexact chunks still had (repaired)
    repair_depth: float | None = None  # how the recomputed tokens' deviation grew past layer 1
    tokens_repaired: int = 0  # their tokens recomputed through every layer (ContextManager.repair)
    guard_margin: float | None = None  # the guard's margin where one watched the step
    escalated_at: int | None = None  # the decode step a close call moved to a fresh prefill


@dataclass(frozen=True)
class StepResult:
    output: str
    parsed: Any
    report: StepReport
    chunk_ids: tuple[str, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "parsed": self.parsed,
            "report": asdict(self.report),
            "chunk_ids": self.chunk_ids,
        }


def _chat_format(adapter: ModelAdapter) -> ChatFormat:
    """The model's chat template cut into turns, or ChatML (with a warning) where it cannot be."""
    try:
        return chat_format(adapter.tokenizer)
    except TemplateError as exc:
        log.warning("%s: %s; the window is laid out in ChatML", adapter.info.name, exc)
        return ChatML()


class _FreshWindow:
    """The guard of one step: the window prefilled afresh, then the step's instruction."""

    def __init__(self, cm: ContextManager, prompt: TextInput, margin: float) -> None:
        self.cm, self.prompt, self.margin = cm, prompt, margin
        self.cache: Any = None
        self.start = 0

    def exact(self) -> tuple[Any, torch.Tensor, int]:
        self.cache, self.start = self.cm.fresh_cache()
        adapter = self.cm.adapter
        logits = adapter.next_logits(self.prompt, self.cache, self.start)
        return self.cache, logits, self.start + adapter.chunk_positions(self.prompt)[1]


class Agent:
    """One agent session: a window on a model and a store, stepped by observations."""

    def __init__(
        self,
        adapter: ModelAdapter,
        system_prompt: str,
        window: WindowConfig | None = None,
        store: TieredStore | None = None,
        policy: Policy | str = "text",
        chat: ChatFormat | None = None,
        max_new_tokens: int = 64,
        finalize: bool = True,
        constrain: bool = True,
        grammar: GrammarEngine | None = None,
        close_calls: CloseCalls | None = None,
    ) -> None:
        """``constrain``: decode under the policy's grammar (if it has one); False lets the model
        write freely (its replies may then not parse). ``grammar``: an engine over the model's
        tokenizer to share (built on the first constrained step otherwise). ``close_calls``: the
        close calls of recent answers that a repair's risk is read from, shared with whatever else
        answers on this model (``agent/engine/close_calls.py``; default: this agent's own)."""
        self.adapter = adapter
        self.chat = chat or _chat_format(adapter)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.store = store or TieredStore.from_config(StoreConfig(host_bytes=2 << 30))
        self.max_new_tokens = max_new_tokens
        self.auto_finalize = finalize
        self.constrain = constrain
        self._grammar = grammar
        self.close_calls = close_calls if close_calls is not None else CloseCalls()
        self.context = ContextManager(
            adapter, self.store, window or WindowConfig(), self._text(self.chat.system(system_prompt))
        )

    def _text(self, text: str) -> TextInput:
        ids = self.adapter.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.adapter.text(ids)

    def prompt(self, instruction: str) -> TextInput:
        """``instruction`` laid out as the step's turn (ending in the assistant's opening) and
        tokenized: what :meth:`step` prefills, for a caller that needs its tokens first."""
        return self._text(self.chat.instruction(instruction))

    def chunks(self, obs: Observation) -> list[tuple[ChunkInput, dict[str, Any]]]:
        """An observation as window chunks with their metadata."""
        if isinstance(obs, TextObservation):
            return [(self._text(self.chat.user_text(obs.text)), {"kind": "text"})]
        if not isinstance(self.adapter, VisionAdapter):
            raise TypeError(f"{self.adapter.info.name} takes no images")
        image_of = self.adapter.image
        out: list[tuple[ChunkInput, dict[str, Any]]] = []
        if isinstance(obs, ImageObservation):
            if obs.label:
                out.append((self._text(obs.label + "\n"), {"kind": "label"}))
            return [*out, (image_of(obs.image), {"kind": "image", "label": obs.label})]
        labels = obs.labels or [""] * len(obs.frames)
        for frame, t, label in zip(obs.frames, obs.timestamps, labels, strict=True):
            if label:
                out.append((self._text(label), {"kind": "label", "t": float(t)}))
            out.append((image_of(frame), {"kind": "frame", "t": float(t)}))
        return out

    def step(
        self,
        observations: Sequence[Observation],
        instruction: str | TextInput,
        max_new_tokens: int | None = None,
        keep_turn: bool = True,
        chunks: Sequence[tuple[ChunkInput, dict[str, Any]]] = (),
        cancel: threading.Event | None = None,
    ) -> StepResult:
        """Append the observations, answer ``instruction`` on the window and (``keep_turn``) keep
        the instruction and its answer in the window as one ``turn`` chunk (``instruction``: text,
        or the prompt :meth:`prompt` made of it). ``keep_turn=False``
        answers on the window alone and leaves it as it was: for questions that are each asked
        of what the window holds (a video's frames), not of the conversation before them.
        ``chunks``: chunks made by the caller (with their metadata), appended before the
        observations'. ``cancel``: set when the caller went away; decoding stops at the next token
        (the answer so far is kept as the turn)."""
        t0 = time.perf_counter()
        cm, c = self.context, self.context.counters
        before = (c.tokens_prefilled, c.tokens_rotated, c.patches_applied, encoder_calls(self.adapter))
        evicted_before = set(cm.evicted)
        pieces = [*chunks, *(piece for obs in observations for piece in self.chunks(obs))]
        new, metas = [chunk for chunk, _ in pieces], [meta for _, meta in pieces]
        prompt = self.prompt(instruction) if isinstance(instruction, str) else instruction
        cfg = cm.config
        reuse = cfg.reuse
        incoming = sum(chunk.n_tokens for chunk in new)
        if incoming <= cfg.budget_tokens - cm.view()[0].n_tokens:
            cm.make_room(incoming)  # the slide the new chunks cause, before the window is repaired
        reused = cm.tokens
        residual: float | None = None
        depth: float | None = None  # measured where the repair recomputed tokens
        repaired = 0
        served: Served = "prefix"
        give_up = attempted = False
        budget = max_new_tokens or self.max_new_tokens
        if reuse == "repair" and cfg.repair_margin > 0 and not cm.exact:
            attempted = True
            # chat completions' repair on the window's inexact chunks, before the step's new
            # tokens attend to them; too far from this context even so, or not worth its risk,
            # and the step is answered on a fresh prefill before anything else is spent on the
            # window's KV
            remaining = incoming + prompt.n_tokens
            pays = self._pays(remaining, reused + remaining, budget)
            if pays is not None and not self.close_calls.worth_trying(pays):
                give_up = True  # not even at the best residual recent repairs left
            else:
                done = cm.repair(lambda rows: self._selection(rows, pays))
                residual = None if done is None else done.residual
                repaired = 0 if done is None else done.tokens
                depth = None if done is None else done.depth
                if residual is not None:
                    self.close_calls.add_residual(residual)
                    self.close_calls.add_depth(depth, self._depth_unit)
                measured = cfg.repair_residual_unit if residual is None else residual
                # beyond the cap at the residual (tested at the selection layer), or once the
                # recompute measured its depth
                deep = guard_margin(
                    cfg.repair_margin, measured, cfg.repair_residual_unit, depth, self._depth_unit
                )
                give_up = (
                    measured > cfg.give_up_residual
                    or 0 < cfg.repair_margin_cap < deep
                    or (done.given_up if done is not None else pays is not None and not pays(measured, 0))
                )
        # every new chunk of the step in as few forward passes as the budget allows, the
        # instruction in the last of them; except in exact mode, where a window that is not what a
        # fresh prefill computes is prefilled afresh (and one that is needs no guard)
        if reuse == "exact" or give_up:
            ids = cm.append_many(new, metas)
            exact = cm.exact and not give_up
            cache, start = (cm.cache(), cm.next_start) if exact else cm.fresh_cache()
            first = self.adapter.next_logits(prompt, cache, start)
            served = "given_up" if give_up else "prefix"
        else:
            ids, first = cm.append_and_ask(new, metas, prompt)
            exact = cm.exact
            cache, start = cm.cache(), cm.next_start
            served = "prefix" if exact else "moved"
        guard = None
        if reuse == "repair" and cfg.repair_margin > 0 and served == "moved":
            if not attempted:  # the window was exact until its new chunks slid it
                residual = cm.residual(skip_last=len(ids)) or None  # 0: nothing to measure
            # the guard's margin follows the deviation left (unmeasured: the margin as set)
            measured = cfg.repair_residual_unit if residual is None else residual
            margin = guard_margin(
                cfg.repair_margin, measured, cfg.repair_residual_unit, depth, self._depth_unit
            )
            guard = _FreshWindow(cm, prompt, margin)
        # the answer rests on the window's KV (else on a fresh prefill of the window)
        on_window = served == "moved" or exact
        _, extent = self.adapter.chunk_positions(prompt)
        decoded = decode(
            self.adapter,
            first,
            cache,
            start + extent,
            SamplingParams(max_tokens=budget),
            cancel or threading.Event(),
            constraint=self._constraint(budget),
            guard=guard,
        )
        ttft_ms = 1000 * (decoded.first_token_at - t0)
        # what was prefilled before the first token (a prefill's own time: not where a repair was
        # tried or ran)
        prefilled = (incoming if on_window else cm.tokens) + prompt.n_tokens
        timed = 0 if attempted or served == "moved" else prefilled
        self._observe(decoded, time.perf_counter(), t0, timed, before[3])
        if guard is not None and guard.cache is not None:  # a close call: answered on a fresh prefill
            cache, start = guard.cache, guard.start
            served, on_window = "fallback", False
        reused = reused if on_window else 0  # KV the answer was computed from, nothing else
        tokens = decoded.tokens
        c.tokens_prefilled += prompt.n_tokens + len(tokens)
        c.tokens_reused += reused
        output = self.adapter.tokenizer.decode(tokens, skip_special_tokens=True)
        if keep_turn:
            self._record_turn(prompt, tokens, cache, start)
        else:  # the live cache holds the question and answer after the window: drop them
            cm.invalidate()
        t1 = time.perf_counter()
        if self.auto_finalize:
            cm.finalize()
        finalize_ms = 1000 * (time.perf_counter() - t1)
        report = StepReport(
            ttft_ms=ttft_ms,
            total_ms=1000 * (time.perf_counter() - t0),
            finalize_ms=finalize_ms,
            tokens_prefilled=c.tokens_prefilled - before[0],
            tokens_reused=reused,
            tokens_rotated=c.tokens_rotated - before[1],
            patches_applied=c.patches_applied - before[2],
            vision_encoder_calls=encoder_calls(self.adapter) - before[3],
            window_tokens=cm.tokens,
            evicted=tuple(e for e in cm.evicted if e not in evicted_before),
            served=served,
            repair_residual=residual,
            repair_depth=depth,
            tokens_repaired=repaired,
            guard_margin=None if guard is None else guard.margin,
            escalated_at=decoded.escalated_at,
        )
        return StepResult(output, self.policy.parse(output), report, tuple(ids))

    def _selection(
        self, candidates: torch.Tensor, pays: Callable[[float, int], bool] | None = None
    ) -> DeviationSelection:
        """Chat completions' choice of the tokens to recompute, over the window's ``candidates``."""
        cfg = self.context.config
        return DeviationSelection(
            cfg.repair_ratio,
            candidates,
            max_residual=cfg.give_up_residual,
            max_ratio=cfg.repair_max_ratio,
            target_residual=cfg.repair_residual_unit,
            pays=pays,
        )

    def _observe(
        self, decoded: Any, decoded_at: float, t0: float, prefilled: int, encoder_before: int
    ) -> None:
        """What the next repair's risk is read from: the answer's gaps and, where it stayed on
        one cache, its decode steps' time; the prefill's time per token where no frame was
        encoded in the step (the encoder's time is not a prefill's)."""
        if decoded.finish_reason == "cancelled":
            return
        calls = self.close_calls
        calls.add(decoded.gaps, ended=decoded.finish_reason == "stop")
        if decoded.escalated_at is None:
            calls.observe_decode(len(decoded.gaps) - 1, decoded_at - decoded.first_token_at)
            if encoder_calls(self.adapter) == encoder_before:
                calls.observe_prefill(prefilled, decoded.first_token_at - t0)

    @property
    def _depth_unit(self) -> float:
        """The guard's depth unit for this model (``agent.modes.depth_unit_for``)."""
        return depth_unit_for(self.context.config.repair_depth_unit, self.adapter.quantised_decode)

    def _pays(self, remaining: int, exact: int, steps: int) -> Callable[[float, int], bool] | None:
        """Chat completions' test of whether a repair is worth going on with
        (``CloseCalls.repair_test``): ``remaining`` tokens to prefill on the window, ``exact``
        what a fresh prefill of it prefills. None where the check is off or nothing falls back."""
        cfg = self.context.config
        if not cfg.repair_must_pay or cfg.repair_margin <= 0:
            return None
        return self.close_calls.repair_test(
            cfg.repair_margin, cfg.repair_residual_unit, remaining, exact, steps, self._depth_unit
        )

    def _constraint(self, max_tokens: int) -> Constraint | None:
        grammar = self.policy.grammar(max_tokens) if self.constrain else None
        if grammar is None:
            return None
        if self._grammar is None:  # the token table is built once per agent
            self._grammar = GrammarEngine.for_adapter(self.adapter)
        return self._grammar.constraint(grammar)

    def _record_turn(self, prompt: TextInput, generated: list[int], cache: Any, start: int) -> None:
        """Keep instruction + answer in the window, taking their KV from the cache just used."""
        end = self._text(self.chat.end_of_turn()).ids.tolist()
        fed = (
            self.adapter.cache_length(cache) - sum(v.n_tokens for v in self.context.view()) - prompt.n_tokens
        )
        if self.adapter.cut_invariant and fed > 0:
            # The answer went into the cache by decode steps, whose numbers are not a prefill's
            # (a GGUF model's decode products take int8 activations): prefill it again, so that
            # the turn's KV is what a prefill of the window and the turn writes, bit for bit.
            cache.crop(-fed)
            fed = 0
        pending = generated[fed:] + end  # tokens generated but not yet in the cache, then the turn's end
        pos = start + prompt.n_tokens + fed
        if self.adapter.cut_invariant and pending:
            self.adapter.prefill(self.adapter.text(pending), cache, pos, last_only=True)
        else:
            for token in pending:
                self.adapter.decode_step(token, cache, pos)
                pos += 1
        turn = TextInput(torch.cat([prompt.ids, torch.tensor(generated + end, dtype=torch.int64)]))
        kv = self.adapter.kv_tail(cache, turn, start)
        # a turn longer than the whole window is not kept; the window stays as it was
        with contextlib.suppress(ValueError):
            self.context.adopt(turn, kv, cache, {"kind": "turn"})

    def snapshot(self) -> dict[str, Any]:
        """Cumulative counters and the store's, for users and tests."""
        return {
            "window": asdict(self.context.counters),
            "vision_encoder_calls": encoder_calls(self.adapter),
            "store": {t.tier: asdict(t) for t in self.store.stats().tiers},
        }


__all__ = [
    "Agent",
    "FramesObservation",
    "ImageObservation",
    "Observation",
    "Policy",
    "StepResult",
    "TextObservation",
]
