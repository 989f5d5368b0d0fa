"""The compiled quantized linear (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K) against its exact reference and
against dequantize-then-matmul in float64. (The K-quants have 256 inputs per block: their cases
take 8x the inputs where a shape is not a multiple of 256.)

By default the kernel quantizes x to int8 per block of 32 inputs and sums integer products
(llama.cpp's scheme); with activations "fp32" it multiplies the file's exact values by the fp32 x.
Every case runs both:

- fp32 x against dequantize-then-matmul in float64: only the fp32 rounding of the sums differs,
  so |error| <= 1e-4 absolute + 1e-4 relative at every shape here;
- int8 x against ``quant_linear_int8_ref`` (the same quantized x, the same values, in float64):
  again only fp32 rounding, the same 1e-4 (weights of scale in^-0.5, unit x, in <= 1536);
- int8 x against dequantize-then-matmul of the fp32 x: each input is off by at most
  dx / 2 = max|x over its block| / 254, so |y - x @ W| <= sum over blocks b of
  (dx_b / 2) * sum_{k in b} |W[k, n]|, plus the same 1e-4 for the fp32 sums. That bound is what
  int8 activations cost; it is checked per element.

Also: the torch dequantizer equals gguf's (llama.cpp's) bit for bit, Q4_0 -> Q4_1 is exact,
every row tail and a last panel narrower than the vector width, prefill-sized M, a strided x,
zero rows and all-zero blocks, and bad arguments raising ValueError that names them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kernels.cpu import CpuKernelsUnavailable
from kernels.quant import (
    BLOCK,
    BLOCK_VALUES,
    FORMATS,
    QuantRows,
    cat_rows,
    dequantize,
    quant_linear_int8_ref,
    quantize,
    quantize_activations_ref,
    to_offset_form,
)

try:
    from kernels.cpu import elementwise
    from kernels.quant_cpu import LANES, pack, quant_linear, rms_norm_quant_linear
except CpuKernelsUnavailable as exc:
    pytest.skip(f"compiled CPU kernels unavailable: {exc}", allow_module_level=True)

GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
        "q4_1": GGMLQuantizationType.Q4_1, "q4_k": GGMLQuantizationType.Q4_K,
        "q6_k": GGMLQuantizationType.Q6_K, "q5_0": GGMLQuantizationType.Q5_0,
        "q5_1": GGMLQuantizationType.Q5_1}


def _k(fmt, k):
    """k inputs, or 8 k where ``fmt``'s blocks do not divide k (Q4_K: 256 per block)."""
    return k if k % BLOCK_VALUES[fmt] == 0 else 8 * k


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rows(n, k, fmt, seed=1):
    return quantize(_randn(n, k, seed=seed) * k ** -0.5, fmt)


def _check(x, rows):
    """Both activation modes: fp32 x against dequantize-then-matmul, int8 x against its exact
    reference and the rounding bound."""
    expected = x.double() @ dequantize(rows).double().t()
    y = quant_linear(x, pack(rows, "fp32"))
    assert y.shape == expected.shape and y.dtype == torch.float32
    torch.testing.assert_close(y, expected.float(), atol=1e-4, rtol=1e-4)

    y = quant_linear(x, pack(rows, "int8"))
    assert y.shape == expected.shape and y.dtype == torch.float32
    torch.testing.assert_close(y, quant_linear_int8_ref(x, rows).float(), atol=1e-4, rtol=1e-4)
    _, dx = quantize_activations_ref(x)
    w_abs = dequantize(rows).double().abs().reshape(rows.out_features, -1, BLOCK).sum(dim=2)  # [out, nb]
    bound = (dx.double() / 2) @ w_abs.t() + 1e-4
    error = (y.double() - expected).abs()
    assert bool((error <= bound).all()), f"max error / bound {float((error / bound).max()):.3f}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_gguf_bit_for_bit(fmt):
    rows = _rows(7, _k(fmt, 96), fmt)
    theirs = gguf_dequantize(rows.data, GGML[fmt]).reshape(7, _k(fmt, 96))
    assert torch.equal(dequantize(rows), torch.from_numpy(np.array(theirs, dtype=np.float32)))


@pytest.mark.parametrize("fmt", ["q4", "q5"])
def test_the_offset_free_formats_become_offset_form_exactly_and_fused_rows_keep_their_values(fmt):
    a, b = _rows(5, 64, f"{fmt}_0"), _rows(3, 64, f"{fmt}_1", seed=2)
    assert to_offset_form(a).format == f"{fmt}_1" and torch.equal(dequantize(to_offset_form(a)), dequantize(a))
    fused = cat_rows([a, b])
    assert fused.format == f"{fmt}_1"
    assert torch.equal(dequantize(fused), torch.cat([dequantize(a), dequantize(b)]))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", list(range(1, 10)))
