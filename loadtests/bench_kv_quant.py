"""The compact KV caches: bytes per token, accuracy and decode speed at a long context,
fp32 vs bf16 vs int8 (vs fp8) KV in the same run.

    python -m loadtests.bench_kv_quant [--model PATH] [--kv-dtypes fp32,bf16,int8] [--context 2048]
                                       [--batches 1,16] [--steps 8] [--repeats 3]

Accuracy (``loadtests.bench_quant.accuracy``, on its fixed texts and greedy prompts): each KV
dtype's perplexity, its ratio to fp32 KV's, top-1 and greedy agreement; then the perplexity of
all the texts as one ~650-token sequence, where later tokens attend over more quantized keys;
then greedy agreement on the 8 HF parity prompts (tests/integration/test_parity_hf.py, one of
them ~1,000 tokens), 64 tokens each: how many equal fp32 KV's tokens, and the tokens each
keeps before its first difference.
Speed: decode steps of ``batch`` sequences, each at ``--context`` tokens, timed on the engine's
model forward (input building included, sampling not) over a cache whose first ``context``
positions were written by the store kernel (the values do not change the work), so no prompt is
prefilled: tokens/s = batch / step time, best of ``--repeats`` rounds that interleave the dtypes.
Each row also gives the KV bytes one step reads (context x batch x bytes per token).
The machine may be shared: the CPU, its flags, ``$PDSERVE_CPU_ISA`` and the load average are
printed at start and end.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

from engine import LLM
from engine.kv_cache.quant_format import bytes_per_token
from engine.mathutils import cdiv
from engine.models.loader import load_model
from engine.runner.inputs import ScheduledSeq, build_model_input
from loadtests.bench_quant import EVAL_TEXTS, accuracy, machine, teacher_forced


def kv_bytes_per_token(llm: LLM) -> int:
    cache, config = llm.engine.runner.kv_cache, llm.model_config
    return bytes_per_token(str(cache.dtype).removeprefix("torch."), config.num_layers,
                           config.num_kv_heads, config.head_dim, cache.element_size())


def long_perplexity(llm: LLM, tokenizer) -> float:
    ids = tokenizer.encode("\n\n".join(EVAL_TEXTS))
    logprobs = teacher_forced(llm, ids)
    nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
    return math.exp(nll / (len(ids) - 1))


def parity_agreement(llms: dict[str, LLM], tokenizer) -> None:
    """Greedy tokens on the parity prompts against the first dtype's (fp32 KV)."""
    from engine import SamplingParams
    from tests.integration.test_parity_hf import NUM_NEW_TOKENS, _prompts  # the repo's parity set

    prompts = _prompts(tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS)
    outputs = {name: [out.token_ids for out in llm.generate(prompts, params)] for name, llm in llms.items()}
    reference = next(iter(outputs.values()))
    print(f"greedy on the {len(prompts)} parity prompts x {NUM_NEW_TOKENS} tokens (longest prompt "
          f"{max(len(p) for p in prompts)} tokens): identical prompts, tokens before the first difference")
    for name, outs in outputs.items():
        kept = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(outs, reference)]
        same = sum(o == r for o, r in zip(outs, reference))
        print(f"{name:<9}{same}/{len(prompts)} identical, kept {kept}")


