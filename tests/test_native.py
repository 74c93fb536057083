"""cache/native.py: the C rotation pass against the float64 reference and the eager ops; its build."""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from cache import native
from cache.rope import KERNELS, cos_sin, relocate, rotate, rotate_many, unrotate
from tests.test_rope import SPECS, _positions, max_rel, reference_rotate

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler on this machine")


@pytest.mark.parametrize("limit", [0, 1, 2])  # every vector loop this CPU has, then fewer
@pytest.mark.parametrize("name", list(SPECS))
def test_native_matches_reference_and_eager(name: str, limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "VECTOR_LIMIT", limit)
    spec = SPECS[name]
    x = torch.randn(3, 2, 37, 64)
    pos = _positions(spec, 37, 1000)
    got = rotate(x, pos, spec, kernel="native")
    assert max_rel(got, reference_rotate(x, pos, spec)) < 1e-6
    torch.testing.assert_close(got, rotate(x, pos, spec, kernel="eager"), rtol=1e-6, atol=1e-6)
    # past the rotary part the features are copied bit for bit
    torch.testing.assert_close(got[..., spec.rotary_dim :], x[..., spec.rotary_dim :], rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(9, 64), (2, 9, 64), (2, 2, 3, 9, 64)])
def test_any_number_of_leading_dims(shape: tuple[int, ...]) -> None:
    spec = SPECS["half"]
    x = torch.randn(*shape)
    pos = torch.arange(5, 14)
    torch.testing.assert_close(rotate(x, pos, spec, "native"), rotate(x, pos, spec, "eager"))


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("stream", [False, True])
def test_writes_into_a_strided_window_without_touching_the_rest(
    pairing: str, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if stream:  # the streaming-store loop (x86-64 with AVX-512, half pairing, aligned rows)
        monkeypatch.setattr(native, "STREAM_MIN_ELEMENTS", 1)
    spec = SPECS[pairing]
    arena = torch.zeros(4, 2, 100, 64)
    x = torch.randn(4, 2, 30, 64)
    pos = torch.arange(500, 530)
    out = arena[:, :, 40:70]
    assert rotate(x, pos, spec, "native", out=out) is out
    torch.testing.assert_close(out, rotate(x, pos, spec, "eager"))
    assert arena[:, :, :40].abs().sum() == 0
    assert arena[:, :, 70:].abs().sum() == 0


def test_non_contiguous_input_and_bf16_output() -> None:
    spec = SPECS["half"]
    x = torch.randn(2, 64, 3, 20).permute(0, 2, 3, 1)  # feature stride is not 1
    pos = torch.arange(20)
    expected = rotate(x.contiguous(), pos, spec, "eager")
    torch.testing.assert_close(rotate(x, pos, spec, "native"), expected)
    out = torch.empty(2, 3, 20, 64, dtype=torch.bfloat16)
    rotate(x, pos, spec, "auto", out=out)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", ["half", "yarn", "mrope"])
def test_unrotate_and_relocate_with_one_angle_for_all_tokens(name: str) -> None:
    spec = SPECS[name]
    x = torch.randn(2, 3, 16, 64)
    pos = _positions(spec, 16, 7)
    rotated = rotate(x, pos, spec, "native")
    torch.testing.assert_close(unrotate(rotated, pos, spec), x, rtol=1e-5, atol=1e-5)
    if spec.n_axes == 1:  # relocation moves every axis alike: a 1-D spec shows it plainly
        moved = relocate(rotated, 300, spec, kernel="native")
        torch.testing.assert_close(moved, rotate(x, pos + 300, spec, "eager"), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(5, 3, 50, 64), (1, 3, 50, 64), (1, 1, 333, 64)])
