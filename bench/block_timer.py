"""Time units of work on a model cut in depth, and scale each run to the real depth.

Forward hooks time every block of the kinds :func:`agent.adapters.qwen_vl_widths.block_groups`
names; a run's time at the real depth is the rest of the run plus each kind's mean block time
times its real count (``bench/video_costs_model.py``: ``scale_to_depth``). CPU work only: a
block's time is read when its call returns, which on a GPU would need a synchronisation.

Not here: what is timed (``video_costs.py``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from agent.adapters.qwen_vl import QwenVLAdapter
from agent.adapters.qwen_vl_widths import block_groups
from bench.video_costs_model import scale_to_depth


class Unit(NamedTuple):
    """Median seconds of one measured unit: as run (``measured_s``) and at the real depth."""

    measured_s: float
    scaled_s: float


class BlockClock:
    """Seconds spent inside groups of modules, summed per group, by forward hooks (a block's time
    runs from its pre-hook to its hook: on the CPU the work is done when the call returns)."""

    def __init__(self, groups: Mapping[str, Sequence[torch.nn.Module]]) -> None:
        self.seconds = dict.fromkeys(groups, 0.0)
        self._handles: list[Any] = []
        self._started: dict[int, float] = {}
        for name, modules in groups.items():
            for module in modules:
                self._handles.append(module.register_forward_pre_hook(self._start))
                self._handles.append(module.register_forward_hook(self._stop(name)))

    def _start(self, module: torch.nn.Module, args: Any) -> None:
        self._started[id(module)] = time.perf_counter()

    def _stop(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            self.seconds[name] += time.perf_counter() - self._started.pop(id(module))

        return hook

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class Timer:
    """Times units of work on one adapter and scales each run to ``real`` depths.

    A unit runs ``warmup`` times untimed, then at least ``repeats`` times and, while its runs sum
    to less than ``min_seconds``, again (up to ``MAX_RUNS``): on a shared machine a short unit's
    median needs many runs."""

    MAX_RUNS = 100

    def __init__(
        self, adapter: QwenVLAdapter, real: Mapping[str, int], repeats: int, min_seconds: float = 0.0
    ) -> None:
        groups = block_groups(adapter)
        self.measured = {kind: len(blocks) for kind, blocks in groups.items()}
        self.real = dict(real)
        self.repeats = repeats
        self.min_seconds = min_seconds
        self.clock = BlockClock(groups)

    def unit(
        self,
        run: Callable[[], object],
        reset: Callable[[], object] = lambda: None,
        warmup: int = 1,
        repeats: int | None = None,
    ) -> Unit:
        """``run`` timed as the class doc says (``reset`` after each run, untimed)."""
        least = self.repeats if repeats is None else repeats
        totals: list[float] = []
        scaled: list[float] = []
        for _ in range(warmup):
            run()
            reset()
        while len(totals) < least or (sum(totals) < self.min_seconds and len(totals) < self.MAX_RUNS):
            self.clock.reset()
            t0 = time.perf_counter()
            run()
            total = time.perf_counter() - t0
            reset()
            totals.append(total)
            scaled.append(scale_to_depth(total, self.clock.seconds, self.measured, self.real))
        return Unit(statistics.median(totals), statistics.median(scaled))
