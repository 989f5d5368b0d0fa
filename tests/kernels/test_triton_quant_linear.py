"""The Triton dequantize-in-kernel GEMV (kernels/quant_triton.py) natively on CUDA, or under
TRITON_INTERPRET=1 on the CPU, on small shapes, against dequantize-then-matmul in float64:
Q8_0, Q4_0, Q4_1 and Q4_K, a partial last column tile and a K that is not a multiple of the
kernel's K tile (Q4_K: 256 inputs per block, so its K is 256 or 512). Tolerance atol=rtol=1e-4
(weights of scale in^-0.5; only fp32 rounding of the sums differs)."""

from __future__ import annotations

import pytest
import torch

from kernels.quant import BLOCK_VALUES, FORMATS, dequantize, quantize
from tests.kernels.helpers import DEVICE, requires_triton

pytestmark = requires_triton


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 20, 96), (3, 16, 64)])
def test_matches_dequantize_then_matmul(fmt, m, n, k):
    from kernels.quant_triton import pack, quant_linear

    if k % BLOCK_VALUES[fmt]:
        k = 256 * (k // 32 - 1)  # 96 -> 512, 64 -> 256
    rows = quantize(_randn(n, k, seed=1) * k ** -0.5, fmt)
    x = _randn(m, k)
    y = quant_linear(x.to(DEVICE), pack(rows, DEVICE)).cpu()
    expected = (x.double() @ dequantize(rows).double().t()).float()
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


def test_bad_x_names_what_is_wrong():
    from kernels.quant_triton import pack, quant_linear

    handle = pack(quantize(_randn(4, 64), "q4_1"), DEVICE)
    with pytest.raises(ValueError, match="x has 32 features but the weight expects 64"):
        quant_linear(_randn(1, 32).to(DEVICE), handle)
    with pytest.raises(ValueError, match="x"):
        quant_linear(_randn(1, 64).double().to(DEVICE), handle)
