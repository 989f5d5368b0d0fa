"""Quantized weights: accuracy against fp32, and batch-1 decode speed against each format's
streaming-read bound, fp32 vs q8_0 vs q4 in the same run.

    python -m loadtests.bench_quant [--model PATH] [--formats fp32,q8_0,q4] [--decode-tokens 32]
                                    [--llama-bench PATH]

Accuracy, on ``EVAL_TEXTS`` (a fixed text set in this file: prose, code, a list, a dialogue),
teacher-forced through the model's forward: the perplexity of each format, its ratio to fp32's,
and the top-1 agreement (the fraction of positions whose argmax equals fp32's); then greedy
agreement on ``GREEDY_PROMPTS``: the fraction of fp32's 32 greedy tokens each format reproduces
before its first difference. Speed: batch-1 decode tokens/s as (time for N+1 tokens - time for
1) / N, best of ``--repeats`` rounds that interleave the formats (drift hits all alike), next to
the streaming-read bound: the bytes one decode step reads (the model's ``weight_bytes``) over
the machine's streaming-read bandwidth measured in the same run. With ``--llama-bench`` (a
llama.cpp build: ``make peers-llama``), llama.cpp's ``llama-bench`` decodes the same GGUF file
with as many threads, once per round between the formats, and its best rate joins the table.
With ``--breakdown``, where one batch-1 decode step of each format goes: the model's forward
(layers and final norm), the LM head, and the engine's step around them (scheduler, input
building, sampler, detokenizer) as the measured step minus the forward and the head; and, for
scale, the layer matmuls alone as separate calls on the model's packed weights (the decoder
stack's team path makes them in fewer parallel regions, so they can take longer alone than the
whole forward).
Prints the CPU, its SIMD flags, the thread count and the load average (the machine may be shared).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import time

import torch

from engine import LLM, SamplingParams
from engine.mathutils import cdiv
from engine.models.default_model import default_model_path
from engine.models.loader import load_model
from engine.runner.inputs import ScheduledSeq, build_model_input
from kernels.timing import best_seconds
from loadtests.bench_engine import memcpy_bandwidth, torch_threads

EVAL_TEXTS = (
    ("The river rises in the hills above the town and runs south through a narrow valley of "
     "oak and beech. In spring the water is high and brown with mud from the fields; by late "
     "summer it is clear enough to see the stones on the bottom, and children wade across at the "
     "ford below the old mill. The mill itself stopped grinding grain in 1921. Its wheel was sold "
     "for scrap during the war, and the building became first a store for farm machinery and then, "
     "much later, a small museum of local history that opens on Saturday afternoons."),
    ("def merge_sorted(left, right):\n"
     "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
     "    result = []\n"
     "    i = j = 0\n"
     "    while i < len(left) and j < len(right):\n"
     "        if left[i] <= right[j]:\n"
     "            result.append(left[i])\n"
     "            i += 1\n"
     "        else:\n"
     "            result.append(right[j])\n"
     "            j += 1\n"
     "    result.extend(left[i:])\n"
     "    result.extend(right[j:])\n"
     "    return result\n"),
    ("Photosynthesis is the process by which green plants use light energy to turn carbon dioxide "
     "and water into glucose and oxygen. It takes place mainly in the leaves, inside small bodies "
     "called chloroplasts, which contain the green pigment chlorophyll. The oxygen released is the "
     "source of almost all the oxygen in the air we breathe."),
    ("Shopping list for the weekend: two loaves of bread, a dozen eggs, milk, butter, three "
     "onions, a bag of carrots, rice, olive oil, coffee, and something for dessert."),
    ("\"Are you coming to the station?\" she asked.\n\"Only if the rain stops,\" he said. "
     "\"The last train leaves at ten, and I do not want to stand on the platform for an hour.\"\n"
     "\"Then bring an umbrella. It will not stop tonight.\""),
    ("The first law of thermodynamics states that energy cannot be created or destroyed, only "
     "changed from one form into another. The second law says that the entropy of an isolated "
     "system never decreases over time."),
)
GREEDY_PROMPTS = (
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.", "List three uses of a paperclip.",
    "How do I reverse a list in Python?", "Who wrote Romeo and Juliet?",
)
GREEDY_TOKENS = 32


def teacher_forced(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Log-probabilities [len(ids) - 1, vocab] of each next token given the ones before."""
    runner = llm.engine.runner
    num_blocks = cdiv(len(ids), runner.block_size)
    model_input = build_model_input([ScheduledSeq(ids, 0, list(range(num_blocks)), num_logits=len(ids))],
                                    runner.block_size)
    hidden = runner.model.forward(model_input.input_ids, model_input.positions, model_input.attn,
                                  runner.kv_cache)
    logits = runner.model.compute_logits(hidden[model_input.logits_indices])
    return torch.log_softmax(logits[:-1].double(), dim=-1)


