"""The host's share of an engine step: what a GPU waits for unless async scheduling hides it.

    python -m loadtests.bench_host [--batches 1,64,256] [--new-tokens 64] [--device cpu]

A 1-layer random-weight model (vocabulary 49,152, as SmolLM2's) with a word-level tokenizer,
so that the forward is small and the Python around it shows: ``LLM.generate`` of B distinct
128-token prompts x N new tokens, greedy. Each engine phase is timed in place (perf_counter
around the schedules (EngineCore._schedule, Scheduler.schedule_chained), EngineCore._update,
ModelRunner._forward, the sampling (ModelRunner._sample, or _blind_tokens for a deferred step)
and LLM._delta); ``host`` is the wall time per step less the forward and the sampling (admitting
the prompts, their prefill steps and the outputs included), printed as a ratio to them (the
baseline, measured in the same run). Best of 3 runs per batch.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from collections.abc import Callable
from typing import Any

import tokenizers
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.core import EngineCore
from engine.llm import LLM as _LLM
from engine.models.loader import LoadedModel
from engine.models.tokenizer import Tokenizer
from engine.runner.model_runner import ModelRunner
from engine.scheduler.scheduler import Scheduler

CONFIG = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=64, intermediate_size=128,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, max_model_len=1024)
PHASES = ((EngineCore, "_schedule", "schedule"), (Scheduler, "schedule_chained", "schedule"),
          (EngineCore, "_update", "update"), (ModelRunner, "_forward", "forward"),
          (ModelRunner, "_sample", "sample"), (ModelRunner, "_blind_tokens", "sample"),
          (_LLM, "_delta", "outputs"))


def tiny_model() -> LoadedModel:
    gen = torch.Generator().manual_seed(0)
    c = CONFIG
    h, i, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).div(shape[-1] ** 0.5)

    p = "model.layers.0"
    weights = {"model.embed_tokens.weight": w(c.vocab_size, h), "model.norm.weight": 1 + w(h) / 4,
               "lm_head.weight": w(c.vocab_size, h), f"{p}.self_attn.q_proj.weight": w(q, h),
               f"{p}.self_attn.k_proj.weight": w(kv, h), f"{p}.self_attn.v_proj.weight": w(kv, h),
               f"{p}.self_attn.o_proj.weight": w(h, q), f"{p}.mlp.gate_proj.weight": w(i, h),
               f"{p}.mlp.up_proj.weight": w(i, h), f"{p}.mlp.down_proj.weight": w(h, i),
               f"{p}.input_layernorm.weight": 1 + w(h) / 4, f"{p}.post_attention_layernorm.weight": 1 + w(h) / 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{n}": n for n in range(c.vocab_size)},
                                                               unk_token="t0"))
    return LoadedModel(c, weights, Tokenizer(backend))


def timed(spent: collections.defaultdict[str, float]) -> Callable[[], None]:
    """Wrap each phase to add its seconds to ``spent``; returns the undo."""
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in PHASES]
    for (cls, name, key), (_, _, fn) in zip(PHASES, originals):
        def wrapper(*args: Any, _fn: Any = fn, _key: str = key, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_key] += time.perf_counter() - started
        setattr(cls, name, functools.wraps(fn)(wrapper))

    def undo() -> None:
        for cls, name, fn in originals:
            setattr(cls, name, fn)
    return undo


def measure(batch: int, new_tokens: int, device: str, mode: str) -> dict[str, float]:
    llm = LLM(tiny_model(), device=device, dtype="float32", max_num_seqs=max(batch, 1),
              max_num_batched_tokens=8192, cpu_offload_gb=0, async_scheduling=mode)
    prompts = [[(97 * b + 31 * j + 1) % CONFIG.vocab_size for j in range(128)] for b in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, params)  # warm
    best: dict[str, float] = {}
    for _ in range(3):
        spent: collections.defaultdict[str, float] = collections.defaultdict(float)
        undo = timed(spent)
        try:
            started = time.perf_counter()
            llm.generate(prompts, params)
            wall = time.perf_counter() - started
        finally:
            undo()
        row = {k: spent[k] * 1e3 / new_tokens for _, _, k in PHASES}  # 0 where not called
        row["wall"] = wall * 1e3 / new_tokens
        row["host"] = row["wall"] - row["forward"] - row["sample"]
        if not best or row["host"] < best["host"]:
            best = row
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--async-scheduling", default="off", choices=("auto", "on", "off"))
    args = parser.parse_args()
    print(f"ms per step (best of 3), {args.new_tokens} tokens, device {args.device}, "
          f"async_scheduling={args.async_scheduling}")
    for batch in (int(b) for b in args.batches.split(",")):
        r = measure(batch, args.new_tokens, args.device, args.async_scheduling)
        print(f"B={batch:4d} wall {r['wall']:7.2f}  forward {r['forward']:6.2f}  sample {r['sample']:6.2f}  "
              f"host {r['host']:6.2f} (schedule {r['schedule']:.2f}, update {r['update']:.2f}, "
              f"outputs {r['outputs']:.2f})  host / (forward + sample) {r['host'] / (r['forward'] + r['sample']):.2f}x")


if __name__ == "__main__":
    main()
