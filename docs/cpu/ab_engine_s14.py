"""Batch-1 decode tok/s of one checkout's engine on the default model (docs/cpu/ab_engine_s14.txt).

    [PDSERVE_CPU_ISA=avx2] [FMTS=fp32] [REP=6] python docs/cpu/ab_engine_s14.py <checkout>
"""
import os
import sys
import time

root = sys.argv[1]
sys.path.insert(0, root)
os.chdir(root)
from engine import LLM, SamplingParams  # noqa: E402 - from the checkout named above

out = []
for fmt in os.environ.get("FMTS", "auto,fp32").split(","):
    llm = LLM(weight_format=fmt, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompt = [list(range(100, 164))]
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    best = 1e9
    for _ in range(int(os.environ.get("REP", 3))):
        started = time.perf_counter()
        llm.generate(prompt, params)
        best = min(best, time.perf_counter() - started)
    out.append(f"{fmt} b1 {64 / best:.1f} tok/s")
    del llm
print(root, os.environ.get("PDSERVE_CPU_ISA", "native"), " | ".join(out))