def accuracy(llms: dict[str, LLM], tokenizer) -> None:
    texts = [tokenizer.encode(text) for text in EVAL_TEXTS]
    chats = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in GREEDY_PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    reference: dict[str, tuple[list[torch.Tensor], list[list[int]]]] = {}
    print(f"accuracy on {len(texts)} texts ({sum(len(t) - 1 for t in texts)} predicted tokens) and "
          f"{len(chats)} greedy prompts x {GREEDY_TOKENS} tokens")
    print(f"{'format':<8}{'perplexity':>12}{'vs fp32':>10}{'top-1 agree':>13}{'greedy agree':>14}")
    for name, llm in llms.items():
        logprobs = [teacher_forced(llm, ids) for ids in texts]
        outputs = [out.token_ids for out in llm.generate(chats, greedy)]
        reference.setdefault("first", (logprobs, outputs))
        ref_logprobs, ref_outputs = reference["first"]
        nll = sum(-lp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item() for lp, ids in zip(logprobs, texts))
        ppl = math.exp(nll / sum(len(ids) - 1 for ids in texts))
        ref_nll = sum(-lp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
                      for lp, ids in zip(ref_logprobs, texts))
        ref_ppl = math.exp(ref_nll / sum(len(ids) - 1 for ids in texts))
        same = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(logprobs, ref_logprobs))
        top1 = same / sum(len(ids) - 1 for ids in texts)
        agree = sum(_prefix(a, b) for a, b in zip(outputs, ref_outputs)) / sum(len(b) for b in ref_outputs)
        print(f"{name:<8}{ppl:>12.4f}{ppl / ref_ppl:>10.4f}{top1:>13.4f}{agree:>14.4f}")


def _prefix(ours: list[int], reference: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))


def step_breakdown(llm: LLM, step_seconds: float, context: int = 48, repeats: int = 30) -> str:
    """One line: a batch-1 decode step's ``step_seconds`` split into the forward, the LM head and
    the engine around them, and the layer matmuls alone as separate calls (best of ``repeats``
    each, ms)."""
    runner = llm.engine.runner
    model = runner.model
    cfg = model.config
    blocks = list(range(cdiv(context + 1, runner.block_size)))
    model_input = build_model_input([ScheduledSeq([1], context, blocks)], runner.block_size)

    forward = best_seconds(lambda: model.forward(model_input.input_ids, model_input.positions, model_input.attn,
                                                 runner.kv_cache), repeats, warmup=1)
    hidden = torch.randn(1, cfg.hidden_size)
    head = best_seconds(lambda: model.compute_logits(hidden), repeats, warmup=1)
    inter = torch.randn(1, cfg.intermediate_size)
    attn_out = torch.randn(1, cfg.num_heads * cfg.head_dim)

    def layer_matmuls() -> None:
        for layer in model.layers:
            model.linear(hidden, layer.qkv_weight)
            model.linear(attn_out, layer.o_weight)
            model.linear(hidden, layer.gate_up_weight)
            model.linear(inter, layer.down_weight)

    matmuls = best_seconds(layer_matmuls, repeats, warmup=1)
    engine = step_seconds - forward - head
    return (f"step {step_seconds * 1e3:.2f} ms = forward {forward * 1e3:.2f} + LM head {head * 1e3:.2f} "
            f"+ engine step {engine * 1e3:.2f}; layer matmuls as separate calls {matmuls * 1e3:.2f}")


