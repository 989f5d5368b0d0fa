"""The Triton kernels compile natively for sm_90, checked without a GPU (see kernels.compile_check),
and none spills registers to local memory there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels._triton import HAS_TRITON

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")]


@pytest.fixture(scope="module")
def compiled() -> list[str]:
    """The ``ok  <kernel> (sm_90): <registers and spills>`` lines of one compile_check run."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "kernels.compile_check"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and ("ptxas" in proc.stderr and "not found" in proc.stderr.lower()):
        pytest.skip("this triton build ships no ptxas")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line for line in proc.stdout.splitlines() if line.startswith("ok  ")]


def test_kernels_compile_for_sm90(compiled):
    assert len(compiled) >= 30, compiled


def test_no_kernel_spills_on_sm90(compiled):
    # the fp32 prefill attention too, on its own tiles (paged_attention.fp32_prefill_tiles)
    unknown = [line for line in compiled if "resources unknown" in line]
    if unknown:  # another triton (the GPU machine's may be older): its ptxas is elsewhere
        pytest.skip(f"no register counts from this triton's ptxas: {unknown[0]}")
    spills = {line.split(" (sm_")[0]: int(re.search(r"(\d+) spill bytes", line).group(1)) for line in compiled}
    assert spills["ok  GEMV linear, 1 row(s), bf16"] == 0  # the parse found the counts
    assert sum("fp32 prefill" in name for name in spills) == 3 and sum("bf16 prefill" in n for n in spills) == 2
    assert {name for name, size in spills.items() if size} == set(), spills
