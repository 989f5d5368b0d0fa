"""rms_norm, silu_and_mul and rotary: Triton against the reference, and the references against
the textbook formulas (HF's rotate_half, HF's RoPE frequency initialisers)."""

from __future__ import annotations

import pytest
import torch

from engine.config import RopeScaling
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.rms_norm import rms_norm, rms_norm_ref
from kernels.rotary import build_cos_sin_cache, rotary, rotary_ref
from tests.kernels.helpers import DEVICE, assert_close, requires_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def test_rms_norm_reference_formula():
    x, w = _randn(5, 48), _randn(48, seed=1)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert_close(rms_norm_ref(x, w, 1e-6), expected, torch.float32)
    r = _randn(5, 48, seed=2)
    out, residual_out = rms_norm_ref(x, w, 1e-6, residual=r)
    assert_close(residual_out, x + r, torch.float32)
    assert_close(out, rms_norm_ref(x + r, w, 1e-6), torch.float32)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100])
def test_rms_norm_triton(dtype, hidden):
    x, r, w = _randn(7, hidden, dtype=dtype), _randn(7, hidden, dtype=dtype, seed=1), _randn(hidden, seed=2)
    assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), dtype)
    out, res = rms_norm(x, w, 1e-5, residual=r)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-5, residual=r)
    assert out.dtype == res.dtype == dtype
    assert_close(out, ref_out, dtype)
    assert_close(res, ref_res, dtype)


def test_silu_and_mul_reference_formula():
    x = _randn(4, 20)
    assert_close(silu_and_mul_ref(x), x[:, :10] * torch.sigmoid(x[:, :10]) * x[:, 10:], torch.float32)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_triton(dtype):
    x = _randn(6, 2 * 50, dtype=dtype)
    out = silu_and_mul(x)
    assert out.shape == (6, 50) and out.dtype == dtype
    assert_close(out, silu_and_mul_ref(x), dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def test_rotary_reference_matches_hf_rotate_half():
    head_dim = 16
    cache = build_cos_sin_cache(head_dim, 64, 10000.0).to(DEVICE)
    q, k = _randn(5, 4, head_dim), _randn(5, 2, head_dim, seed=1)
    positions = torch.tensor([0, 1, 7, 63, 7], device=DEVICE)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    emb = torch.cat([torch.outer(positions.cpu().float(), inv_freq)] * 2, dim=-1).to(DEVICE)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    expected_q, expected_k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    rotary_ref(q, k, positions, cache)
    assert_close(q, expected_q, torch.float32)
    assert_close(k, expected_k, torch.float32)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_triton_in_place_on_qkv_views(dtype):
    # q and k as the model slices them out of one fused projection: strided views, in place
    num_heads, num_kv_heads, head_dim = 6, 2, 32
    cache = build_cos_sin_cache(head_dim, 128, 10000.0).to(DEVICE)
    qkv = _randn(9, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    expected = qkv.clone()
    positions = torch.tensor([0, 5, 127, 3, 3, 64, 1, 2, 90], device=DEVICE)

    def views(t):
        q = t[:, : num_heads * head_dim].view(9, num_heads, head_dim)
        k = t[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(9, num_kv_heads, head_dim)
        return q, k

    rotary(*views(qkv), positions, cache)
    rotary_ref(*views(expected), positions, cache)
    assert_close(qkv, expected, dtype)  # includes v, which neither may touch


def _hf_inv_freq(rope_type: str, head_dim: int, base: float, scaling: dict) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = transformers.LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, rope_theta=base,
                                      max_position_embeddings=4096,
                                      rope_scaling={"rope_type": rope_type, **scaling} if scaling else None)
    if rope_type == "default":
        return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")[0]


SCALINGS = {
    "none": (None, "default", {}),
    "linear": (RopeScaling("linear", factor=4.0), "linear", {"factor": 4.0}),
    "llama3": (RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=1024),
               "llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 1024}),
}


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_build_cos_sin_cache_matches_hf(kind):
    # HF folds linear scaling into inv_freq (inv_freq / factor); we divide positions instead:
    # the same products, and exactly so for a power-of-two factor.
    scaling, hf_type, hf_args = SCALINGS[kind]
    head_dim, base, max_pos = 64, 500000.0, 4096
    hf_inv = _hf_inv_freq(hf_type, head_dim, base, hf_args)
    cache = build_cos_sin_cache(head_dim, max_pos, base, scaling)
    freqs = torch.outer(torch.arange(max_pos).float(), hf_inv)
    assert cache.shape == (max_pos, head_dim) and cache.dtype == torch.float32
    torch.testing.assert_close(cache, torch.cat([freqs.cos(), freqs.sin()], dim=-1))


def test_build_cos_sin_cache_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="rope_scaling.kind"):
        build_cos_sin_cache(64, 16, 10000.0, RopeScaling("yarn", factor=2.0))
    with pytest.raises(ValueError, match="head_dim"):
        build_cos_sin_cache(63, 16, 10000.0)
