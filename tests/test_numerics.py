"""The numerics string that content keys carry: what it names, and that it follows the thread
count, the device and the attention implementation of each call."""

from __future__ import annotations

import pytest
import torch

from cache.numerics import _build_setting, numerics, process_numerics


def test_numerics_names_torch_blas_cpu_threads_device_and_attention() -> None:
    got = numerics("cpu", "sdpa")
    config = torch.__config__.show()
    assert got.startswith(process_numerics() + ",")
    assert f"torch={torch.__version__}" in got
    assert f"cpu={torch.backends.cpu.get_cpu_capability()}" in got
    assert f"blas={_build_setting(config, 'BLAS_INFO')}" in got
    assert got.endswith(f",threads={torch.get_num_threads()},device=cpu,attention=sdpa")


def test_build_settings_are_read_from_torchs_config_text() -> None:
    text = "  - Build settings: BLAS_INFO=open, BUILD_TYPE=Release, LAPACK_INFO=, USE_MKL=OFF\n"
    assert _build_setting(text, "BLAS_INFO") == "open"
    assert _build_setting(text, "LAPACK_INFO") == "none"
    assert _build_setting(text, "CUDA_VERSION") == "none"


def test_numerics_follow_the_thread_count_attention_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread count is read at each call: a process that changes it after loading a model
    keys what it computes after under the new count."""
    before = numerics("cpu", "sdpa")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    after = numerics("cpu", "sdpa")
    assert after != before
    assert "threads=97" in after
    assert numerics("cpu", "eager") != after
    assert numerics("meta", "sdpa") != after
