"""The compiled CPU matmul over packed weights against a float64 matmul: every row-tile tail
(M = 1..17), a last panel narrower than the vector width, prefill-sized M, a strided x, and bad
arguments raising ValueError that names them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels.cpu import CpuKernelsUnavailable

try:
    from kernels.cpu.linear import LANES, linear, pack_weight
except CpuKernelsUnavailable as exc:
    pytest.skip(f"compiled CPU kernels unavailable: {exc}", allow_module_level=True)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _check(x, w_t):
    y = linear(x, pack_weight(w_t))
    expected = (x.double() @ w_t.double()).float()
    assert y.shape == expected.shape and y.dtype == torch.float32
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", list(range(1, 18)))
def test_every_row_tail(m):
    _check(_randn(m, 96), _randn(96, 5 * LANES + 3, seed=1))


@pytest.mark.parametrize("n", [1, LANES - 1, LANES, LANES + 1, 3 * LANES, 3 * LANES + 7])
def test_out_features_not_a_multiple_of_the_panel_width(n):
    _check(_randn(3, 40), _randn(40, n, seed=2))


def test_prefill_sized_and_strided_x():
    _check(_randn(200, 64), _randn(64, 130, seed=3))
    wide = _randn(9, 80, seed=4)
    _check(wide[:, :64], _randn(64, 48, seed=5))  # row stride 80


def test_zero_rows():
    assert linear(torch.empty(0, 8), pack_weight(_randn(8, 4))).shape == (0, 4)


def test_bad_arguments_name_what_is_wrong():
    packed = pack_weight(_randn(32, 20))
    with pytest.raises(ValueError, match="x has 31 features but the weight expects 32"):
        linear(_randn(2, 31), packed)
    with pytest.raises(ValueError, match="x must be a 2-d float32"):
        linear(_randn(2, 32).double(), packed)
    with pytest.raises(ValueError, match="stride 1"):
        linear(_randn(32, 2).t(), packed)
    with pytest.raises(ValueError, match="w_t must be a 2-d float32"):
        pack_weight(_randn(4, 4).half())


def test_each_library_builds_into_one_directory_whatever_was_loaded_before(tmp_path):
    # cpp_extension.load appends to the flag lists it is given; flags shared by reference once
    # changed the cache key after the first load, so every process rebuilt the other libraries
    script = ("from kernels.cpu import CSRC, _build_directory, build_all, sources\n"
              "dirs = lambda: [_build_directory(CSRC / f'{n}.cpp', 'native') for n in sources()]\n"
              "before = dirs(); build_all('native'); print(before == dirs())\n")
    env = {**os.environ, "PDSERVE_CACHE_DIR": os.environ.get("PDSERVE_CACHE_DIR", "")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={k: v for k, v in env.items() if v}, timeout=300, check=True)
    assert result.stdout.strip() == "True"
