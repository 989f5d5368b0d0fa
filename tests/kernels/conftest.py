"""Kernel tests run torch on one thread: the shapes are tiny, and on a shared, busy CPU OpenMP
worker threads spinning at barriers made small matmuls 100x slower."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
