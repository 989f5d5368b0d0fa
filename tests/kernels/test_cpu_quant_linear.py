"""The compiled quantized linear (Q8_0, Q4_0, Q4_1) against dequantize-then-matmul in float64.

The kernel multiplies the file's exact values (d * q [+ m]) in another order than the oracle, so
the only difference is fp32 rounding of the sums: with weights of scale in^-0.5 and unit x,
|error| <= 1e-4 absolute + 1e-4 relative at every shape here (the largest in = 1536). Also: the
torch dequantizer equals gguf's (llama.cpp's) bit for bit, Q4_0 -> Q4_1 is exact, every row tail
and a last panel narrower than the vector width, prefill-sized M, a strided x, zero rows, and bad
arguments raising ValueError that names them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kernels.cpu import CpuKernelsUnavailable
from kernels.quant import FORMATS, QuantRows, cat_rows, dequantize, quantize, to_q4_1

try:
    from kernels.quant_cpu import LANES, pack, quant_linear
except CpuKernelsUnavailable as exc:
    pytest.skip(f"compiled CPU kernels unavailable: {exc}", allow_module_level=True)

GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
        "q4_1": GGMLQuantizationType.Q4_1}


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rows(n, k, fmt, seed=1):
    return quantize(_randn(n, k, seed=seed) * k ** -0.5, fmt)


def _check(x, rows):
    y = quant_linear(x, pack(rows))
    expected = (x.double() @ dequantize(rows).double().t()).float()
    assert y.shape == expected.shape and y.dtype == torch.float32
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_gguf_bit_for_bit(fmt):
    rows = _rows(7, 96, fmt)
    theirs = gguf_dequantize(rows.data, GGML[fmt]).reshape(7, 96)
    assert torch.equal(dequantize(rows), torch.from_numpy(np.array(theirs, dtype=np.float32)))


def test_q4_0_becomes_q4_1_exactly_and_fused_rows_keep_their_values():
    a, b = _rows(5, 64, "q4_0"), _rows(3, 64, "q4_1", seed=2)
    assert torch.equal(dequantize(to_q4_1(a)), dequantize(a))
    fused = cat_rows([a, b])
    assert fused.format == "q4_1"
    assert torch.equal(dequantize(fused), torch.cat([dequantize(a), dequantize(b)]))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", list(range(1, 10)))
def test_every_row_tail(fmt, m):
    _check(_randn(m, 96), _rows(5 * LANES + 3, 96, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [1, LANES - 1, LANES + 1, 3 * LANES + 7])
def test_out_features_not_a_multiple_of_the_panel_width(fmt, n):
    _check(_randn(3, 64), _rows(n, 64, fmt, seed=2))


@pytest.mark.parametrize("fmt", FORMATS)
def test_model_shapes_prefill_sized_and_strided_x(fmt):
    _check(_randn(1, 1536), _rows(96, 1536, fmt, seed=3))
    _check(_randn(40, 64), _rows(130, 64, fmt, seed=4))
    wide = _randn(9, 80, seed=5)
    _check(wide[:, :64], _rows(48, 64, fmt, seed=6))  # row stride 80


def test_zero_rows():
    assert quant_linear(torch.empty(0, 32), pack(_rows(4, 32, "q4_1"))).shape == (0, 4)


def test_bad_arguments_name_what_is_wrong():
    packed = pack(_rows(20, 64, "q8_0"))
    with pytest.raises(ValueError, match="x has 32 features but the weight expects 64"):
        quant_linear(_randn(2, 32), packed)
    with pytest.raises(ValueError, match="x must be a 2-d float32"):
        quant_linear(_randn(2, 64).double(), packed)
    with pytest.raises(ValueError, match="stride 1"):
        quant_linear(_randn(64, 2).t(), packed)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantRows("q8_0", np.zeros((2, 34), dtype=np.uint8), 33)
    with pytest.raises(ValueError, match=r"uint8 data \[out, 68\]"):
        QuantRows("q8_0", np.zeros((2, 34), dtype=np.uint8), 64)
    with pytest.raises(ValueError, match="format must be one of"):
        QuantRows("q5_k", np.zeros((2, 34), dtype=np.uint8), 32)
