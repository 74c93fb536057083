"""Decoding after a prefilled prompt: greedy or seeded sampling, stop strings, cancellation.

Tokens are decoded one at a time on the model cache the prompt left; after each, the new text is
detokenised (only the tokens since the last complete character, :class:`TextStream`) and its
safe part handed to ``on_text`` (text that could still turn into a stop string, or an incomplete
UTF-8 character, is held back until it cannot), with the log probabilities of the tokens behind
it when asked for. ``cancel`` is checked between tokens: a
client that went away stops the work.

Under a grammar (``grammar.Constraint``) the tokens it does not allow get ``-inf`` before
sampling, and generation stops as soon as the grammar is complete. Log probabilities are the
model's own (its logits before the mask, the temperature and top_p), as a client would score text.

A :class:`Guard` watches decoding on approximate KV (``repair`` reuse): at the first step whose
best two candidates (among the allowed tokens) lie closer than ``guard.margin``, where the small
error of reused KV could flip the choice, decoding moves to the exact cache the guard builds (the
prompt as a full prefill computes it). Greedy steps compare logits; sampled steps compare the
logits plus the step's Gumbel noise (:class:`Sampler`), which is what they take the argmax of and
which is the same on every cache for the same seed and step: so a sampled request under the
guard draws the tokens its exact KV would draw with that seed, under the same condition as a
greedy one (every logit's error below half the margin). With ``top_p`` < 1 the nucleus itself
can move with the logits: no step is clear, and ``answer.py`` prepares such requests exact.
The tokens chosen so far are replayed on the exact cache one at a time, as a full prefill's
decode runs them, each checked against the exact choice; at the first that
differs, decoding rewinds there when nothing was handed out yet (no ``on_text``, no grammar), and
otherwise goes on with the text as sent and counts the tokens that differ (``Decoded.diverged``).
From then on every token is the exact path's.

Not here: the prompt (``prompt_cache.py``) or how text reaches a client (``app.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import torch

from agent.adapters.base import ModelAdapter
from agent.grammar import Constraint, GrammarError

FinishReason = Literal["stop", "length", "cancelled"]
MAX_TOP_LOGPROBS = 20
TextCallback = Callable[[str, list["TokenLogprob"]], None]


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; otherwise softmax sampling (with top_p) from a generator seeded
    by ``seed``, so a request with the same seed gives the same output."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs")


class TokenLogprob(NamedTuple):
    """One generated token's log probability and the ``top`` alternatives (id, logprob), best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """Log-softmax of ``logits [vocab]`` at ``token``, and its ``top`` best tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = logp.topk(top)
        best = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
    return TokenLogprob(token, float(logp[token]), best)


class Decoded(NamedTuple):
    text: str
    tokens: list[int]
    finish_reason: FinishReason
    first_token_at: float  # time.perf_counter() when the first token was chosen
    logprobs: list[TokenLogprob]  # one per token when asked for, else empty
    escalated_at: int | None = None  # the step at which a guard moved decoding to exact KV
    diverged: int = 0  # tokens handed out before that which the exact path would not have chosen
    # per chosen token: the gap between the best two scores its choice was made from (how close
    # the call was; what a guard compares with its margin), the end token's included
    gaps: tuple[float, ...] = ()


class Guard(Protocol):
    """A way from approximate KV to exact KV, taken when a greedy choice is too close to call."""

    margin: float  # logits: a step whose best two lie closer than this goes to exact KV

    def exact(self) -> tuple[Any, torch.Tensor, int]:
        """The prompt's exact model cache, its last logits, and the next token's position."""


