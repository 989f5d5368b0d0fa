"""The engine's CPU thread policy (engine/runner/cpu_threads.py)."""

from __future__ import annotations

import os

import pytest
import torch
from threadpoolctl import threadpool_info  # type: ignore[import-untyped]  # no stubs

from engine.runner.cpu_threads import configure_cpu_threads, default_num_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    configure_cpu_threads(before, "cpu")  # torch back to its count (BLAS to one: the 'cpu' policy)


@pytest.mark.parametrize("value, expected", [("3", 3), ("1", 1)])
def test_omp_num_threads_sets_the_default(monkeypatch, value, expected):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert default_num_threads() == expected


@pytest.mark.parametrize("value", [None, "", "0", "two", "-1"])
def test_without_a_positive_omp_num_threads_every_usable_cpu(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert default_num_threads() == len(os.sched_getaffinity(0))


def _blas_threads() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


def test_each_backend_gives_the_cores_to_the_pool_doing_its_work(restore_threads):
    assert configure_cpu_threads(2, "cpu") == 2
    assert torch.get_num_threads() == 2 and _blas_threads() == {1}
    assert configure_cpu_threads(2, "torch") == 2
    assert torch.get_num_threads() == 1 and _blas_threads() == {2}
    # the Triton interpreter: both pools on one thread, whatever was asked
    assert configure_cpu_threads(2, "triton") == 1
    assert torch.get_num_threads() == 1 and _blas_threads() == {1}


def test_zero_takes_omp_num_threads(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert configure_cpu_threads(0, "cpu") == 1
    assert torch.get_num_threads() == 1
