"""The reuse modes: one vocabulary for chat completions, sessions, the agent loop and video QA.

A mode says what an answer may be computed from:

- ``exact``: KV that a full prefill of the same prompt would compute bit for bit (an exact
  prefix, a window nothing has moved or patched); everything else is prefilled in context. The
  answer is the full prefill's.
- ``repair`` (the default): cached KV at other positions or after other antecedents, moved by
  rotation and repaired (chat completions recompute the tokens that deviate most; sessions and
  the agent loop apply their chunks' patches). Greedy answers are guarded: the first decode step
  whose top two logits are closer than the guard's margin moves the request to exact KV, where
  the tokens so far are replayed and checked, so the answer is the one a full prefill gives.
- ``fast``: cached KV moved by rotation and used as is, unguarded: the fastest, and an answer
  may differ from a full prefill's.

Not here: how each path reuses and repairs (``agent/engine/prompt_cache.py`` for chat
completions, ``agent/context.py`` and ``agent/loop.py`` for windows), the guard
(``agent/engine/generation.py``).
"""

from __future__ import annotations

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