def test_parallel_parts_give_the_same_result(shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SPECS["half"]
    x = torch.randn(*shape)
    pos = torch.arange(shape[2]) * 3
    single = rotate(x, pos, spec, "native")
    monkeypatch.setattr(native, "PARALLEL_MIN_ELEMENTS", 1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        parted = rotate(x, pos, spec, "native")
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(parted, single, rtol=0, atol=0)


def test_tensors_that_need_autograd_are_not_taken() -> None:
    spec = SPECS["half"]
    x = torch.randn(2, 8, 64, requires_grad=True)
    pos = torch.arange(8)
    cos, _ = cos_sin(pos, spec)
    assert not native.supports(x, cos, None)
    with torch.no_grad():
        assert native.supports(x, cos, None)
    with pytest.raises(ValueError, match="native kernel"):
        rotate(x, pos, spec, "native")


def test_build_is_reused_and_a_damaged_build_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAMERA_CACHE_DIR", str(tmp_path))
    first = native.build()
    assert first.parent == tmp_path / "kernels"
    stamp = first.stat().st_mtime_ns
    assert native.build() == first
    assert first.stat().st_mtime_ns == stamp  # not compiled again
    first.write_bytes(b"not a shared object")
    monkeypatch.setattr(native, "_STATE", native._Loaded())
    lib = native.library()
    assert lib is not None
    assert first.read_bytes()[:4] == b"\x7fELF"
    assert list((tmp_path / "kernels").iterdir()) == [first]  # no temporary files left


def test_without_a_compiler_auto_falls_back_and_native_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KAMERA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: None)
    monkeypatch.setattr(native, "_STATE", native._Loaded())
    with caplog.at_level(logging.WARNING, logger="cache.native"):
        assert native.library() is None
    assert "no C compiler" in caplog.text
    spec = SPECS["half"]
    x, pos = torch.randn(2, 8, 64), torch.arange(8)
    torch.testing.assert_close(rotate(x, pos, spec, "auto"), rotate(x, pos, spec, "eager"))
    with pytest.raises(native.NativeKernelError, match="no C compiler"):
        rotate(x, pos, spec, "native")


def test_a_failing_compiler_is_reported_with_its_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "broken.c"
    source.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCE", source)
    with pytest.raises(native.NativeKernelError, match="failed"):
        native.build(tmp_path)
    assert not any((tmp_path / "kernels").iterdir())  # nothing half-written is left behind


def test_every_kernel_is_listed() -> None:
    assert {"auto", "eager", "native", "compiled"} <= set(KERNELS)


@pytest.mark.parametrize("kernel", ["auto", "native", "eager"])
def test_rotate_many_equals_one_rotation_after_another(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "PARALLEL_MIN_ELEMENTS", 1)  # the threads share every rotation
    spec = SPECS["mrope"]
    arena = torch.zeros(3, 2, 200, 64)
    sizes, items, expected = [5, 40, 1, 17], [], []
    at = 0
    for i, n in enumerate(sizes):
        x = torch.randn(3, 2, n, 64)
        pos = _positions(spec, n, 100 * i)
        items.append((x, pos, arena[:, :, at : at + n]))
        expected.append(rotate(x, pos, spec, "eager"))
        at += n
    rotate_many(items, spec, kernel)
    torch.testing.assert_close(arena[:, :, :at], torch.cat(expected, dim=2), rtol=1e-6, atol=1e-6)
    assert arena[:, :, at:].abs().sum() == 0


def _rotate_in_child(queue: Any) -> None:
    # small tensors: torch's own OpenMP team is not usable after a fork, only ours is under test
    x = torch.randn(4, 2, 8, 64)
    pos = torch.arange(8)
    parted = rotate(x, pos, SPECS["half"], "native")
    queue.put(torch.allclose(parted, rotate(x, pos, SPECS["half"], "eager"), rtol=1e-6, atol=1e-6))


def test_a_forked_child_gets_its_own_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "PARALLEL_MIN_ELEMENTS", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rotate(torch.randn(4, 2, 8, 64), torch.arange(8), SPECS["half"], "native")  # the pool exists now
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_rotate_in_child, args=(queue,))
        child.start()
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
        assert child.exitcode == 0, "the child hung or failed rotating with the parent's pool"
        assert queue.get(timeout=5)
    finally:
        torch.set_num_threads(threads)


def test_sizes_the_c_loop_would_trust_are_checked_first() -> None:
    x, out = torch.randn(2, 5, 64), torch.empty(2, 5, 64)
    cos, sin = torch.randn(5, 32), torch.randn(5, 32)
    native.rotate(x, cos, sin, 64, False, out)  # the right sizes
    bad = [
        (x, cos[:, :16], sin[:, :16], 64, out),  # a table narrower than rotary_dim / 2
        (x, cos[:3], sin[:3], 64, out),  # fewer table rows than tokens
        (x, cos, sin, 128, out),  # rotary_dim past the feature dim
        (x, cos, sin, 63, out),  # an odd rotary_dim
        (x, cos, sin, 64, torch.empty(2, 6, 64)),  # out of another shape
        (x, cos.double(), sin.double(), 64, out),  # another dtype
        (x, cos, sin, 64, torch.empty(2, 64, 5).transpose(1, 2)),  # out without unit feature stride
    ]
    for args in bad:
        with pytest.raises(ValueError, match=r"layout|rotary_dim|shape|float32|stride"):
            native.rotate(args[0], args[1], args[2], args[3], False, args[4])
