"""Agreement of cached answers with a full prefill's, and the TTFT ratio between them: the fields
that ``kamera bench consistency`` reports for Kamera's rows (``bench/consistency.py``) and for
llama.cpp's (``bench/peer_llama.py``) alike, so both modules import them from here.

Rows are anything with ``.cached`` and ``.reference`` outcomes that carry ``tokens`` and
``ttft_s``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def answer_fields(rows: Sequence[Any], hit: Sequence[Any]) -> dict[str, Any]:
    """Agreement of cached answers with the full prefill's; ``rows`` have ``.cached.tokens`` and
    ``.reference.tokens`` (Kamera's rows and the peer's alike)."""

    def share(rs: Sequence[Any], same: Any) -> float | None:
        return round(sum(map(same, rs)) / len(rs), 4) if rs else None

    return {
        "requests": len(rows),
        "requests_with_hits": len(hit),
        "greedy_agreement_with_hits": share(hit, lambda r: r.cached.tokens == r.reference.tokens),
        "greedy_agreement": share(rows, lambda r: r.cached.tokens == r.reference.tokens),
        "first_token_agreement": share(rows, lambda r: r.cached.tokens[:1] == r.reference.tokens[:1]),
    }


def ttft_fields(hit: Sequence[Any]) -> dict[str, Any]:
    """Full prefill's time to first token over the cached one's, on requests with hits."""
    ratios = [r.reference.ttft_s / r.cached.ttft_s for r in hit if r.cached.ttft_s > 0]
    return {
        "ttft_ratio_median": round(statistics.median(ratios), 3) if ratios else None,
        "ttft_ratio_mean": round(statistics.fmean(ratios), 3) if ratios else None,
    }
