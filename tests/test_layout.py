"""cache/layout.py: placing chunks into one window, against rotating each and concatenating."""

from __future__ import annotations

import pytest
import torch

from cache.layout import ChunkKV, place_window, text_positions
from tests.test_rope import SPECS, _positions


def _chunk(n: int, spec_name: str, seed: int) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    spec = SPECS[spec_name]
    positions = text_positions(n) if spec.n_axes == 1 else _positions(spec, n, 0)
    extent = int(positions.max()) + 1
    k, v = torch.randn(3, 2, n, 64, generator=g), torch.randn(3, 2, n, 48, generator=g)
    return ChunkKV(k=k, v=v, positions=positions, extent=extent, family="gqa")


@pytest.mark.parametrize("spec_name", ["half", "interleaved", "mrope"])
@pytest.mark.parametrize("kernel", ["auto", "eager"])
def test_place_window_equals_each_chunk_placed_and_joined(spec_name: str, kernel: str) -> None:
    spec = SPECS[spec_name]
    chunks, start = [], 7
    for i, n in enumerate([5, 30, 1, 12]):
        kv = _chunk(n, spec_name, i)
        chunks.append((kv, start))
        start += kv.extent
    k, v = place_window(chunks, spec, kernel)
    placed = [kv.place(at, spec, "eager") for kv, at in chunks]
    torch.testing.assert_close(k, torch.cat([pk for pk, _ in placed], dim=2), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v, torch.cat([pv for _, pv in placed], dim=2), rtol=0, atol=0)
    assert v.data_ptr() != chunks[0][0].v.data_ptr()  # the window owns its buffers


def test_an_empty_window_is_refused() -> None:
    with pytest.raises(ValueError, match="no chunks"):
        place_window([], SPECS["half"])