class Sampler:
    """Greedy at temperature 0; otherwise the Gumbel-max draw: the token whose logit plus
    ``temperature`` times Gumbel noise is largest, among the nucleus when ``top_p`` < 1. That is a
    draw from softmax(logits / temperature) (over the nucleus), and the noise of step ``k`` comes
    from a generator seeded by (``seed``, ``k``), so the same request draws the same noise at the
    same step on any cache. A step's choice is then the argmax of :meth:`scores`, which a guard
    reads as it reads greedy logits (``decode``)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params

    def scores(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """What step ``step`` takes the argmax of, in logit units (greedy: the logits)."""
        p = self.params
        if p.temperature == 0.0:
            return logits.float()
        x = logits.float().cpu()
        if p.top_p < 1.0:
            probs = torch.softmax(x / p.temperature, dim=-1)
            sorted_p, order = probs.sort(descending=True)
            drop = sorted_p.cumsum(0) - sorted_p >= p.top_p  # always keeps the top token
            x = x.index_fill(0, order[drop], float("-inf"))
        generator = torch.Generator().manual_seed((p.seed * 1_000_003 + step) % (1 << 63))
        u = torch.rand(x.shape, generator=generator).clamp_(min=1e-20, max=1.0 - 1e-7)
        return x - p.temperature * torch.log(-torch.log(u))

    def __call__(self, logits: torch.Tensor, step: int = 0) -> int:
        return int(self.scores(logits, step).argmax())


class TextStream:
    """Incremental detokenisation with stop strings; ``push`` returns the text safe to emit.

    Each push decodes only the tokens since the last complete character, after the tokens of the
    piece before them for context (a tokenizer may render a token differently at the start of a
    text: SentencePiece drops a leading space): the new text is the decode of
    ``tokens[prefix:]`` past that of ``tokens[prefix:read]``, as vLLM's detokenizer does, so a
    push costs a few tokens' decoding however long the answer. ``text`` is the text so far (an
    incomplete character at its end as U+FFFD), cut at a stop string; at :meth:`flush`, without
    a stop, it is the decode of every token.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False
        self._prefix = self._read = 0  # tokens[:read] are ``_stable``; tokens[prefix:read] give context
        self._stable = ""
        self._context = ""  # the decode of tokens[prefix:read]

    def push(self, token: int) -> str:
        self.tokens.append(token)
        if self.stopped:  # the text ended at its stop string
            return ""
        searched = max(0, len(self._stable) - self.hold)  # a stop ending before here was seen before
        window = self._decode(self.tokens[self._prefix :])
        tail = window[len(self._context) :] if len(window) > len(self._context) else ""
        self.text = self._stable + tail
        if tail and not tail.endswith("\ufffd"):  # complete: the next push starts after it
            self._stable = self.text
            self._prefix, self._read = self._read, len(self.tokens)
            self._context = self._decode(self.tokens[self._prefix : self._read])
        cut = min((i for s in self.stop if (i := self.text.find(s, searched)) >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self._take(len(self.text))
        safe = len(self.text) - self.hold
        if self.text.endswith("\ufffd"):  # an incomplete UTF-8 character
            safe = min(safe, len(self.text) - 1)
        return self._take(safe)

    def flush(self) -> str:
        """The held-back tail at the end of generation (an incomplete character stays as U+FFFD)."""
        if not self.stopped:
            self.text = self._decode(self.tokens)
        return self._take(len(self.text))

    def _decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out


def decode(
    adapter: ModelAdapter,
    first_logits: torch.Tensor,
    cache: Any,
    position: int,
    params: SamplingParams,
    cancel: threading.Event,
    on_text: TextCallback | None = None,
    constraint: Constraint | None = None,
    guard: Guard | None = None,
) -> Decoded:
    """Generate after a prompt whose last logits are ``first_logits``; the next token sits at
    ``position`` on ``cache`` (which grows). ``guard``: see the module docstring (greedy only)."""
    sample = Sampler(params)
    stream = TextStream(adapter.tokenizer, params.stop)
    logprobs: list[TokenLogprob] = []
    gaps: list[float] = []
    sent = 0  # logprobs already handed to on_text
    watch = guard is not None
    masks: list[torch.Tensor] = []  # each step's allowed tokens, kept while a guard watches a grammar
    escalated_at: int | None = None
    close_gap = float("inf")  # the gap the guard last read
    diverged = 0
    steps = 0  # the step whose token is chosen next (its noise, when sampling)

    def allowed_now(logits: torch.Tensor) -> torch.Tensor | None:
        if constraint is None:
            return None
        allowed = constraint.allowed(logits.shape[-1]).to(logits.device)
        if not allowed.any():
            raise GrammarError("the grammar allows no token of this model's vocabulary")
        if watch and escalated_at is None:
            masks.append(allowed)
        return allowed

    def choose(
        logits: torch.Tensor,
        allowed: torch.Tensor | None,
        scores: torch.Tensor | None = None,
        gap: float | None = None,
    ) -> int:
        """The step's token: the argmax of its ``scores`` (computed here, with the ``gap`` between
        their best two, unless the guard did)."""
        nonlocal steps
        if scores is None:
            scores = sample.scores(logits if allowed is None else _masked(logits, allowed), steps)
        token = int(scores.argmax())
        gaps.append(_margin(scores, None) if gap is None else gap)
        steps += 1
        if params.logprobs:
            logprobs.append(token_logprob(logits, token, params.top_logprobs))
        return token

    def send(delta: str) -> None:
        nonlocal sent
        if delta and on_text is not None:
            on_text(delta, logprobs[sent:])
            sent = len(logprobs)

    def clear(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor | None:
        """The step's scores if its choice stands on approximate KV (their best two lie at least
        the guard's margin apart), else None. A nucleus (top_p < 1) can change with the logits
        however far apart they are: no step under it is clear."""
        nonlocal close_gap
        if params.temperature > 0.0 and params.top_p < 1.0:
            return None
        scores = sample.scores(logits if allowed is None else _masked(logits, allowed), steps)
        close_gap = _margin(scores, None)
        return scores if close_gap >= guard.margin else None  # type: ignore[union-attr]

    def step(logits: torch.Tensor) -> int:
        """The next token: on exact KV from here on if this choice is too close to call."""
        nonlocal cache, position, escalated_at, diverged, stream, steps
        allowed = allowed_now(logits)
        if not watch or escalated_at is not None:
            return choose(logits, allowed)
        scores = clear(logits, allowed)
        if scores is not None:  # the noise drawn once: the choice takes the scores the guard read
            return choose(logits, allowed, scores, close_gap)
        done = list(stream.tokens)
        escalated_at = len(done)
        cache, logits, position = guard.exact()  # type: ignore[union-attr]
        for j, t in enumerate(done):
            mask = masks[j] if constraint is not None else None
            if sample(logits if mask is None else _masked(logits, mask), j) != t:
                if on_text is None and constraint is None:  # nothing handed out: rewind here
                    stream = TextStream(adapter.tokenizer, params.stop)
                    for kept in done[:j]:
                        stream.push(kept)
                    del logprobs[j:]
                    del gaps[j:]
                    steps = j
                    return choose(logits, None)
                diverged = len(done) - j
                for later in done[j:]:
                    logits = adapter.decode_step(later, cache, position)
                    position += 1
                break
            logits = adapter.decode_step(t, cache, position)
            position += 1
        token = choose(logits, allowed)
        gaps[-1] = min(gaps[-1], close_gap)  # the call as close as the guard read it on approximate KV
        return token

    token = step(first_logits)
    first_at = time.perf_counter()
    reason: FinishReason = "length"
    while True:
        if token in adapter.eos_ids:
            if params.logprobs:
                logprobs.pop()  # the end token is not part of the text
            reason = "stop"
            break
        if constraint is not None:
            constraint.advance(token)
        send(stream.push(token))
        if stream.stopped or (constraint is not None and constraint.finished):
            reason = "stop"
            break
        if len(stream.tokens) >= params.max_tokens:
            break
        if cancel.is_set():
            reason = "cancelled"
            break
        logits = adapter.decode_step(token, cache, position)
        position += 1
        token = step(logits)  # may move decoding to exact KV (cache and position with it)
    tail = "" if stream.stopped else stream.flush()
    if on_text is not None and (tail or len(logprobs) > sent):
        on_text(tail, logprobs[sent:])
    return Decoded(
        stream.text, stream.tokens, reason, first_at, logprobs, escalated_at, diverged, tuple(gaps)
    )


def _masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~allowed, float("-inf"))


def _margin(logits: torch.Tensor, allowed: torch.Tensor | None) -> float:
    """The gap between the best two logits (among the allowed tokens): how close the call is."""
    top = (logits if allowed is None else _masked(logits, allowed)).float().topk(2).values
    return float(top[0] - top[1])
