"""The compiled-kernel tests once more, built for AVX2, on a machine whose native build is AVX-512.

Every other test of ``kernels.cpu`` runs the native build. On an AVX-512 machine that leaves the
AVX2 code (8-lane vectors, other tiles and permutation tables) untested, yet it is what most
users' CPUs run; so this re-runs those modules in a child process with ``PDSERVE_CPU_ISA=avx2``.
On an AVX2-only machine the native build is the AVX2 code and there is nothing to add.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu import ISA_ENV, runnable_isas

REPO = Path(__file__).resolve().parents[2]
MODULES = ["tests/kernels/test_cpu_linear.py", "tests/kernels/test_cpu_attention.py",
           "tests/kernels/test_cpu_elementwise.py", "tests/kernels/test_cpu_quant_linear.py",
           "tests/kernels/test_cpu_kv_quant.py", "tests/kernels/test_cpu_attention_bf16.py",
           "tests/kernels/test_cpu_decoder_stack.py"]


@pytest.mark.skipif("avx512" not in runnable_isas(), reason="the native build is the AVX2 code here")
def test_the_compiled_kernel_tests_pass_for_avx2():
    env = {**os.environ, ISA_ENV: "avx2", "PDSERVE_CPU_CALIBRATION": "off"}
    # the libraries side by side first (one compiler per CPU), not one by one as the tests load them
    build = subprocess.run([sys.executable, "-m", "kernels.cpu", "avx2"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, f"AVX2 build:\n{build.stdout[-2000:]}\n{build.stderr[-4000:]}"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MODULES],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"AVX2 build:\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}"
