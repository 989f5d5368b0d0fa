"""The decode GEMV (kernels/gemv.py): each prologue against the separate ops it replaces, at
every row bucket, shapes that leave partial tiles, fp32 and bf16; the residual it writes; the
calls it leaves to the separate ops; its argument checks; the model with every decode matmul
fused against the torch ops; and, on CUDA, the timed choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.llama import LlamaForCausalLM
from engine.runner.inputs import ScheduledSeq, build_model_input
from kernels import gemv
from kernels.activation import silu_and_mul
from kernels.ops import get_ops
from kernels.rms_norm import rms_norm
from tests.kernels.helpers import DEVICE, requires_triton

pytestmark = requires_triton

EPS = 1e-6


def _weight(n: int, k: int, dtype: torch.dtype, config: gemv.GemvConfig | None, gen: torch.Generator,
            ) -> gemv.DenseWeight:
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype=dtype, device=DEVICE)
    weight = gemv.pack_linear(w.t())
    if config is not None:
        weight.configs = {(p, b): config for p in (gemv.NONE, gemv.RMS_NORM, gemv.SILU_MUL)
                          for b in gemv.ROW_BUCKETS}
    return weight


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # fp32: the sum order differs from the BLAS; bf16: and the output's rounding (1/256 of it)
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 8])
@pytest.mark.parametrize("config", [gemv.GemvConfig(16, 128), gemv.GemvConfig(4, 512)], ids=["16x128", "4x512"])
def test_each_prologue_matches_the_separate_ops(dtype, num_rows, config):
    # 37 outputs and 600 inputs: a partial tile of outputs in the last program, of inputs in the
    # last step of every program
    gen = torch.Generator().manual_seed(num_rows)
    n, k = 37, 600
    fused = _weight(n, k, dtype, config, gen)
    plain = gemv.DenseWeight(fused.w)  # no configs: the separate ops
    x, residual = _randn(num_rows, k, dtype=dtype, gen=gen), _randn(num_rows, k, dtype=dtype, gen=gen)
    norm = 1 + _randn(k, dtype=dtype, gen=gen) / 4

    _close(gemv.linear(x, fused), F.linear(x.float(), fused.w.float()), dtype)
    assert torch.equal(gemv.linear(x, plain), F.linear(x, plain.w))

    out, residual_out = gemv.norm_linear(x, norm, EPS, residual, fused)
    normed, expected_residual = rms_norm(x, norm, EPS, residual)
    _close(out, F.linear(normed.float(), fused.w.float()), dtype)
    assert torch.equal(residual_out, expected_residual)  # the same rounding as the norm kernel's
    out, same = gemv.norm_linear(x, norm, EPS, None, fused)
    assert same is x
    _close(out, F.linear(rms_norm(x, norm, EPS).float(), fused.w.float()), dtype)

    gate_up = _randn(num_rows, 2 * k, dtype=dtype, gen=gen)
    _close(gemv.silu_and_mul_linear(gate_up, fused), F.linear(silu_and_mul(gate_up).float(), fused.w.float()),
           dtype)


def test_more_rows_than_the_kernel_takes_go_to_the_separate_ops():
    gen = torch.Generator().manual_seed(1)
    weight = _weight(24, 40, torch.float32, gemv.DEFAULT_CONFIG, gen)
    x = _randn(gemv.MAX_ROWS + 1, 40, dtype=torch.float32, gen=gen)
    assert weight.config(gemv.NONE, gemv.MAX_ROWS + 1) is None
    assert weight.config(gemv.NONE, 0) is None and weight.config(gemv.NONE, 5) == gemv.DEFAULT_CONFIG
    assert torch.equal(gemv.linear(x, weight), F.linear(x, weight.w))
    norm = torch.ones(40, device=DEVICE)
    out, residual = gemv.norm_linear(x, norm, EPS, x, weight)
    normed, expected = rms_norm(x, norm, EPS, x)
    assert torch.equal(out, F.linear(normed, weight.w)) and torch.equal(residual, expected)
    assert gemv.linear(x[:0], weight).shape == (0, 24)


def test_pack_linear_keeps_the_linear_layout_and_the_mode(monkeypatch):
    w = torch.randn(6, 4, device=DEVICE)
    monkeypatch.setenv(gemv.GEMV_ENV, "auto")
    weight = gemv.pack_linear(w.t())
    assert weight.w.data_ptr() == w.data_ptr() and (weight.out_features, weight.in_features) == (6, 4)
    assert weight.configs == {}  # nothing fused until measured (gemv.choose)
    monkeypatch.setenv(gemv.GEMV_ENV, "on")
    assert gemv.pack_linear(w.t()).config(gemv.SILU_MUL, 3) == gemv.DEFAULT_CONFIG
    monkeypatch.setenv(gemv.GEMV_ENV, "off")
    assert gemv.pack_linear(w.t()).configs == {}
    monkeypatch.setenv(gemv.GEMV_ENV, "fast")
    with pytest.raises(ValueError, match=gemv.GEMV_ENV):
        gemv.pack_linear(w.t())


def test_bad_arguments_name_what_is_wrong():
    gen = torch.Generator().manual_seed(2)
    weight = _weight(8, 16, torch.float32, gemv.DEFAULT_CONFIG, gen)
    with pytest.raises(ValueError, match="x has 12 features but the weight expects 16"):
        gemv.linear(torch.zeros(1, 12, device=DEVICE), weight)
    with pytest.raises(ValueError, match="x must have the weight's dtype"):
        gemv.linear(torch.zeros(1, 16, device=DEVICE, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="x has 16 features but the weight expects 32"):
        gemv.silu_and_mul_linear(torch.zeros(1, 16, device=DEVICE), weight)
    with pytest.raises(ValueError, match="residual must have shape"):
        gemv.norm_linear(torch.zeros(2, 16, device=DEVICE), torch.ones(16, device=DEVICE), EPS,
                         torch.zeros(1, 16, device=DEVICE), weight)


def test_a_model_with_every_decode_matmul_fused_matches_the_torch_ops(monkeypatch):
    from engine.config import CacheConfig
    from engine.kv_cache.storage import allocate_kv_cache
    from tests.unit.test_cuda_graphs import BLOCK_SIZE, CONFIG, random_weights

    weights = random_weights(CONFIG, seed=3)
    monkeypatch.setenv(gemv.GEMV_ENV, "on")
    fused = LlamaForCausalLM(CONFIG, weights, get_ops("triton"), DEVICE)
    assert isinstance(fused.layers[0].down_weight, gemv.DenseWeight) and fused.silu_and_mul_linear is not None
    reference = LlamaForCausalLM(CONFIG, weights, get_ops("torch"), DEVICE)
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=16)
    caches = [allocate_kv_cache(CONFIG, cache, DEVICE) for _ in range(2)]
    tables = [[0, 1], [2], [3, 4, 5]]
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    steps = [[ScheduledSeq(p, 0, t) for p, t in zip(prompts, tables)],  # a prefill: the separate ops
             [ScheduledSeq([21], 5, tables[0]), ScheduledSeq([22], 2, tables[1]), ScheduledSeq([23], 9, tables[2])],
             [ScheduledSeq([24], 6, tables[0])]]
    for seqs in steps:
        logits = []
        for model, kv_cache in zip((fused, reference), caches):
            batch = build_model_input(seqs, BLOCK_SIZE, kv_cache.device)
            hidden = model.forward(batch.input_ids, batch.positions, batch.attn, kv_cache)
            logits.append(model.compute_logits(hidden))
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
        assert logits[0].argmax(-1).tolist() == logits[1].argmax(-1).tolist()


def test_choose_times_every_candidate_and_keeps_the_fastest():
    # on CUDA as graphs over copies that stream from HBM; on a CPU (the interpreter) eagerly,
    # which checks what is kept, not which is faster
    gen = torch.Generator().manual_seed(4)
    n, k = (512, 256) if DEVICE.type == "cuda" else (24, 32)
    weights = [_weight(n, k, torch.float32, None, gen) for _ in range(3)]
    weights[0].configs[(gemv.NONE, 1)] = gemv.DEFAULT_CONFIG  # another prologue's choice stays
    choices = gemv.choose(weights, gemv.RMS_NORM, rows=(1, 3))
    assert [c.num_rows for c in choices] == [1, 3]
    for choice in choices:
        bucket = gemv.row_bucket(choice.num_rows)
        assert set(choice.seconds) == {"unfused"} | {f"{c.block_n}x{c.block_k}/{c.num_warps}"
                                                    for c in gemv.CANDIDATES[bucket]}
        assert all(seconds > 0 for seconds in choice.seconds.values())
        fastest = min(choice.seconds, key=lambda name: choice.seconds[name])
        assert (choice.config is None) == (fastest == "unfused")
        assert all(w.config(gemv.RMS_NORM, choice.num_rows) == choice.config for w in weights)
    assert weights[0].config(gemv.NONE, 1) == gemv.DEFAULT_CONFIG


def test_a_process_times_a_shape_once(monkeypatch):
    monkeypatch.setattr(gemv, "_CHOSEN", {})
    monkeypatch.setattr(gemv, "ROUNDS", 1)
    timed = []
    seconds = gemv._seconds
    monkeypatch.setattr(gemv, "_seconds", lambda *args: (timed.append(1), seconds(*args))[1])
    gen = torch.Generator().manual_seed(6)
    first = [_weight(16, 32, torch.float32, None, gen) for _ in range(2)]
    choices = gemv.choose(first, gemv.SILU_MUL, rows=(1,))
    assert len(timed) == 1 + len(gemv.CANDIDATES[1])
    again = [_weight(16, 32, torch.float32, None, gen) for _ in range(3)]  # another engine, same shape
    assert gemv.choose(again, gemv.SILU_MUL, rows=(1,)) == choices
    assert len(timed) == 1 + len(gemv.CANDIDATES[1])  # nothing timed again
    assert all(w.config(gemv.SILU_MUL, 1) == choices[0].config for w in again)
    gemv.choose([_weight(16, 48, torch.float32, None, gen)], gemv.SILU_MUL, rows=(1,))
    assert len(timed) == 2 * (1 + len(gemv.CANDIDATES[1]))  # another shape is timed


def test_the_engine_times_each_decode_matmul_and_survives_a_failure(monkeypatch):
    from engine.runner.warmup import choose_decode_matmuls
    from tests.unit.test_cuda_graphs import CONFIG, random_weights

    monkeypatch.setenv(gemv.GEMV_ENV, "off")
    model = LlamaForCausalLM(CONFIG, random_weights(CONFIG, seed=5), get_ops("triton"), DEVICE)
    monkeypatch.setattr(gemv, "ROUNDS", 1)  # one round, one row count: the interpreter is slow
    lines = choose_decode_matmuls(model, rows=(1,))
    assert [line.split(" rows")[0] for line in lines] == ["qkv", "o", "gate_up", "down", "lm_head"]
    names = ["unfused"] + [f"{c.block_n}x{c.block_k}/{c.num_warps}" for c in gemv.CANDIDATES[1]]
    assert all(" rows 1: " in line and all(f"{name} " in line for name in names) for line in lines)
    # what each line says was picked is what its weights now take
    picked = {line.split(" rows")[0]: line.split(": ")[1].split(" ")[0] for line in lines}
    down = model.layers[1].down_weight.config(gemv.SILU_MUL, 1)
    assert picked["down"] == ("unfused" if down is None else f"{down.block_n}x{down.block_k}")

    def fails(*args, **kwargs):
        raise RuntimeError("no kernel for you")

    model.layers[0].down_weight.configs[(gemv.SILU_MUL, 1)] = gemv.DEFAULT_CONFIG
    monkeypatch.setattr(gemv, "choose", fails)
    assert choose_decode_matmuls(model, rows=(1,)) == ["failed: every matmul takes the separate ops (see the log)"]
    assert all(not w.configs for layer in model.layers
               for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight))
    torch_model = LlamaForCausalLM(CONFIG, random_weights(CONFIG), get_ops("torch"), DEVICE)
    assert choose_decode_matmuls(torch_model) == []  # plain tensors: nothing to choose


def test_the_timed_weights_fill_the_bytes_asked_up_to_a_count():
    w = gemv.DenseWeight(torch.zeros(4, 8, device=DEVICE))  # 128 bytes
    streamed = gemv._streamed([w], 1000)
    assert len(streamed) == 8 and streamed[0].w is w.w and streamed[1].w is not w.w
    assert len(gemv._streamed([w], 1 << 30)) == gemv.MAX_STREAMED  # not 8 million graph launches
