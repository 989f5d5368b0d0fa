"""pdserve on one CUDA GPU against HF transformers and the bandwidth bound, in one run.

    python -m loadtests.bench_gpu STAGE [STAGE ...] [--models-dir DIR] [--out DIR]
    stages: env parity speed-smol speed-1b7 profile; models (only builds the bf16 models); tokenizer
    (on a machine with the default model: writes its tokenizer to --tokenizer-dir for the others)
    DRY=1 python -m loadtests.bench_gpu ...   the same on the CPU with 2-layer models (checks the script)

Models: random weights in the exact shapes of SmolLM2-135M and SmolLM2-1.7B, written as HF
directories by transformers with the SmolLM2 tokenizer (``loadtests/gpu/prepare.sh`` exports it
from the default GGUF: a GPU machine has neither the GGUF nor a network), so parity is checked
against HF on the same weights.

- env: the GPU, and its copy bandwidth (bytes read + written per second of a 2 GiB device copy).
- parity: fp32 greedy, 6 prompts of 24 to 1,000 tokens, 24 new tokens: the Triton backend with
  decode graphs and with ``enforce_eager`` against HF; bf16 against pdserve's torch backend;
  ``--weight-format q4`` (the Triton GEMV on 4-bit blocks) against the dense engine serving the
  same blocks dequantized (random weights give near-flat logits: q4 against the original fp32
  weights flips the first token, against its own dequantized values it must not).
- speed-smol / speed-1b7 (bf16, the engine's defaults for CUDA): batch-1 decode tok/s against the
  bound (bf16 weight bytes / copy bandwidth, bytes read + written), prefill tok/s, output
  tok/s of 1/16/64/256 concurrent 128-token prompts x 128 tokens; HF ``generate`` (sdpa) at
  batch 1 and 64 in the same run, each pdserve number printed as a ratio to its baseline; then
  batch 1 and the largest concurrency again with ``async_scheduling='off'`` (``sync_*``,
  ``async_vs_sync_*``: what scheduling one decode step ahead gives, same run), and batch 1 with
  ``PDSERVE_TRITON_GEMV=off`` (``no_gemv_*``, ``gemv_vs_none_b1``: what the fused decode GEMV
  gives; ``gemv`` lists what the engine's timing chose per matmul and row count);
  ``gc_ms_c<N>``: the garbage collector's pauses during that run, [total, longest] ms.
One JSON line per measurement on stdout and in ``<out>/results.jsonl``.

Failures cost only what failed: each engine of a speed stage has its own ``try`` (its traceback
under ``error``, ``sync_error`` or ``no_gemv_error``; the others still measure), and after a
stage that left the device unusable (a sticky fault: every later CUDA call in the process
raises) the stages left run in a fresh process (``device_fault`` row).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from kernels.gemv import GEMV_ENV
from loadtests.bench_gc import CollectorPauses
from loadtests.prompts import distinct_prompts

DRY = os.environ.get("DRY") == "1"
DEVICE = "cpu" if DRY else "cuda"
SHAPES: dict[str, dict[str, Any]] = {
    "smol135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                     max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "smol1b7": dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                    num_attention_heads=32, num_key_value_heads=32, head_dim=64, rope_theta=130000.0,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True),
}
if DRY:
    SHAPES = {k: dict(v, num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32) for k, v in SHAPES.items()}
TEXT = ("The history of computing is a story of ideas, machines and people. Engineers built relays, "
        "then tubes, then transistors; each step made the next possible. ") * 300


class Log:
    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "results.jsonl"

    def __call__(self, **row: Any) -> None:
        row["t"] = round(time.time(), 1)
        line = json.dumps(row)
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def make_model(models_dir: Path, tokenizer_dir: Path, name: str, dtype: torch.dtype, log: Log) -> Path:
    """An HF directory of random weights in the shape ``name`` (built once, on the device)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = models_dir / f"{name}-{str(dtype).removeprefix('torch.')}"
    if (directory / "config.json").exists():
        return directory
    started = time.perf_counter()
    config = LlamaConfig(**SHAPES[name], bos_token_id=1, eos_token_id=2, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config)
    model.to(dtype).save_pretrained(directory, safe_serialization=True)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (directory / file).write_bytes((tokenizer_dir / file).read_bytes())
    log(stage="make_model", name=name, dtype=str(dtype), seconds=round(time.perf_counter() - started, 1))
    return directory


