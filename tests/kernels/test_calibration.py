"""The measured choice between compiled CPU kernels and torch's ops (kernels.calibration):
dispatch by size class, the cache and its key, the off switch, and that a mixed op table
computes what the references compute whichever implementation serves a class."""

from __future__ import annotations

import pytest
import torch

from kernels import calibration as cal
from kernels.calibration_workloads import attention_workload
from kernels.cpu import CpuKernelsUnavailable, available

if not available():
    pytest.skip("compiled CPU kernels unavailable", allow_module_level=True)

TINY = cal.ModelDims(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16)


def _table(winner_of) -> cal.Calibration:
    """A table whose winner per (op, class index) is ``winner_of(op, index)``."""
    choices = []
    for op, classes in cal.SIZE_CLASSES.items():
        for index, (bound, size) in enumerate(classes):
            loser = {"cpu": "torch", "torch": "cpu"}[winner_of(op, index)]
            choices.append(cal.Choice(op, bound, size, {winner_of(op, index): 1.0, loser: 2.0}))
    return cal.Calibration("test", "test cpu", "native", 1, tuple(choices))


def test_dispatch_picks_the_class_by_upper_bound():
    calls = []
    small, large = (lambda *a: calls.append(("small", a[0]))), (lambda *a: calls.append(("large", a[0])))
    dispatch = cal._by_size([(4, small), (float("inf"), large)], lambda args: args[0])
    for size in (1, 4, 5, 1000):
        dispatch(size)
    assert calls == [("small", 1), ("small", 4), ("large", 5), ("large", 1000)]


def test_one_implementation_everywhere_means_no_dispatch():
    impl = lambda x: x  # noqa: E731
    assert cal._by_size([(1, impl), (float("inf"), impl)], len) is impl


def test_table_round_trips_through_json_and_names_the_winners():
    table = _table(lambda op, i: "cpu" if i % 2 == 0 else "torch")
    again = cal.Calibration.from_json(table.to_json())
    assert again == table
    assert again.impls("linear")[:3] == [(1, "cpu"), (4, "torch"), (8, "cpu")]
    assert again.impls("linear")[-1][0] == float("inf")


@pytest.mark.parametrize("linear_split", [0, 3, 7])  # classes served by the compiled matmul
def test_mixed_table_computes_what_the_references_compute(linear_split):
    from kernels.ops import get_ops

    table = _table(lambda op, i: ("cpu" if i < linear_split else "torch") if op == "linear"
                   else ("cpu" if i % 2 else "torch"))
    ops, ref = cal.measured_ops(table), get_ops("torch")
    w_t = torch.randn(64, 40)
    weight = ops.pack_linear(w_t)
    assert (weight.packed is not None) == (linear_split > 0)
    assert (weight.plain is not None) == (linear_split < 7)
    for rows in (1, 4, 5, 16, 17, 300):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(ops.linear(x, weight), x @ w_t, atol=1e-4, rtol=1e-4)
    for rows in (3, 40, 300):
        x, residual, norm = torch.randn(rows, 64), torch.randn(rows, 64), torch.rand(64)
        for got, want in zip(ops.rms_norm(x, norm, 1e-5, residual), ref.rms_norm(x, norm, 1e-5, residual)):
            torch.testing.assert_close(got, want)
        gate_up = torch.randn(rows, 2 * 96)
        torch.testing.assert_close(ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))
    for q_len in (1, 5, 100, 600):  # a class each
        def run(o, q_len=q_len):
            return attention_workload(q_len, 4, 2, 16, o)()
        torch.manual_seed(q_len)
        got = run(ops)
        torch.manual_seed(q_len)
        torch.testing.assert_close(got, run(ref), atol=1e-4, rtol=1e-4)


