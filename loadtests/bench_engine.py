"""Offline engine benchmark, side by side with HF transformers in the same run.

    python -m loadtests.bench_engine [--model PATH] [--decode-tokens 32] [--skip-hf]
    pdserve bench engine ...

Reports: model load time; prefill tokens/s; decode tokens/s at batch 1 and batch 16 (both
for pdserve and for HF ``generate`` on the same weights and prompts), printed as ratios;
the memory-bandwidth bound (weight bytes per decode step / measured memcpy bandwidth) and
the fraction of it reached at batch 1; offline throughput at 1, 8 and 32 concurrent requests.
Decode rates are (time for N+1 new tokens - time for 1 new token) / N, so prefill is excluded
on both sides.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

from engine import LLM, SamplingParams
from engine.models.loader import load_model


@contextlib.contextmanager
def torch_threads(num_threads: int):
    """HF computes with torch's own BLAS and thread pool: give it every core while it runs
    (pdserve's engine sizes the thread pools for its own backend: engine.runner.cpu_threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> tuple[float, float]:
    """(copy, read) bandwidth in bytes/s: a large tensor copy counted as bytes copied per
    second (each byte once, as memcpy benchmarks report it), and a streaming read (a sum)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy = num_bytes / _best_of(lambda: dst.copy_(src), repeats)
    read = num_bytes / _best_of(lambda: src.sum(), repeats)
    return copy, read


def prompts_of_length(tokenizer, length: int, count: int) -> list[list[int]]:
    base = tokenizer.encode("The history of computing is a story of ideas, machines and people. " * 200)
    return [base[i * 7: i * 7 + length] for i in range(count)]


def _generate_time(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return time.perf_counter() - t0


def pdserve_decode_rates(llm: LLM, batches: dict[str, list[list[int]]], num_tokens: int,
                         repeats: int) -> tuple[dict[str, float], tuple[float, float]]:
    """Decode tokens/s (prefill excluded) of each batch, the best of ``repeats`` rounds that
    interleave the batches, each round opened by a bandwidth measurement. Returns the rates and
    the (copy, read) bandwidth of the round that gave the first batch's best rate: this VM's
    memory bandwidth drifts between states (streaming reads of 40 and of 70 GB/s seen minutes
    apart), so a rate is set against the bound measured alongside it, not in another state."""
    first = {name: min(_generate_time(llm, p, 1) for _ in range(repeats)) for name, p in batches.items()}
    best: dict[str, float] = {}
    best_bandwidth = (0.0, 0.0)
    for _ in range(repeats):
        with torch_threads(len(os.sched_getaffinity(0))):  # the machine's bandwidth, every core
            bandwidth = memcpy_bandwidth()
        for i, (name, prompts) in enumerate(batches.items()):
            t_full = _generate_time(llm, prompts, num_tokens + 1)
            rate = len(prompts) * num_tokens / (t_full - first[name])
            if rate > best.get(name, float("-inf")):
                best[name] = rate
                if i == 0:
                    best_bandwidth = bandwidth
    return best, best_bandwidth


def hf_decode_rate(hf, prompts: list[list[int]], num_tokens: int, repeats: int) -> float:
    input_ids = torch.tensor(prompts)
    mask = torch.ones_like(input_ids)

    def run(n):
        def go():
            with torch.inference_mode():
                hf.generate(input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)
        return go
    t_full = _best_of(run(num_tokens + 1), repeats)
    t_first = _best_of(run(1), repeats)
    return len(prompts) * num_tokens / (t_full - t_first)


def hf_baseline(model: str | None, long_prompt, batch1, batch16, args) -> list[float]:
    """HF transformers on the same weights and prompts: prefill, batch-1 and batch-16 decode."""
    from transformers import AutoModelForCausalLM

    from engine.models.default_model import default_model_path
    path = model or default_model_path()
    directory, name = os.path.split(path)
    hf_kwargs = {"gguf_file": name} if name.endswith(".gguf") else {}
    hf = AutoModelForCausalLM.from_pretrained(directory if hf_kwargs else path,
                                              dtype=torch.float32, **hf_kwargs).eval()
    with torch.inference_mode():
        hf(torch.tensor(long_prompt))
        t = _best_of(lambda: hf(torch.tensor(long_prompt)), args.repeats)
    return [1024 / t, hf_decode_rate(hf, batch1, args.decode_tokens, args.repeats),
            hf_decode_rate(hf, batch16, args.decode_tokens, args.repeats)]


def throughputs(llm: LLM, tokenizer, concurrencies: tuple[int, ...], max_tokens: int,
                repeats: int) -> dict[int, float]:
    """Output tokens/s at each concurrency, best of ``repeats`` rounds over all of them."""
    prompts = {c: prompts_of_length(tokenizer, 64, c) for c in concurrencies}
    best = dict.fromkeys(concurrencies, 0.0)
    for _ in range(repeats):
        for c in concurrencies:
            best[c] = max(best[c], c * max_tokens / _generate_time(llm, prompts[c], max_tokens))
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    loaded = load_model(args.model)
    load_s = time.perf_counter() - t0
    # No prefix caching: the repeated benchmark prompts would otherwise hit the cache.
    llm = LLM(loaded, max_num_batched_tokens=2048, enable_prefix_caching=False)
    print(f"torch {torch.__version__}, cpu count {os.cpu_count()}; pdserve: backend "
          f"{llm.engine.runner.backend!r} on {torch.get_num_threads()} torch threads; "
          f"HF: torch with {len(os.sched_getaffinity(0))} threads")
    print(f"model load: {load_s:.2f} s  ({loaded.config.name})")
    tok = loaded.tokenizer

    long_prompt = prompts_of_length(tok, 1024, 1)
    llm.generate(long_prompt, SamplingParams(temperature=0, max_tokens=1))  # warm up
    t = _best_of(lambda: llm.generate(long_prompt, SamplingParams(temperature=0, max_tokens=1)), args.repeats)
    prefill_tps = 1024 / t

    batch1 = prompts_of_length(tok, args.prompt_len, 1)
    batch16 = prompts_of_length(tok, args.prompt_len, 16)
    rates, (copy_bw, read_bw) = pdserve_decode_rates(
        llm, {"batch 1": batch1, "batch 16": batch16}, args.decode_tokens, args.repeats)
    ours_b1, ours_b16 = rates["batch 1"], rates["batch 16"]
    weight_bytes = llm.engine.runner.model.weight_bytes
    rows = [("prefill tokens/s (1 x 1024)", prefill_tps, None),
            ("decode tokens/s batch 1", ours_b1, None),
            ("decode tokens/s batch 16", ours_b16, None)]

    if not args.skip_hf:
        with torch_threads(len(os.sched_getaffinity(0))):
            hf_rates = hf_baseline(args.model, long_prompt, batch1, batch16, args)
        rows = [(name, ours, theirs) for (name, ours, _), theirs in zip(rows, hf_rates)]

    print(f"\n{'metric':34s} {'pdserve':>10s} {'HF':>10s} {'ratio':>7s}")
    for name, ours, theirs in rows:
        ratio = f"{ours / theirs:6.2f}x" if theirs else "   n/a"
        theirs_s = f"{theirs:10.1f}" if theirs else "       n/a"
        print(f"{name:34s} {ours:10.1f} {theirs_s} {ratio}")
    print(f"\nbatch-16 / batch-1 decode throughput: {ours_b16 / ours_b1:.2f}x")
    print(f"weights read per decode step: {weight_bytes / 1e6:.1f} MB; memcpy bandwidth "
          f"{copy_bw / 1e9:.2f} GB/s (bytes copied/s), streaming read {read_bw / 1e9:.2f} GB/s "
          f"(measured in the round of the best batch-1 rate)")
    for name, bw in (("memcpy", copy_bw), ("read", read_bw)):
        bound_tps = bw / weight_bytes
        print(f"bandwidth bound at batch 1 ({name}): {bound_tps:.1f} tokens/s; "
              f"pdserve reached {ours_b1 / bound_tps:.0%} of it")

    if not args.skip_throughput:
        print(f"\noffline throughput (64-token prompts, 64 new tokens each, best of {args.repeats})")
        tps = throughputs(llm, tok, (1, 8, 32), 64, args.repeats)
        for concurrency, rate in tps.items():
            print(f"  {concurrency:3d} concurrent: {rate:8.1f} output tokens/s  ({rate / tps[1]:5.2f}x of 1)")


if __name__ == "__main__":
    main()
