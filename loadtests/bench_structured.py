"""What structured outputs cost: 16 concurrent JSON-schema requests vs the same requests free.

    python -m loadtests.bench_structured [--num-requests 16] [--max-tokens 64] [--reps 3] [--device cpu]

Offline engine, one process, the default model. Each JSON-schema request gets one of several
schemas (objects, arrays, enums, patterns, bounded numbers); the unconstrained twin has the same
prompt, greedy, ``ignore_eos`` and ``max_tokens`` = the constrained output's length, so both
runs produce the same number of tokens in the same batch shape. Prints: the first request's
compile time (the tokenizer's vocabulary is read then too) and each schema's, the per-step
mask time (CPU fill + device apply, per step with constrained rows), and output tok/s of both
runs with their ratio (issue 30 asks >= 0.85x). After one untimed run of each, runs alternate;
the best of ``--reps`` counts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from engine import LLM
from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams

S = {"type": "string", "maxLength": 12}
INT = {"type": "integer", "minimum": 0, "maximum": 999}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": S, "age": INT}, "required": ["name", "age"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"status": {"enum": ["active", "inactive", "banned"]}, "level": INT},
     "required": ["status", "level"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                      "price": {"type": "number", "minimum": 0, "maximum": 100}},
     "required": ["code", "price"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": S, "n": INT}, "required": ["sku", "n"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"},
                                      "id": {"type": "string", "format": "uuid"}}, "required": ["date", "id"]},
]
PROMPTS = ["Describe a customer as JSON.", "Return an order as JSON.", "Give me a product record in JSON.",
           "Answer with a JSON object about a city."]


class Timer:
    """Wraps a function of a module and sums its wall time per call."""

    def __init__(self, module: Any, name: str) -> None:
        self.module, self.name, self.times = module, name, []
        self.real: Callable[..., Any] = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return self.real(*args, **kwargs)
            finally:
                self.times.append(time.perf_counter() - start)

        setattr(module, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default=None, help="EngineArgs.device (default: the engine's)")
    args = parser.parse_args()

    import engine.runner.model_runner as runner_module
    import engine.sampling.processors as processors_module
    import engine.spec_decode.verify as verify_module

    llm = LLM(**({"device": args.device} if args.device else {}))
    n = args.num_requests
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    constraints = [StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)], field="response_format.json_schema")
                   for i in range(n)]

    start = time.perf_counter()
    llm.engine.constraints.compile(constraints[0])
    first_compile_s = time.perf_counter() - start
    compile_s = list(llm.engine.constraints.stats.compile_s)
    for c in constraints[1:len(SCHEMAS)]:
        llm.engine.constraints.compile(c)
    compile_s = list(llm.engine.constraints.stats.compile_s)

    constrained = [SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=c) for c in constraints]
    # warm-up: one untimed run of each (the CPU backend calibrates each batch-size class once, and
    # the constrained requests end at different steps: the first such run took 3-15x longer)
    lengths = [len(o.token_ids) for o in llm.generate(prompts, constrained)]
    llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths])
    fill = Timer(runner_module, "build_grammar_mask")
    fill_verify = Timer(verify_module, "build_grammar_mask")
    apply = Timer(processors_module, "apply_token_bitmask")

    best_c, best_u = float("inf"), float("inf")
    for _ in range(args.reps):
        start = time.perf_counter()
        outputs = llm.generate(prompts, constrained)
        best_c = min(best_c, time.perf_counter() - start)
        lengths = [len(o.token_ids) for o in outputs]
        free = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths]
        start = time.perf_counter()
        llm.generate(prompts, free)
        best_u = min(best_u, time.perf_counter() - start)
    num_tokens = sum(lengths)
    steps = len(fill.times) + len(fill_verify.times)
    per_step_ms = [(f + a) * 1e3 for f, a in zip(fill.times + fill_verify.times, apply.times)]

    print(f"device {llm.engine.runner.device}, {n} requests, {num_tokens} output tokens per run, "
          f"{len(SCHEMAS)} schemas, best of {args.reps}")
    print(f"first request's compile (vocabulary read included): {first_compile_s * 1e3:.1f} ms; "
          f"compiles: {', '.join(f'{s * 1e3:.1f}' for s in compile_s)} ms")
    fill_ms = statistics.median(t * 1e3 for t in fill.times)
    print(f"per-step mask, {n} constrained rows: fill (CPU) median {fill_ms:.3f} ms, "
          f"apply median {statistics.median(t * 1e3 for t in apply.times):.3f} ms, "
          f"fill + apply median {statistics.median(per_step_ms):.3f} ms over {steps} steps")
    tps_c, tps_u = num_tokens / best_c, num_tokens / best_u
    print(f"output tok/s: constrained {tps_c:.1f}, unconstrained {tps_u:.1f}, ratio {tps_c / tps_u:.3f}x")
    llm.engine.close()


if __name__ == "__main__":
    main()
