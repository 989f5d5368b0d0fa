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


def decode_rate(llm: LLM, batch: list[list[int]], max_tokens: int) -> tuple[float, list]:
    def run(n):
        t0 = time.perf_counter()
        out = llm.generate(batch, SamplingParams(temperature=0, max_tokens=n))
        return time.perf_counter() - t0, out
    t_first, _ = run(1)
    t_all, out = run(max_tokens + 1)
    num_tokens = sum(len(o.token_ids) - 1 for o in out)
    return num_tokens / (t_all - t_first), [o.token_ids for o in out]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--methods", default="ngram,layer-skip,draft")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--spec-k", type=int, default=4)
    parser.add_argument("--spec-layers", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=8,
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
            batch = [ids] * batch_size
            base_rate, base_tokens = decode_rate(engines["none"], batch, args.max_tokens)
            print(f"{name:18s} {batch_size:5d} {'none':>11s} {base_rate:8.1f} {'1.00x':>8s} {'':>9s}")
            for method, llm in engines.items():
                if method == "none":
                    continue
                before = llm.engine.spec_stats()
                rate, tokens = decode_rate(llm, batch, args.max_tokens)
                after = llm.engine.spec_stats()
                steps = after["num_spec_steps"] - before["num_spec_steps"]
                accepted = sum(after["num_accepted_per_position"]) - sum(before["num_accepted_per_position"])
                same = "" if tokens == base_tokens else "  OUTPUT DIFFERS"
                acc = f"{accepted / steps:9.2f}" if steps else "      off"
                print(f"{name:18s} {batch_size:5d} {method:>11s} {rate:8.1f} {rate / base_rate:7.2f}x {acc}{same}")


if __name__ == "__main__":
    main()
