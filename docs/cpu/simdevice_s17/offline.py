"""Offline baseline on the simulated device: CONC prompts of 196 tokens x 128 at once."""
import os
import sys
import time

sys.path.insert(0, ".")
from engine import LLM, SamplingParams  # noqa: E402 - after the path
from engine.models.loader import load_model  # noqa: E402
from loadtests.prompts import distinct_prompts  # noqa: E402

MODEL = os.environ.get("MODEL", "/tmp/simdevice-model")
C = int(os.environ.get("CONC", 64))
N = int(os.environ.get("N", 128))
loaded = load_model(MODEL)
llm = LLM(loaded, enable_prefix_caching=False, async_scheduling=os.environ.get("ASYNC", "on"),
          max_num_seqs=256, max_num_batched_tokens=8192)
ps = distinct_prompts(loaded.tokenizer, 196, N, salt=3)
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate(ps[:8], sp)
t0 = time.perf_counter()
llm.generate(ps[:C], sp)
wall = time.perf_counter() - t0
print(f"offline c={C}: {C * 128 / wall:.0f} tok/s, {wall / 128 * 1e3:.2f} ms per step")
