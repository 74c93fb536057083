"""The reuse modes: one vocabulary for chat completions, sessions, the agent loop and video QA.

A mode says what an answer may be computed from:

- ``exact``: KV that a full prefill of the same prompt would compute bit for bit (an exact
  prefix, a window nothing has moved or patched); everything else is prefilled in context. The
  answer is the full prefill's.
- ``repair`` (the default): cached KV at other positions or after other antecedents, moved by
  rotation (a window's recalled chunks also take their patches) and repaired: the tokens whose
  layer-1 KV deviates most in the new context are recomputed, in chat completions and in
  windows alike. Answers are guarded: the first decode step whose top two logits (with the
  step's noise, when sampled) are closer than the guard's margin moves the request to exact KV,
  where the tokens so far are replayed and checked, so the answer is the one a full prefill
  gives; the margin scales with the deviation the repair left, and a repair that leaves too
  much is given up before decoding.
- ``fast``: cached KV moved by rotation and used as is, unguarded: the fastest, and an answer
  may differ from a full prefill's.

Not here: how each path reuses and repairs (``agent/engine/prompt_cache.py`` for chat
completions, ``agent/context.py`` and ``agent/loop.py`` for windows), the guard
(``agent/engine/generation.py``).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

ReuseMode = Literal["exact", "repair", "fast"]
REUSE_MODES: tuple[ReuseMode, ...] = get_args(ReuseMode)
DEFAULT_MODE: ReuseMode = "repair"

# One line each, for command-line help and the server's docs.
MODE_HELP: dict[ReuseMode, str] = {
    "exact": "only KV a full prefill would compute bit for bit",
    "repair": "moved KV, repaired, with greedy answers guarded back to exact KV on a close call",
    "fast": "moved KV as is, unguarded",
}


def check_mode(mode: str) -> ReuseMode:
    """``mode`` if it is a reuse mode, else ValueError naming the choices."""
    if mode not in REUSE_MODES:
        raise ValueError(f"unknown reuse mode {mode!r}; choose from {', '.join(REUSE_MODES)}")
    return mode  # type: ignore[return-value]


# repair, one setting for chat completions and windows (``docs/consistency.md`` says how they
# were measured): the most deviating share of the reused tokens is recomputed; a greedy step on
# repaired KV whose best two logits lie closer than the margin goes to exact KV; the margin is
# REPAIR_MARGIN at a measured residual (the deviation the reused KV still has from its context,
# ``agent.recompute``) of REPAIR_RESIDUAL_UNIT, scaled by the square root of the ratio; a
# residual that calls for more than REPAIR_MARGIN_CAP is given up before decoding (exact KV from
# the start).
REPAIR_RATIO = 0.15  # share of the reused tokens recomputed at least (CacheBlend's choice)
REPAIR_MAX_RATIO = 0.15  # at most, growing from REPAIR_RATIO until the residual is the unit
REPAIR_MARGIN = 0.5
REPAIR_RESIDUAL_UNIT = 8e-7
REPAIR_MARGIN_CAP = 3.0
# The layer-1 residual undercounts what a change that alters the text's meaning (turns removed,
# passages reordered) leaves in the later layers, by a factor that differs by traffic. Repair
# measures it on the tokens it recomputes: how their deviation grew past the selection layer
# against at it (``agent.recompute.Repaired.depth``). The margin then scales with
# sqrt(residual x depth): REPAIR_MARGIN at a residual of REPAIR_RESIDUAL_UNIT and a depth of
# REPAIR_DEPTH_UNIT (twice the largest first-token gap error per sqrt(residual x depth) on the dev
# half, 15.5: 0.5 / sqrt(8e-7 x 320) = 31; ``docs/consistency.md``, "A predictor that sees the
# depth"). Not where decode steps take int8 activations (:func:`depth_unit_for`), and where no
# depth was measured the margin is the residual's alone, as if the depth were the unit.
REPAIR_DEPTH_UNIT = 320.0


def guard_margin(
    margin: float, residual: float, unit: float, depth: float | None = None, depth_unit: float = 0.0
) -> float:
    """The guard's margin for repaired KV that is still ``residual`` from its context: ``margin``
    at a residual of ``unit``, scaled by ``sqrt(residual / unit)`` up and down (the residual is an
    energy ratio; the logits' error follows its amplitude). ``unit`` 0: ``margin`` always. Then,
    where the repair measured its ``depth`` (``agent.recompute.Repaired.depth``; None: not
    measured) and ``depth_unit`` > 0, times ``sqrt(depth / depth_unit)``: a repair whose deviation
    grew less through the later layers than the unit gets a narrower margin, one whose grew more
    a wider one."""
    out = margin if unit <= 0 else margin * math.sqrt(max(0.0, residual) / unit)
    return out * depth_factor(depth, depth_unit)


def depth_unit_for(depth_unit: float, quantised_decode: bool) -> float:
    """The depth unit a model's guard uses: 0 (the residual alone) where its decode steps take
    int8 activations. There a repair's first-token error does not bound its later steps' (a small
    change of the activations moves some of their int8 codes by a whole step): on the dev half a
    clock's repairs, at most 0.004 logits off on the first token, needed margins up to 0.25 over
    their answers, and at the depth unit's narrower margins 3 of 21 answers changed, against none
    of 21 with float32 decode products (``docs/consistency.md``)."""
    return 0.0 if quantised_decode else depth_unit


def depth_factor(depth: float | None, depth_unit: float) -> float:
    """What a measured ``depth`` does to the guard's margin (:func:`guard_margin`); 1.0 where not
    measured or the unit is 0."""
    if depth is None or depth_unit <= 0 or not math.isfinite(depth):
        return 1.0
    return math.sqrt(max(0.0, depth) / depth_unit)


def give_up_residual(margin: float, unit: float, cap: float) -> float:
    """The residual beyond which the guard's margin would exceed ``cap`` (inf: never given up,
    where any of the three is 0)."""
    if min(cap, margin, unit) <= 0:
        return float("inf")
    return unit * (cap / margin) ** 2
