"""Shared fixtures: the real SmolLM2 weights load once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from agent.adapters.base import ModelAdapter
from tools.data import find_data_folder

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm2() -> ModelAdapter:
    from agent.adapters.loading import ModelNotFoundError, load_adapter

    try:
        return load_adapter()
    except ModelNotFoundError as e:
        pytest.skip(f"embedded SmolLM2 weights unavailable: {e}")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    found = find_data_folder()
    if found.path is None:
        pytest.skip(found.describe())
    return found.path