def prompts(tokenizer: Any, length: int, count: int, offset: int = 0) -> list[list[int]]:
    """The parity stage's prompts: slices of TEXT. The speed stages take ``distinct_prompts``
    (TEXT repeats every 31 tokens: 256 slices are 31 distinct prompts, the rest prefix-cache
    hits a real load would not give; the H100 run of 2026-11-26 used these)."""
    base = tokenizer.encode(TEXT)
    return [base[offset + i * 11: offset + i * 11 + length] for i in range(count)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def pdserve(directory: Path, dtype: str, backend: str, **engine_args: Any) -> Any:
    """pdserve's offline engine with the defaults of the device (async scheduling, the default
    on CUDA, also in a dry run, so that its path is checked on the CPU)."""
    from engine import LLM

    os.environ["PDSERVE_ATTENTION_BACKEND"] = backend
    if DRY:
        engine_args.setdefault("async_scheduling", "on")
    return LLM(str(directory), device=DEVICE, dtype=dtype, max_model_len=4096, cpu_offload_gb=0, **engine_args)


def hf(directory: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(DEVICE).eval()


def hf_generate_seconds(model: Any, batch: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(batch, device=DEVICE)
    sync()
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    sync()
    return time.perf_counter() - started


def generate_seconds(llm: Any, batch: list[list[int]], new_tokens: int) -> float:
    from engine import SamplingParams

    sync()
    started = time.perf_counter()
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    sync()
    assert all(len(o.token_ids) == new_tokens for o in outputs)
    return time.perf_counter() - started


def decode_rate(seconds: Any, new_tokens: int, batch: int) -> float:
    """Output tok/s of decode alone: (T(n + 1) - T(1)) removes the prefill and the first token."""
    full = min(seconds(new_tokens + 1) for _ in range(2))
    first = min(seconds(1) for _ in range(2))
    return batch * new_tokens / (full - first)


def stage_env(args: argparse.Namespace, log: Log) -> None:
    import triton

    info: dict[str, Any] = dict(torch=torch.__version__, triton=triton.__version__, device=DEVICE)
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count, mem_gib=round(props.total_memory / 2**30, 1),
                    driver=_driver())
    info["copy_tb_s"] = round(copy_bandwidth() / 1e12, 3)
    log(stage="env", **info)


def _driver() -> str:
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        return repr(error)


def copy_bandwidth() -> float:
    """Bytes read + written per second of a device-to-device copy (2 GiB on CUDA)."""
    size = (2 << 30) if DEVICE == "cuda" else (256 << 20)
    x = torch.empty(size, dtype=torch.uint8, device=DEVICE)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync()
    started = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync()
    return 2 * size * 10 / (time.perf_counter() - started)


def stage_parity(args: argparse.Namespace, log: Log) -> None:
    from engine import SamplingParams
    from engine.models.loader import load_tokenizer

    directory = make_model(args.models_dir, args.tokenizer_dir, "smol135m", torch.float32, log)
    tokenizer = load_tokenizer(str(directory))
    batch = prompts(tokenizer, 24, 3) + prompts(tokenizer, 200, 2, offset=5) + prompts(tokenizer, 1000, 1, offset=3)
    new_tokens = 8 if DRY else 24
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    model = hf(directory, torch.float32)
    reference = [hf_generate_once(model, p, new_tokens) for p in batch]
    del model
    triton = "torch" if DRY else "triton"
    runs = {("float32", triton, False): "fp32 graphs", ("float32", triton, True): "fp32 eager",
            ("bfloat16", triton, False): "bf16 graphs", ("bfloat16", "torch", True): "bf16 torch backend"}
    tokens = {}
    for (dtype, backend, eager), label in runs.items():
        try:
            llm = pdserve(directory, dtype, backend, enforce_eager=eager, num_kv_blocks=512)
            tokens[label] = [o.token_ids for o in llm.generate(batch, greedy)]
            llm.engine.check_integrity()
            del llm
        except Exception:  # noqa: BLE001 - a stage reports its failure and the run goes on
            log(stage="parity", run=label, error=traceback.format_exc()[-3000:])
    q4, dense = q4_against_its_dequantized_weights(directory, batch, greedy)
    log(stage="parity", run="fp32 q4 blocks", versus="dense on the dequantized blocks",
        equal_prefix=[common_prefix(a, b) for a, b in zip(q4, dense)], of=new_tokens)
    for label, outs in tokens.items():
        versus = reference if label.startswith("fp32") else tokens.get("bf16 torch backend", [])
        log(stage="parity", run=label, versus="hf fp32" if label.startswith("fp32") else "bf16 torch backend",
            equal_prefix=[common_prefix(a, b) for a, b in zip(outs, versus)], of=new_tokens,
            prompt_lens=[len(p) for p in batch])
    _free()


def q4_against_its_dequantized_weights(directory: Path, batch: list[list[int]], greedy: Any
                                       ) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of ``--weight-format q4`` and of the dense engine on the q4 plan's values."""
    import dataclasses

    from engine import LLM
    from engine.models.loader import load_model
    from engine.models.quant_weights import plan_quantized
    from kernels.quant import dequantize

    loaded = load_model(str(directory))
    plan = plan_quantized(loaded.config, loaded.weights, loaded.blocks, "q4")
    assert plan is not None
    dequantized = dataclasses.replace(loaded, weights={**loaded.weights, **{n: dequantize(r) for n, r in plan.items()}})
    os.environ["PDSERVE_ATTENTION_BACKEND"] = "torch" if DRY else "triton"
    common = dict(device=DEVICE, dtype="float32", max_model_len=4096, cpu_offload_gb=0, num_kv_blocks=512)
    q4 = [o.token_ids for o in LLM(loaded, weight_format="q4", **common).generate(batch, greedy)]
    dense = [o.token_ids for o in LLM(dequantized, weight_format="fp32", **common).generate(batch, greedy)]
    return q4, dense


def hf_generate_once(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=DEVICE)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return list(out[0, len(prompt):].tolist())


def weight_bytes(name: str) -> int:
    s = SHAPES[name]
    per_layer = (s["hidden_size"] * s["head_dim"] * (2 * s["num_attention_heads"] + 2 * s["num_key_value_heads"])
                 + 3 * s["hidden_size"] * s["intermediate_size"])
    return 2 * (s["vocab_size"] * s["hidden_size"] + s["num_hidden_layers"] * per_layer)  # bf16


def stage_speed(name: str, args: argparse.Namespace, log: Log) -> None:
    from engine.models.loader import load_tokenizer

    directory = make_model(args.models_dir, args.tokenizer_dir, name, torch.bfloat16, log)
    tokenizer = load_tokenizer(str(directory))
    new_tokens = 16 if DRY else 128
    concurrency = (1, 4) if DRY else (1, 16, 64, 256)
    big = concurrency[-1]
    # the bound as the issue states it: bf16 weight bytes over the copy bandwidth (bytes read +
    # written), what one decode step that reads every weight once could reach
    bound = copy_bandwidth() / weight_bytes(name)
    row: dict[str, Any] = dict(stage="speed", model=name, weight_gb=round(weight_bytes(name) / 1e9, 3),
                               bound_b1_tok_s=round(bound, 1))
    one = distinct_prompts(tokenizer, 128, 1, salt=7)

    def start(**engine_args: Any) -> Any:
        llm = pdserve(directory, "bfloat16", "torch" if DRY else "triton", **engine_args)
        generate_seconds(llm, distinct_prompts(tokenizer, 128, 4, salt=999), 8)
        return llm

    def b1_rate(llm: Any) -> float:
        return decode_rate(lambda n: generate_seconds(llm, one, n), new_tokens, 1)

    def defaults() -> None:
        started = time.perf_counter()
        llm = start()
        row["engine_start_s"] = round(time.perf_counter() - started, 1)
        b1 = b1_rate(llm)
        row.update(decode_b1_tok_s=round(b1, 1), b1_vs_bound=round(b1 / bound, 3),
                   num_kv_blocks=llm.engine.runner.num_blocks,
                   graphs=len(llm.engine.runner.decode_graphs.sizes),
                   fused_decode_attention=llm.engine.runner.model.ops.rotary_store_attention is not None,
                   gemv=llm.engine.runner.gemv_choices)
        long = distinct_prompts(tokenizer, 512, 4 if DRY else 16, salt=13)
        row["prefill_tok_s"] = round(sum(map(len, long)) / generate_seconds(llm, long, 1), 1)
        for c in concurrency:
            batch = distinct_prompts(tokenizer, 128, c, salt=17 + c)
            with CollectorPauses().recording() as pauses:
                row[f"out_tok_s_c{c}"] = round(c * new_tokens / generate_seconds(llm, batch, new_tokens), 1)
            gc_summary = pauses.summary()  # the collector's pauses in that run (engine/heap.py)
            row[f"gc_ms_c{c}"] = [gc_summary["total_ms"], gc_summary["longest_ms"]]

    def synchronous() -> None:  # scheduling synchronously: what async scheduling gives, same run
        llm = start(async_scheduling="off")
        row["sync_decode_b1_tok_s"] = round(b1_rate(llm), 1)
        batch = distinct_prompts(tokenizer, 128, big, salt=17 + big)
        row["sync_out_tok_s_c"] = round(big * new_tokens / generate_seconds(llm, batch, new_tokens), 1)

    def without_gemv() -> None:  # without the fused decode GEMV (kernels.gemv), batch 1, same run
        previous = os.environ.get(GEMV_ENV)
        os.environ[GEMV_ENV] = "off"
        try:
            row["no_gemv_decode_b1_tok_s"] = round(b1_rate(start()), 1)
        finally:
            if previous is None:
                os.environ.pop(GEMV_ENV)
            else:
                os.environ[GEMV_ENV] = previous

    # each engine in its own try: one that fails (a feature never run on this device) leaves
    # the others' numbers, and its traceback under its own key
    for label, measure in (("error", defaults), ("sync_error", synchronous), ("no_gemv_error", without_gemv)):
        try:
            measure()
        except Exception:  # noqa: BLE001
            row[label] = traceback.format_exc()[-3000:]
        _free()
    if "decode_b1_tok_s" in row:
        for key, versus in (("async_vs_sync_b1", "sync_decode_b1_tok_s"),
                            ("gemv_vs_none_b1", "no_gemv_decode_b1_tok_s")):
            if versus in row:
                row[key] = round(row["decode_b1_tok_s"] / row[versus], 3)
    if f"out_tok_s_c{big}" in row and "sync_out_tok_s_c" in row:
        row["async_vs_sync_c"] = round(row[f"out_tok_s_c{big}"] / row["sync_out_tok_s_c"], 3)
    try:
        model = hf(directory, torch.bfloat16)
        for b in (1, 4) if DRY else (1, 64):
            batch = distinct_prompts(tokenizer, 128, b, salt=17 + b)
            hf_generate_seconds(model, batch, 2)
            rate = decode_rate(lambda n, batch=batch, model=model: hf_generate_seconds(model, batch, n), new_tokens, b)
            row[f"hf_decode_b{b}_tok_s"] = round(rate, 1)
        del model
    except Exception:  # noqa: BLE001
        row["hf_error"] = traceback.format_exc()[-3000:]
    if "decode_b1_tok_s" in row and "hf_decode_b1_tok_s" in row:
        row["b1_vs_hf"] = round(row["decode_b1_tok_s"] / row["hf_decode_b1_tok_s"], 2)
    hf_big = "hf_decode_b4_tok_s" if DRY else "hf_decode_b64_tok_s"
    if f"out_tok_s_c{big}" in row and hf_big in row:
        row[f"c{big}_vs_hf_{hf_big.split('_')[2]}"] = round(row[f"out_tok_s_c{big}"] / row[hf_big], 2)
    log(**row)
    _free()


def stage_profile(args: argparse.Namespace, log: Log) -> None:
    """torch profiler over decode of both shapes at batch 1 and 64: GPU busy share, kernels
    per token and the top ops (``profile.txt``: the 1.7B shape's, then the 135M shape's)."""
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams
    from engine.models.loader import load_tokenizer

    report = []
    for name in ("smol1b7", "smol135m"):
        directory = make_model(args.models_dir, args.tokenizer_dir, name, torch.bfloat16, log)
        tokenizer = load_tokenizer(str(directory))
        llm = pdserve(directory, "bfloat16", "torch" if DRY else "triton")
        new_tokens = 33
        for batch_size in (1, 64):
            batch = distinct_prompts(tokenizer, 128, batch_size, salt=7)
            params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
            llm.generate(batch, params)
            sync()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
            with profile(activities=activities) as prof:
                started = time.perf_counter()
                llm.generate(batch, params)
                sync()
                wall = time.perf_counter() - started
            events = prof.key_averages()
            busy_us = sum(e.self_device_time_total for e in events)
            kernels = sum(e.count for e in events if e.self_device_time_total > 0)
            log(stage="profile", model=name, batch=batch_size, wall_ms=round(wall * 1e3, 1),
                gpu_busy_ms=round(busy_us / 1e3, 1), busy_share=round(busy_us / 1e6 / wall, 3),
                kernels_per_token=round(kernels / new_tokens, 1))
            report.append(f"## {name}, batch {batch_size}: wall {wall * 1e3:.1f} ms for {new_tokens} tokens\n")
            report.append(events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=70))
            report.append(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
        del llm
        _free()
    (args.out / "profile.txt").write_text("\n".join(report))
    if DEVICE == "cuda":  # what fusing rotary + KV store into decode attention gives, same run
        from kernels.bench import decode_fusion

        for row in decode_fusion():
            log(stage="profile", decode_fusion=row)


def _free() -> None:
    """Give the last engine's memory back (its KV cache takes most of the GPU) before the next.
    After a device fault every CUDA call raises: that fault is already in the stage's row."""
    gc.collect()
    if DEVICE == "cuda":
        try:
            torch.cuda.empty_cache()
        except RuntimeError as error:
            print(f"empty_cache: {error}", flush=True)


def stage_tokenizer(args: argparse.Namespace, log: Log) -> None:
    from engine.models.loader import load_tokenizer

    load_tokenizer().save_hf(args.tokenizer_dir)
    log(stage="tokenizer", wrote=str(args.tokenizer_dir))


def stage_models(args: argparse.Namespace, log: Log) -> None:
    """The bf16 models of both shapes, built where missing (what the served runs load)."""
    for name in SHAPES:
        log(stage="models", model=str(make_model(args.models_dir, args.tokenizer_dir, name, torch.bfloat16, log)))


STAGES = {"tokenizer": stage_tokenizer, "models": stage_models, "env": stage_env, "parity": stage_parity,
          "speed-smol": lambda a, log: stage_speed("smol135m", a, log),
          "speed-1b7": lambda a, log: stage_speed("smol1b7", a, log), "profile": stage_profile}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stages", nargs="+", choices=sorted(STAGES))
    parser.add_argument("--models-dir", type=Path, default=Path(os.environ.get("MODELS_DIR", "/tmp/pdserve-models")))
    parser.add_argument("--tokenizer-dir", type=Path, default=Path(".gpu/model"),
                        help="tokenizer.json + tokenizer_config.json (loadtests/gpu/prepare.sh)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-results/gpu")))
    args = parser.parse_args(argv)
    log = Log(args.out)
    for i, stage in enumerate(args.stages):
        started = time.perf_counter()
        try:
            STAGES[stage](args, log)
        except Exception:  # noqa: BLE001
            log(stage=stage, error=traceback.format_exc()[-3000:])
        log(stage=stage, done=True, seconds=round(time.perf_counter() - started, 1))
        rest = args.stages[i + 1:]
        if rest and not device_usable():
            # a device fault (an illegal address, say) is sticky: every later CUDA call in this
            # process raises it. The stages left run in a fresh process, with a fresh context.
            log(stage=stage, device_fault=True, rerun_in_new_process=rest)
            sys.stdout.flush()
            os.execv(sys.executable, [sys.executable, "-m", "loadtests.bench_gpu", *rest,
                                      "--models-dir", str(args.models_dir), "--tokenizer-dir",
                                      str(args.tokenizer_dir), "--out", str(args.out)])


def device_usable() -> bool:
    """Whether this process can still run work on the device (False after a sticky fault)."""
    if DEVICE != "cuda":
        return True
    try:
        return bool(torch.ones(1, device=DEVICE).add_(1).item() == 2)
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return False


if __name__ == "__main__":
    main()
