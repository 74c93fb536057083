"""Small helpers shared by the tests."""

from __future__ import annotations

import torch


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the error measure every exactness test reports."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
