"""Speculative decoding benchmark: decode tokens/s with and without speculation, one run.

    python -m loadtests.bench_spec [--max-tokens 96] [--methods ngram,layer-skip,draft]

For (a) a code-edit prompt whose answer copies its input and (b) an open-ended chat prompt,
at batch 1, 8 and 32: output tokens/s of plain decoding (the baseline, same engine settings)
and of each proposer, the ratio, and the mean accepted drafts per verification step. Greedy,
so every configuration produces the same tokens (checked). Prefill is excluded by timing
max_tokens=N+1 minus max_tokens=1.
"""

from __future__ import annotations

import argparse
import time

from engine import LLM, SamplingParams
from engine.models.default_model import default_model_path
from engine.models.loader import load_model

CODE = '''def parse_config(path):
    with open(path) as f:
        lines = f.read().splitlines()
    config = {}
    for line in lines:
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config
'''


def prompts(tokenizer) -> dict[str, list[int]]:
    return {
        # The default 135M model answers this by copying the code back (typo and all), which is
        # what makes it a copy prompt; asked to rename the function instead, it rewrites the body.
        "copy (code edit)": tokenizer.encode_chat([{"role": "user", "content":
            "Fix the typo in this code and return the corrected code in full:\n\n"
            + CODE.replace("splitlines", "splitlnes")}]),
        "open chat": tokenizer.encode_chat([{"role": "user", "content":
            "What are some good habits for staying healthy while working from home?"}]),
    }


def timed(llm: LLM, batch: list[list[int]], max_tokens: int) -> tuple[float, list]:
    t0 = time.perf_counter()
    out = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens))
    return time.perf_counter() - t0, [o.token_ids for o in out]


def decode_rates(engines: dict[str, LLM], batch: list[list[int]], max_tokens: int,
                 repeats: int) -> dict[str, tuple[float, list, int, int]]:
    """Per engine: decode tokens/s (time for max_tokens + 1 tokens minus time for 1, each the
    best of ``repeats``), its outputs, and the speculative steps and accepted drafts of the
    timed runs. Rounds interleave the engines, so drift in the machine's speed (it is a VM) hits
    all of them alike; one untimed round warms them up first."""
    best_first = dict.fromkeys(engines, float("inf"))
    best_all = dict.fromkeys(engines, float("inf"))
    outputs, steps, accepted = {}, dict.fromkeys(engines, 0), dict.fromkeys(engines, 0)
    for round_ in range(repeats + 1):
        for name, llm in engines.items():
            before = llm.engine.spec_stats()
            t_first, _ = timed(llm, batch, 1)
            t_all, outputs[name] = timed(llm, batch, max_tokens + 1)
            after = llm.engine.spec_stats()
            if round_ == 0:
                continue
            best_first[name] = min(best_first[name], t_first)
            best_all[name] = min(best_all[name], t_all)
            if after:
                steps[name] += after["num_spec_steps"] - before["num_spec_steps"]
                accepted[name] += (sum(after["num_accepted_per_position"])
                                   - sum(before["num_accepted_per_position"]))
    return {name: (sum(len(t) - 1 for t in outputs[name]) / (best_all[name] - best_first[name]),
                   outputs[name], steps[name], accepted[name]) for name in engines}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--methods", default="ngram,layer-skip,draft")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timings")
    parser.add_argument("--spec-k", type=int, default=4)
    parser.add_argument("--spec-layers", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=16,
                        help="adaptive threshold: no speculation at or above this batch size")
    args = parser.parse_args(argv)
    loaded = load_model(None)
    common = dict(max_model_len=1024, max_num_batched_tokens=1024, enable_prefix_caching=False)
    engines = {"none": LLM(loaded, **common)}
    for method in args.methods.split(","):
        engines[method] = LLM(loaded, spec_method=method, spec_k=args.spec_k,
                              spec_layers=args.spec_layers, spec_max_batch=args.max_batch,
                              draft_model=default_model_path() if method == "draft" else None,
                              **common)
    print(f"greedy, {args.max_tokens} new tokens, k={args.spec_k}, layer-skip layers="
          f"{args.spec_layers}, draft model = the target itself (upper bound on acceptance), "
          f"adaptive off at batch >= {args.max_batch}")
    print(f"{'prompt':18s} {'batch':>5s} {'method':>11s} {'tok/s':>8s} {'vs none':>8s} {'acc/step':>9s}")
    for name, ids in prompts(loaded.tokenizer).items():
        for batch_size in (int(b) for b in args.batches.split(",")):
            rates = decode_rates(engines, [ids] * batch_size, args.max_tokens, args.repeats)
            base_rate, base_tokens, _, _ = rates["none"]
            print(f"{name:18s} {batch_size:5d} {'none':>11s} {base_rate:8.1f} {'1.00x':>8s} {'':>9s}")
            for method, (rate, tokens, steps, accepted) in rates.items():
                if method == "none":
                    continue
                same = "" if tokens == base_tokens else "  OUTPUT DIFFERS"
                acc = f"{accepted / steps:9.2f}" if steps else "      off"
                print(f"{name:18s} {batch_size:5d} {method:>11s} {rate:8.1f} {rate / base_rate:7.2f}x {acc}{same}")

if __name__ == "__main__":
    main()
