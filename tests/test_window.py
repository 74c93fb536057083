"""cache/window.py: placing chunks into one window's arena, against rotating each and joining."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cache.layout import ChunkKV, text_positions
from cache.window import ArenaDims, Placement, Window
from tests.test_rope import SPECS, _positions


def _chunk(n: int, spec_name: str, seed: int) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    spec = SPECS[spec_name]
    positions = text_positions(n) if spec.n_axes == 1 else _positions(spec, n, 0)
    extent = int(positions.max()) + 1
    k, v = torch.randn(3, 2, n, 64, generator=g), torch.randn(3, 2, n, 48, generator=g)
    return ChunkKV(k=k, v=v, positions=positions, extent=extent, family="gqa")


def _laid_out(kvs: list[ChunkKV], start: int) -> list[Placement]:
    items = []
    for kv in kvs:
        items.append(Placement(kv, start=start))
        start += kv.extent
    return items


def _window_kv(window: Window, items: list[Placement]) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [window.placed_kv(item) for item in items]
    return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)


@pytest.mark.parametrize("spec_name", ["half", "interleaved", "mrope"])
@pytest.mark.parametrize("kernel", ["auto", "eager"])
def test_a_window_equals_each_chunk_placed_and_joined(spec_name: str, kernel: str) -> None:
    spec = SPECS[spec_name]
    kvs = [_chunk(n, spec_name, i) for i, n in enumerate([5, 30, 1, 12])]
    items = _laid_out(kvs, 7)
    window = Window(spec, kernel)
    arena = window.sync(items)
    assert arena.lengths == [sum(kv.n_tokens for kv in kvs)] * 3
    k, v = _window_kv(window, items)
    placed = [kv.place(item.start, spec, "eager") for kv, item in zip(kvs, items, strict=True)]
    torch.testing.assert_close(k, torch.cat([pk for pk, _ in placed], dim=2), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v, torch.cat([pv for _, pv in placed], dim=2), rtol=0, atol=0)


@pytest.mark.parametrize("spec_name", ["half", "mrope"])
def test_placed_keys_are_copied_bit_for_bit_at_their_place_and_moved_elsewhere(spec_name: str) -> None:
    spec = SPECS[spec_name]
    kv = _chunk(9, spec_name, 3)
    k_at_4, _ = kv.place(4, spec, "eager")
    stored = ChunkKV(k_at_4, kv.v, kv.positions, kv.extent, kv.family, placed_at=4)
    here, there = Placement(stored, start=4), Placement(stored, start=4 + stored.extent + 10)
    gap = Placement(_chunk(10, spec_name, 5), start=4 + stored.extent)
    window = Window(spec)
    window.sync([here, gap, there])
    assert torch.equal(window.placed_kv(here)[0], k_at_4)  # the stored frame: not rotated at all
    moved = kv.place(there.start, spec, "eager")[0]
    torch.testing.assert_close(window.placed_kv(there)[0], moved, rtol=1e-5, atol=1e-5)


def test_a_later_sync_writes_only_what_is_new_and_fills_the_holes() -> None:
    spec = SPECS["half"]
    kvs = [_chunk(n, "half", i) for i, n in enumerate([4, 6, 8])]
    items = _laid_out(kvs, 0)
    window = Window(spec)
    window.sync(items)
    written = window.tokens_rotated
    window.sync(items)  # nothing moved: nothing written
    assert window.tokens_rotated == written
    late = Placement(_chunk(6, "half", 9))
    survivors = [items[0], items[2], late]
    start = 0
    for item in survivors:
        item.start, start = start, start + item.kv.extent
    arena = window.sync(survivors)
    assert window.tokens_rotated - written == kvs[2].n_tokens + late.kv.n_tokens  # moved + new
    assert arena.lengths[0] == sum(item.kv.n_tokens for item in survivors)  # the hole was filled
    assert window.rebuilds == 1
    k, _ = _window_kv(window, survivors)
    expect = torch.cat([item.kv.place(item.start, spec, "eager")[0] for item in survivors], dim=2)
    torch.testing.assert_close(k, expect, rtol=1e-6, atol=1e-6)


def test_adopt_takes_only_tokens_the_model_wrote_after_the_window() -> None:
    spec = SPECS["half"]
    first = _chunk(4, "half", 0)
    window = Window(spec, dims=ArenaDims(3, (2, 64), (2, 48), torch.float32, torch.device("cpu")))
    items = [Placement(first)]
    arena = window.sync(items, reserve=16)
    new = _chunk(3, "half", 1)
    k_new, _ = new.place(first.extent, spec, "eager")
    for layer in range(3):
        arena.append(layer, k_new[layer], new.v[layer], arena.generation)
    other = Placement(_chunk(3, "half", 2), start=first.extent)
    assert not window.adopt(other)  # not what the arena holds
    item = Placement(new, start=first.extent)
    assert window.adopt(item)
    assert item.segs == [(4, 3)]
    assert window.used == 7


def test_adopt_checks_the_values_with_one_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """The values' last token in every layer, compared at once (four comparisons of one layer's
    token each cost five times as much per chunk); a chunk shifted by a token fails it."""
    spec = SPECS["half"]
    first = _chunk(4, "half", 0)
    window = Window(spec, dims=ArenaDims(3, (2, 64), (2, 48), torch.float32, torch.device("cpu")))
    arena = window.sync([Placement(first)], reserve=16)
    new = _chunk(3, "half", 1)
    k_new, _ = new.place(first.extent, spec, "eager")
    for layer in range(3):
        arena.append(layer, k_new[layer], new.v[layer], arena.generation)
    shifted = dataclasses.replace(new, v=torch.roll(new.v, 1, dims=2))
    equal, calls = torch.equal, []
    monkeypatch.setattr(torch, "equal", lambda a, b: calls.append(a.shape) or equal(a, b))
    assert not window.adopt(Placement(shifted, start=first.extent))
    calls.clear()
    assert window.adopt(Placement(new, start=first.extent))
    assert calls == [torch.Size([3, 2, 48])]


def test_an_empty_window_needs_its_dims() -> None:
    with pytest.raises(ValueError, match="dims"):
        Window(SPECS["half"]).sync([])
