"""What a repair on moved KV risks, read from the engine's own recent answers.

Decoding on repaired KV is guarded (``answer.py``): the first step whose best two scores lie
closer than the guard's margin moves decoding to exact KV; the prompt is then prefilled again
exactly and the steps decoded so far are replayed on it. Whether a repair pays therefore depends
on how likely an answer is to meet a step that close, and how late. That is a property of the
traffic (the model, the prompts, how long the answers run), not of one request, so it is measured
on the traffic: every answer's gaps between its best two scores, step by step
(``Decoded.gaps``), are kept for the last ``size`` answers as running minima, and
:meth:`CloseCalls.risk` reads how many of them had a step closer than a margin within their first
``steps`` steps (the rule of succession's (k + 1) / (n + 2): one half with nothing seen, then
following the count) and how many steps they had decoded before it. What a decode step costs
beside a prefilled token is measured the same way (:meth:`CloseCalls.step_tokens`: the medians of
the last timings of each).

:func:`repair_pays` is the decision it feeds (``prompt_cache.py``, sessions' windows in
``agent/loop.py``), taken once repair has chosen what it would recompute and knows the residual it
would leave, and so the guard's margin, before anything runs past the selection layer. In prefill
tokens: going on costs the tokens it recomputes and those still to prefill, plus, with the chance
``p`` of a close call, the exact prefill of everything after the exact prefix and the steps
replayed on it; giving up now costs that exact prefill alone. Before any of that is spent (the
selection layer's pass over the reused tokens, placing them), the same test runs at the smallest
residual recent repairs measured with nothing recomputed (:meth:`CloseCalls.worth_trying`): a
repair that would not pay even then is not tried, save every ``EXPLORE``-th in a row, so that the
residuals go on being measured and a change in the traffic is seen.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from agent.modes import depth_factor, guard_margin

DEFAULT_SIZE = 256
DEFAULT_STEPS = 256
TIMINGS = 64  # timings kept of prefill and of decode, and residuals of repairs measured
MIN_PREFILL_TOKENS = 32  # a prepare that prefilled fewer is not timed (its fixed costs dominate)
EXPLORE = 16  # of repairs skipped in a row on the residuals measured, this one is tried


class Risk(NamedTuple):
    """chance: of a close call within the answer's steps; steps_before: the mean steps decoded
    before it, among the answers kept that met one (0 where none did)."""

    chance: float
    steps_before: float


class CloseCalls:
    """The running minimum of each of the last ``size`` answers' gaps, over their first ``steps``
    steps, and the last timings of prefill (per token) and of decode (per step). Thread-safe."""

    def __init__(self, size: int = DEFAULT_SIZE, steps: int = DEFAULT_STEPS) -> None:
        if size < 1 or steps < 1:
            raise ValueError("size and steps must be at least 1")
        self.steps = steps
        self._answers: deque[tuple[np.ndarray, bool]] = deque(maxlen=size)  # running minima, ended
        self._prefill: deque[float] = deque(maxlen=TIMINGS)  # seconds per prefilled token
        self._decode: deque[float] = deque(maxlen=TIMINGS)  # seconds per decode step
        self._residuals: deque[float] = deque(maxlen=TIMINGS)
        self._depths: deque[float] = deque(maxlen=TIMINGS)  # what repairs' depths did to their margins
        self._skipped = 0  # repairs not tried since a residual was last measured
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._answers)

    def add(self, gaps: Sequence[float], ended: bool = True) -> bool:
        """One answer's gaps, step by step; ``ended``: it stopped by itself (an end token, a stop
        string), not at its token budget. An answer with no step or a NaN gap is not counted
        (False): a record is never a reason for an answer to fail."""
        g = np.asarray(gaps[: self.steps], dtype=np.float64)
        if g.size == 0 or np.isnan(g).any():
            return False
        with self._lock:
            self._answers.append((np.minimum.accumulate(g), ended))
        return True

    def risk(self, margin: float, steps: int | None = None) -> Risk:
        """The chance that an answer of at most ``steps`` steps (None: as long as the answers ran)
        has a step whose gap is below ``margin``: (k + 1) / (n + 2) over the answers kept, k of n
        having had one. An answer shorter than ``steps`` that ended by itself counts over its own
        length; one cut short by its budget without such a step says nothing of the steps it never
        ran and is left out. With it, the mean number of steps the k answers decoded before that
        step."""
        if margin <= 0:
            return Risk(0.0, 0.0)
        at = self.steps if steps is None else max(1, min(int(steps), self.steps))
        with self._lock:
            answers = list(self._answers)
        before, n = [], 0
        for a, ended in answers:
            close = bool(a[min(at, len(a)) - 1] < margin)
            if close:
                before.append(int(np.argmax(a < margin)))
            n += close or ended or len(a) >= at
        return Risk((len(before) + 1) / (n + 2), statistics.fmean(before) if before else 0.0)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prepare that prefilled ``tokens`` in ``seconds`` (all it did counted)."""
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            with self._lock:
                self._prefill.append(seconds / tokens)

    def observe_decode(self, steps: int, seconds: float) -> None:
        """An answer that decoded ``steps`` steps in ``seconds`` (none moved to exact KV)."""
        if steps > 0 and seconds > 0:
            with self._lock:
                self._decode.append(seconds / steps)

    def add_residual(self, residual: float) -> None:
        """The residual a repair measured (at its selection layer) and would have left."""
        if residual >= 0 and np.isfinite(residual):
            with self._lock:
                self._residuals.append(float(residual))
                self._skipped = 0

    def add_depth(self, depth: float | None, depth_unit: float) -> None:
        """A repair's measured depth (``agent.recompute.Repaired.depth``): what it did to the
        guard's margin (``agent.modes.depth_factor``) is kept, for the next repairs' tests."""
        if depth is not None and depth_unit > 0:
            with self._lock:
                self._depths.append(depth_factor(depth, depth_unit))

    def depth_factor(self) -> float:
        """The median of what the depths measured lately did to the margin (1.0: none measured,
        the margin then the residual's alone).
        A repair is put to its test before its depth is measured (which takes its recompute):
        this is the guess its test takes for it."""
        with self._lock:
            return statistics.median(self._depths) if self._depths else 1.0

    def low_residual(self) -> float | None:
        """The smallest residual of the repairs measured lately (None: none was)."""
        with self._lock:
            return min(self._residuals) if self._residuals else None

    def worth_trying(self, pays: Callable[[float, int], bool]) -> bool:
        """Whether to try a repair at all: unless even the smallest residual measured lately, with
        nothing recomputed, would not pay (``pays``). Of the repairs that would so be skipped in a
        row, every ``EXPLORE``-th is tried all the same: what is never tried is never measured
        again, and the residuals would stop following the traffic."""
        low = self.low_residual()
        if low is None or pays(low, 0):
            return True
        with self._lock:
            self._skipped += 1
            if self._skipped < EXPLORE:
                return False
            self._skipped = 0
            return True

    def repair_test(
        self,
        margin: float,
        unit: float,
        remaining: int,
        exact: int,
        steps: int | None,
        depth_unit: float = 0.0,
    ) -> Callable[[float, int], bool]:
        """The test a repair is put to (:func:`repair_pays`), asked with the residual it would
        leave and the tokens it would recompute: the guard's margin at that residual
        (``margin`` at a residual of ``unit``, ``agent.modes.guard_margin``; with ``depth_unit``,
        scaled as recent repairs' depths scaled theirs, :meth:`depth_factor`), ``remaining``
        tokens still to prefill on moved KV, ``exact`` what giving up prefills, ``steps`` the
        answer's most steps."""
        scaled = self.depth_factor() if depth_unit > 0 else 1.0

        def pays(residual: float, recomputed: int) -> bool:
            risk = self.risk(guard_margin(margin, residual, unit) * scaled, steps)
            return repair_pays(risk, self.step_tokens(), recomputed, remaining, exact)

        return pays

    def step_tokens(self) -> float:
        """What a decode step costs, in prefilled tokens (medians of the timings kept; 0 until
        both were timed)."""
        with self._lock:
            if not self._prefill or not self._decode:
                return 0.0
            return statistics.median(self._decode) / statistics.median(self._prefill)


def repair_pays(risk: Risk, step_tokens: float, recomputed: int, remaining: int, exact: int) -> bool:
    """Whether going on with a repair costs less than giving it up for the exact prefill, in
    prefilled tokens: ``recomputed`` tokens run through the later layers, ``remaining`` still to
    prefill on moved KV, and with ``risk.chance`` the exact prefill (``exact``: everything after the
    exact prefix) and the ``risk.steps_before`` steps replayed on it, at ``step_tokens`` each."""
    fallback = exact + risk.steps_before * step_tokens
    return recomputed + remaining + risk.chance * fallback < exact
