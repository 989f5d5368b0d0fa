"""Offline engine benchmark, side by side with HF transformers in the same run.

    python -m loadtests.bench_engine [--model PATH] [--decode-tokens 32] [--skip-hf]
    pdserve bench engine ...

Reports, for the engine as it runs by default and for the pure-torch backend in the same
process (``--backends``; rounds interleave them so drift hits both alike): prefill tokens/s;
decode tokens/s at batch 1 and batch 16; offline throughput at 1, 8 and 32 concurrent
requests; HF ``generate`` on the same weights and prompts; ratios between them; the
memory-bandwidth bound (weight bytes per decode step / measured bandwidth) and the fraction of
it reached at batch 1. ``PDSERVE_CPU_ISA=avx2`` measures the AVX2 build of the kernels.
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
from engine.runner.cpu_threads import configure_cpu_threads
from kernels.ops import BACKEND_ENV
from kernels.timing import best_seconds


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


def memcpy_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> tuple[float, float]:
    """(copy, read) bandwidth in bytes/s: a large tensor copy counted as bytes copied per
    second (each byte once, as memcpy benchmarks report it), and a streaming read (a sum)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy = num_bytes / best_seconds(lambda: dst.copy_(src), repeats)
    read = num_bytes / best_seconds(lambda: src.sum(), repeats)
    return copy, read


def prompts_of_length(tokenizer, length: int, count: int) -> list[list[int]]:
    base = tokenizer.encode("The history of computing is a story of ideas, machines and people. " * 200)
    return [base[i * 7: i * 7 + length] for i in range(count)]


def _generate_time(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return time.perf_counter() - t0


def hf_decode_rate(hf, prompts: list[list[int]], num_tokens: int, repeats: int) -> float:
    input_ids = torch.tensor(prompts)
    mask = torch.ones_like(input_ids)

    def run(n):
        def go():
            with torch.inference_mode():
                hf.generate(input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)
        return go
    t_full = best_seconds(run(num_tokens + 1), repeats)
    t_first = best_seconds(run(1), repeats)
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
        t = best_seconds(lambda: hf(torch.tensor(long_prompt)), args.repeats)
    return [1024 / t, hf_decode_rate(hf, batch1, args.decode_tokens, args.repeats),
            hf_decode_rate(hf, batch16, args.decode_tokens, args.repeats)]


class EngineLines:
    """One engine's lines, each the best over the rounds: prefill tokens/s, decode tokens/s at
    batch 1 and 16 (prefill excluded), output tokens/s at each concurrency."""

    def __init__(self, llm: LLM, tokenizer, args) -> None:
        self.llm, self.args = llm, args
        self.long_prompt = prompts_of_length(tokenizer, 1024, 1)
        self.batches = {"batch 1": prompts_of_length(tokenizer, args.prompt_len, 1),
                        "batch 16": prompts_of_length(tokenizer, args.prompt_len, 16)}
        self.concurrent = {c: prompts_of_length(tokenizer, 64, c) for c in CONCURRENCIES}
        self.best: dict[str, float] = {}
        self.activate()
        self.first = {name: min(_generate_time(llm, p, 1) for _ in range(2)) for name, p in self.batches.items()}

    def activate(self) -> None:
        """Thread pools as this engine's backend wants them (engines of two backends share the
        process: the compiled kernels run on torch's OpenMP pool, the torch backend's matmuls on
        OpenBLAS)."""
        configure_cpu_threads(self.llm.engine.config.num_threads, self.llm.engine.runner.backend)

    def _keep(self, line: str, value: float) -> bool:
        if value > self.best.get(line, float("-inf")):
            self.best[line] = value
            return True
        return False

    def round(self) -> bool:
        """Measure every line once; True if this round gave the best batch-1 rate so far."""
        self.activate()
        llm, tokens = self.llm, self.args.decode_tokens
        self._keep("prefill", 1024 / _generate_time(llm, self.long_prompt, 1))
        improved = False
        for name, prompts in self.batches.items():
            t_full = _generate_time(llm, prompts, tokens + 1)
            kept = self._keep(name, len(prompts) * tokens / (t_full - self.first[name]))
            improved |= kept and name == "batch 1"
        if not self.args.skip_throughput:
            for c, prompts in self.concurrent.items():
                self._keep(f"{c} concurrent", c * 64 / _generate_time(llm, prompts, 64))
        return improved


CONCURRENCIES = (1, 8, 32)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backends", default="default,torch",
                        help="engines to measure side by side: 'default' (what the engine picks "
                             "here) and/or a forced backend name (cpu, torch)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    loaded = load_model(args.model)
    load_s = time.perf_counter() - t0
    from kernels import cpu

    engines: dict[str, EngineLines] = {}
    for name in args.backends.split(","):
        with forced_backend(None if name == "default" else name):
            # No prefix caching: the repeated benchmark prompts would otherwise hit the cache.
            llm = LLM(loaded, max_num_batched_tokens=2048, enable_prefix_caching=False)
        engines[name] = EngineLines(llm, loaded.tokenizer, args)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs: {cpu.cpu_identity()}; kernel ISA "
          f"{cpu.default_isa()}; HF: torch with {len(os.sched_getaffinity(0))} threads")
    for name, lines in engines.items():
        runner = lines.llm.engine.runner
        print(f"engine {name!r}: backend {runner.backend!r}, {lines.llm.engine.config.num_threads or 'all'} threads")
    print(f"model load: {load_s:.2f} s  ({loaded.config.name})")

    bandwidth = (0.0, 0.0)  # (copy, read) of the round that gave the first engine's best batch-1 rate
    for _ in range(args.repeats):
        with torch_threads(len(os.sched_getaffinity(0))):  # the machine's bandwidth, every core
            round_bandwidth = memcpy_bandwidth()
        for i, lines in enumerate(engines.values()):
            if lines.round() and i == 0:
                bandwidth = round_bandwidth

    hf = None
    first = next(iter(engines.values()))
    if not args.skip_hf:
        with torch_threads(len(os.sched_getaffinity(0))):
            hf = dict(zip(("prefill", "batch 1", "batch 16"),
                          hf_baseline(args.model, first.long_prompt, first.batches["batch 1"],
                                      first.batches["batch 16"], args)))
    report(engines, hf, bandwidth, first.llm.engine.runner.model.weight_bytes)