def llama_bench_rate(binary: str, model: str, num_tokens: int, num_threads: int) -> float:
    """llama.cpp's batch-1 decode tokens/s on ``model`` (llama-bench's tg test, best of 2)."""
    argv = [binary, "-m", model, "-p", "0", "-n", str(num_tokens), "-t", str(num_threads), "-r", "2",
            "-o", "json"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
    return max(max(row["samples_ts"]) for row in json.loads(result.stdout))


def decode_rates(llms: dict[str, LLM], tokenizer, num_tokens: int, repeats: int,
                 llama: tuple[str, str] | None = None) -> tuple[dict[str, float], float]:
    """Best batch-1 decode tokens/s per format (and ``llama.cpp`` when ``llama`` is (llama-bench
    binary, GGUF path)), and the best streaming-read bandwidth (bytes/s) measured between the
    rounds."""
    prompt = [tokenizer.encode("The history of the printing press begins")]
    best = dict.fromkeys(llms, 0.0)
    read_bw = 0.0

    def timed(llm: LLM, n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompt, params)
        return time.perf_counter() - t0

    for llm in llms.values():
        timed(llm, 2)  # warm
    for _ in range(repeats):
        for name, llm in llms.items():
            elapsed = min(timed(llm, num_tokens + 1) for _ in range(2)) - min(timed(llm, 1) for _ in range(2))
            best[name] = max(best[name], num_tokens / max(elapsed, 1e-9))
        if llama is not None:
            rate = llama_bench_rate(*llama, num_tokens, torch.get_num_threads())
            best["llama.cpp"] = max(best.get("llama.cpp", 0.0), rate)
        with torch_threads(len(os.sched_getaffinity(0))):
            read_bw = max(read_bw, memcpy_bandwidth(256 << 20, 3)[1])
    return best, read_bw


def machine() -> str:
    model, flags = "?", ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "?":
                model = value.strip()
            elif key.strip() == "flags":
                flags = " ".join(f for f in value.split() if f.startswith(("avx", "fma", "f16c", "amx")))
                break
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"CPU: {model}, {len(os.sched_getaffinity(0))} CPUs usable, torch threads "
            f"{torch.get_num_threads()}\nflags: {flags}\nload average (1/5/15 min) at start: {load}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--formats", default="fp32,q8_0,q4")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--breakdown", action="store_true",
                        help="split each format's decode step into matmuls, head, forward, engine")
    parser.add_argument("--llama-bench", default="",
                        help="llama.cpp's llama-bench binary: decode the same GGUF with it in each round")
    args = parser.parse_args(argv)
    formats = args.formats.split(",")
    print(machine())
    loaded = load_model(args.model)
    llms = {}
    for fmt in formats:
        t0 = time.perf_counter()
        llms[fmt] = LLM(loaded, weight_format=fmt, max_num_batched_tokens=1024)
        print(f"{fmt}: engine ready in {time.perf_counter() - t0:.1f} s, "
              f"{llms[fmt].engine.runner.model.weight_bytes / 1e6:.1f} MB read per decode step")
    if not args.skip_accuracy:
        accuracy(llms, loaded.tokenizer)
    gguf = args.model or default_model_path()
    if args.llama_bench and not gguf.endswith(".gguf"):
        parser.error("--llama-bench needs a GGUF model")
    llama = (args.llama_bench, gguf) if args.llama_bench else None
    rates, read_bw = decode_rates(llms, loaded.tokenizer, args.decode_tokens, args.repeats, llama)
    print(f"batch-1 decode, {args.decode_tokens} tokens, best of {args.repeats} interleaved rounds; "
          f"streaming read {read_bw / 1e9:.1f} GB/s")
    print(f"{'format':<8}{'MB/step':>9}{'tok/s':>9}{'bound tok/s':>13}{'of bound':>10}{'vs fp32':>9}")
    base = rates.get("fp32") or max(rates.values())
    for fmt, rate in rates.items():
        if fmt not in llms:  # llama.cpp: bytes per step not measured here
            print(f"{fmt:<8}{'':>9}{rate:>9.1f}{'':>13}{'':>10}{rate / base:>9.2f}")
            continue
        weight_bytes = llms[fmt].engine.runner.model.weight_bytes
        bound = read_bw / weight_bytes
        print(f"{fmt:<8}{weight_bytes / 1e6:>9.1f}{rate:>9.1f}{bound:>13.1f}{rate / bound:>10.2f}{rate / base:>9.2f}")
    if args.breakdown:
        for fmt in llms:
            print(f"{fmt:<8}{step_breakdown(llms[fmt], 1.0 / rates[fmt])}")
    if "llama.cpp" in rates and "q4" in rates:
        print(f"q4 / llama.cpp: {rates['q4'] / rates['llama.cpp']:.2f}")
    print(f"load average (1/5/15 min) at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