def test_every_row_tail(fmt, m):
    _check(_randn(m, _k(fmt, 96)), _rows(5 * LANES + 3, _k(fmt, 96), fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [1, LANES - 1, LANES + 1, 3 * LANES + 7])
def test_out_features_not_a_multiple_of_the_panel_width(fmt, n):
    _check(_randn(3, _k(fmt, 64)), _rows(n, _k(fmt, 64), fmt, seed=2))


@pytest.mark.parametrize("fmt", FORMATS)
def test_model_shapes_prefill_sized_and_strided_x(fmt):
    _check(_randn(1, 1536), _rows(96, 1536, fmt, seed=3))
    k = _k(fmt, 64)
    _check(_randn(40, k), _rows(130, k, fmt, seed=4))
    wide = _randn(9, k + 16, seed=5)
    _check(wide[:, :k], _rows(48, k, fmt, seed=6))  # row stride k + 16


def test_zero_rows():
    assert quant_linear(torch.empty(0, 32), pack(_rows(4, 32, "q4_1"))).shape == (0, 4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_zero_blocks_and_tiny_values(fmt):
    x = _randn(3, _k(fmt, 96))
    x[0, 32:64] = 0.0  # dx = 0: that block contributes only its (zero) offset term
    x[1] *= 1e-30  # dx near fp32's smallest normals
    x[2, :32] = 0.0
    _check(x, _rows(2 * LANES + 1, _k(fmt, 96), fmt))


@pytest.mark.parametrize("activations", ["int8", "fp32"])
@pytest.mark.parametrize("m", [1, 3, 70])
def test_fused_rms_norm_quant_linear_equals_the_two_ops_bit_for_bit(activations, m):
    x, residual, norm = _randn(m, 96, seed=7), _randn(m, 96, seed=8), torch.rand(96) + 0.5
    handle = pack(_rows(2 * LANES + 5, 96, "q4_1"), activations)
    y, residual_out = rms_norm_quant_linear(x, norm, 1e-5, residual, handle)
    normed, expected_residual = elementwise.rms_norm(x, norm, 1e-5, residual)
    assert torch.equal(residual_out, expected_residual)
    assert torch.equal(y, quant_linear(normed, handle))


def test_fused_rms_norm_quant_linear_names_bad_arguments():
    handle = pack(_rows(LANES, 64, "q8_0"))
    x = _randn(2, 64)
    with pytest.raises(ValueError, match="residual has shape"):
        rms_norm_quant_linear(x, torch.ones(64), 1e-5, _randn(3, 64), handle)
    with pytest.raises(ValueError, match=r"weight must be a contiguous float32 \[64\]"):
        rms_norm_quant_linear(x, torch.ones(32), 1e-5, x, handle)
    with pytest.raises(ValueError, match="x must be a 2-d float32"):
        rms_norm_quant_linear(x.double(), torch.ones(64), 1e-5, x, handle)


def test_the_mode_comes_from_the_environment_at_pack_time(monkeypatch):
    rows = _rows(LANES, 64, "q4_1")
    monkeypatch.setenv("PDSERVE_CPU_QUANT_ACTIVATIONS", "fp32")
    assert pack(rows).exact
    monkeypatch.delenv("PDSERVE_CPU_QUANT_ACTIVATIONS")
    assert not pack(rows).exact
    monkeypatch.setenv("PDSERVE_CPU_QUANT_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match="PDSERVE_CPU_QUANT_ACTIVATIONS must be one of int8|fp32"):
        pack(rows)
    with pytest.raises(ValueError, match="activations must be one of"):
        pack(rows, "bf16")


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
    with pytest.raises(ValueError, match="q4_k needs in_features a positive multiple of 256"):
        QuantRows("q4_k", np.zeros((2, 144), dtype=np.uint8), 32)
    with pytest.raises(ValueError, match="x has 256 features but the weight expects 512"):
        quant_linear(_randn(2, 256), pack(_rows(20, 512, "q4_k")))


def test_k_quant_layouts():
    """Q4_K's 6-bit scales unpack as llama.cpp's get_scale_min_k4 and Q6_K's bit planes as its
    dequantize_row_q6_K (both through gguf's dequantizer, above); the packed panels hold 148
    bytes per 256 inputs per column for Q4_K (the file's 144, scales a byte each) and Q6_K's
    210 as in the file; fused rows keep their format, and mixing formats is refused."""
    rows = _rows(2 * LANES, 512, "q4_k")
    assert pack(rows).nbytes == 2 * LANES * 2 * 148 and pack(rows).in_features == 512
    six = _rows(LANES + 1, 512, "q6_k")
    assert pack(six).nbytes == 2 * LANES * 2 * 210 and pack(six).in_features == 512
    fused = cat_rows([rows, _rows(3, 512, "q4_k", seed=2)])
    assert fused.format == "q4_k" and fused.out_features == 2 * LANES + 3
    with pytest.raises(ValueError, match="cannot fuse rows"):
        cat_rows([rows, _rows(3, 512, "q4_1")])


@pytest.mark.parametrize("m", [1, 5])
def test_prefetching_the_next_weight_changes_no_result(m):
    from kernels.quant_cpu import _ops

    x, residual, norm = _randn(m, 96, seed=3), _randn(m, 96, seed=4), torch.rand(96) + 0.5
    handle = pack(_rows(3 * LANES + 1, 96, "q4_1"))
    nexts = (pack(_rows(LANES, 64, "q8_0")).panels, pack(_rows(7 * LANES, 96, "q4_1")).panels,
             torch.zeros(0, 3, 320, dtype=torch.uint8))  # tiny, large, empty
    for nxt in nexts:
        y = _ops.quant_linear(x, handle.panels, handle.out_features, handle.format_id, handle.exact, nxt)
        assert torch.equal(y, quant_linear(x, handle))
        fused = _ops.rms_norm_quant_linear(x, residual, norm, 1e-5, handle.panels, handle.out_features,
                                           handle.format_id, handle.exact, nxt)
        assert all(torch.equal(a, b) for a, b in zip(fused, rms_norm_quant_linear(x, norm, 1e-5, residual, handle)))
    with pytest.raises(ValueError, match="prefetch_next must be a contiguous uint8"):
        _ops.quant_linear(x, handle.panels, handle.out_features, handle.format_id, handle.exact, torch.zeros(4, 4))