def report(engines: dict[str, EngineLines], hf: dict[str, float] | None,
           bandwidth: tuple[float, float], weight_bytes: int) -> None:
    names = list(engines)
    labels = {"prefill": "prefill tokens/s (1 x 1024)", "batch 1": "decode tokens/s batch 1",
              "batch 16": "decode tokens/s batch 16",
              **{f"{c} concurrent": f"{c} concurrent, output tokens/s" for c in CONCURRENCIES}}
    header = f"\n{'line':34s}" + "".join(f"{n:>10s}" for n in names) + (f"{'HF':>10s}" if hf else "")
    if len(names) > 1:
        header += f"{names[0] + '/' + names[1]:>16s}"
    if hf:
        header += f"{names[0] + '/HF':>12s}"
    print(header)
    for line, label in labels.items():
        values = [engines[n].best.get(line) for n in names]
        if values[0] is None:
            continue
        row = f"{label:34s}" + "".join(f"{v:10.1f}" for v in values)
        theirs = hf.get(line) if hf else None
        if hf:
            row += f"{theirs:10.1f}" if theirs else f"{'':10s}"
        if len(names) > 1:
            row += f"{values[0] / values[1]:15.2f}x"
        if theirs:
            row += f"{values[0] / theirs:11.2f}x"
        print(row)
    best = engines[names[0]].best
    copy_bw, read_bw = bandwidth
    print(f"\n{names[0]}: batch-16 / batch-1 decode: {best['batch 16'] / best['batch 1']:.2f}x")
    if "32 concurrent" in best:
        print(f"{names[0]}: 32 concurrent / 1 request: {best['32 concurrent'] / best['1 concurrent']:.2f}x")
    print(f"weights read per decode step: {weight_bytes / 1e6:.1f} MB; memcpy bandwidth "
          f"{copy_bw / 1e9:.2f} GB/s (bytes copied/s), streaming read {read_bw / 1e9:.2f} GB/s "
          f"(measured in the round of the best batch-1 rate)")
    for name, bw in (("memcpy", copy_bw), ("read", read_bw)):
        bound_tps = bw / weight_bytes
        print(f"bandwidth bound at batch 1 ({name}): {bound_tps:.1f} tokens/s; "
              f"{names[0]} reached {best['batch 1'] / bound_tps:.0%} of it")


@contextlib.contextmanager
def forced_backend(backend: str | None):
    """Build an engine with ``PDSERVE_ATTENTION_BACKEND`` forced to ``backend`` (None: as is)."""
    before = os.environ.get(BACKEND_ENV)
    if backend is not None:
        os.environ[BACKEND_ENV] = backend
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = before


if __name__ == "__main__":
    main()