def fill_context(llm: LLM, num_seqs: int, context: int) -> list[list[int]]:
    """Block tables of ``num_seqs`` sequences whose first ``context`` slots hold stored K/V."""
    runner = llm.engine.runner
    per_seq = cdiv(context + 1, runner.block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
    config = llm.model_config
    gen = torch.Generator().manual_seed(0)
    from engine.kv_cache.storage import layer_kv

    slots = torch.tensor([b * runner.block_size + o for table in tables for b in table
                          for o in range(runner.block_size)][:num_seqs * per_seq * runner.block_size])
    key = torch.randn(slots.numel(), config.num_kv_heads, config.head_dim, generator=gen)
    for layer in range(config.num_layers):
        key_cache, value_cache = layer_kv(runner.kv_cache, layer)
        runner.model.ops.store_kv(key, key, key_cache, value_cache, slots)
    return tables


def step_seconds(llm: LLM, tables: list[list[int]], context: int, num_steps: int) -> float:
    """Best seconds of one decode forward over ``len(tables)`` sequences at ``context``."""
    runner = llm.engine.runner
    seqs = [ScheduledSeq([100 + i], context, table) for i, table in enumerate(tables)]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(num_steps):
            t0 = time.perf_counter()
            model_input = build_model_input(seqs, runner.block_size, runner.device)
            hidden = runner.model.forward(model_input.input_ids, model_input.positions, model_input.attn,
                                          runner.kv_cache)
            runner.model.compute_logits(hidden[model_input.logits_indices])
            best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-dtypes", default="fp32,bf16,int8")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weight-format", default="fp32")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--num-threads", type=int, default=0,
                        help="engine threads (0: every CPU; 1 keeps a shared machine's barrier stalls out)")
    args = parser.parse_args(argv)
    print(machine())
    print(f"PDSERVE_CPU_ISA={os.environ.get('PDSERVE_CPU_ISA', 'native')}, weights {args.weight_format}, "
          f"engine threads {args.num_threads or len(os.sched_getaffinity(0))}")
    loaded = load_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    # room for the batch at --context, and for the ~650-token text of long_perplexity
    num_blocks = max(max(batches) * cdiv(args.context + 1, 16), 1024 // 16) + 8
    llms = {kvd: LLM(loaded, kv_cache_dtype=kvd, weight_format=args.weight_format, num_kv_blocks=num_blocks,
                     cpu_offload_gb=0, num_threads=args.num_threads,
                     max_num_batched_tokens=1024, max_model_len=max(args.context + 1, 1024))
            for kvd in args.kv_dtypes.split(",")}
    print(f"{'KV dtype':<9}{'bytes/token':>12}{'vs fp32':>9}")
    base_bytes = kv_bytes_per_token(next(iter(llms.values())))
    for name, llm in llms.items():
        print(f"{name:<9}{kv_bytes_per_token(llm):>12}{base_bytes / kv_bytes_per_token(llm):>9.3f}x smaller")
    if not args.skip_accuracy:
        accuracy(llms, loaded.tokenizer)
        ppl = {name: long_perplexity(llm, loaded.tokenizer) for name, llm in llms.items()}
        first = next(iter(ppl.values()))
        print("all texts as one sequence: " + ", ".join(f"{n} ppl {p:.4f} ({p / first:.4f}x)"
                                                         for n, p in ppl.items()))
        parity_agreement(llms, loaded.tokenizer)
    if args.skip_speed:
        return
    tables = {name: fill_context(llm, max(batches), args.context) for name, llm in llms.items()}
    best = {(name, b): float("inf") for name in llms for b in batches}
    for _ in range(args.repeats):
        for batch in batches:
            for name, llm in llms.items():
                seconds = step_seconds(llm, tables[name][:batch], args.context, args.steps)
                best[name, batch] = min(best[name, batch], seconds)
    print(f"decode at context {args.context}: best of {args.repeats} interleaved rounds x {args.steps} steps")
    print(f"{'KV dtype':<9}{'batch':>6}{'KV MB/step':>12}{'ms/step':>9}{'tok/s':>9}{'vs fp32':>9}")
    first = next(iter(llms))
    for batch in batches:
        for name, llm in llms.items():
            kv_mb = kv_bytes_per_token(llm) * args.context * batch / 1e6
            rate = batch / best[name, batch]
            print(f"{name:<9}{batch:>6}{kv_mb:>12.1f}{best[name, batch] * 1e3:>9.2f}{rate:>9.1f}"
                  f"{best[first, batch] / best[name, batch]:>9.2f}")
    print(f"load average (1/5/15 min) at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