def test_calibrate_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(cal.CALIBRATION_ENV, raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        table = cal.calibrate(TINY)
        assert {c.op for c in table.choices} == set(cal.SIZE_CLASSES)
        assert all(set(c.seconds) == {"cpu", "torch"} and min(c.seconds.values()) > 0 for c in table.choices)
        assert table.num_threads == 1 and table.cpu
        cached = list((tmp_path / "calibration").glob("*.json"))
        assert [p.stem for p in cached] == [table.key]

        def no_measuring(dims):
            raise AssertionError("measured again although a table was cached")
        monkeypatch.setattr(cal, "_measure_all", no_measuring)
        assert cal.calibrate(TINY) == table
        torch.set_num_threads(2)  # another thread count is another table
        with pytest.raises(AssertionError, match="measured again"):
            cal.calibrate(TINY)
    finally:
        torch.set_num_threads(before)


def test_off_switch_uses_the_compiled_kernels_and_measures_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(cal.CALIBRATION_ENV, "off")
    table = cal.calibrate(TINY)
    assert {impl for op in cal.SIZE_CLASSES for _, impl in table.impls(op)} == {"cpu"}
    assert not (tmp_path / "calibration").exists() or not list((tmp_path / "calibration").iterdir())


def test_format_table_shows_both_timings_and_the_choice():
    text = cal.format_table(_table(lambda op, i: "torch" if op == "linear" and i > 3 else "cpu"))
    rows = [line.split() for line in text.splitlines()[2:]]
    linear = [r for r in rows if r[0] == "linear"]
    assert [r[1] for r in linear] == ["1..1", "2..4", "5..8", "9..16", "17..64", "65..256", ">=257"]
    assert [r[-1] for r in linear] == ["cpu"] * 4 + ["torch"] * 3
    assert linear[0][3:6] == ["1000.000", "2000.000", "2.00x"]


def test_unknown_isa_is_refused(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_ISA", "sse9")
    from kernels import cpu
    with pytest.raises(ValueError, match="PDSERVE_CPU_ISA must be one of"):
        cpu.default_isa()
    with pytest.raises((ValueError, CpuKernelsUnavailable)):
        cpu.library("linear", "sse9")


def test_the_layer_stack_serves_only_steps_whose_every_op_is_compiled():
    import sys

    # quant_linear compiled everywhere; attention compiled up to its 128-row class, rms_norm
    # everywhere, the others up to their 256-row class: the stack takes steps of <= 128 tokens
    small_ops = {"rotary", "store_kv", "silu_and_mul"}
    table = _table(lambda op, i: "cpu" if op in ("quant_linear", "rms_norm") or (op == "paged_attention" and i < 3)
                   or (op in small_ops and i < 2) else "torch")
    assert cal.compiled_up_to(table, "paged_attention") == 128
    assert cal.compiled_up_to(table, "quant_linear") == sys.maxsize
    assert cal.compiled_up_to(table, "rms_norm") == sys.maxsize
    ops = cal.measured_ops(table)
    assert ops.decoder_stack is not None and ops.stack_max_tokens == 128
    # torch's attention even at batch-1 decode: no stack
    table = _table(lambda op, i: "torch" if op == "paged_attention" and i == 0 else "cpu")
    assert cal.measured_ops(table).decoder_stack is None


def test_torch_serving_large_quantized_matmuls_still_leaves_decode_steps_to_the_stack(loaded_model):
    import dataclasses

    from engine.models.llama import LlamaForCausalLM
    from engine.models.quant_weights import plan_quantized

    # quant_linear compiled up to its 64-row class, torch.mm on the dequantized weight above
    table = _table(lambda op, i: "torch" if op == "quant_linear" and i >= 5 else "cpu")
    ops = cal.measured_ops(table)
    assert ops.stack_max_tokens == 64 and ops.decoder_stack is not None
    config = dataclasses.replace(loaded_model.config, num_layers=1)
    weights = {n: w for n, w in loaded_model.weights.items() if not n.startswith("model.layers.")
               or n.startswith("model.layers.0.")}
    plan = plan_quantized(config, weights, loaded_model.blocks, "q4")
    model = LlamaForCausalLM(config, weights, ops, quant_plan=plan)
    assert isinstance(model.layers[0].qkv_weight, cal.DualWeight) and model.stack is not None
