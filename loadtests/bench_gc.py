"""The garbage collector's pauses during offline generation, with the start heap frozen out of
it (``engine/heap.py``, what ``LLM.generate`` does) and without, in the same run.

    python -m loadtests.bench_gc [--model PATH] [--concurrency 256] [--new-tokens 128] [--rounds 2]

One engine; each round runs the same batch (``--concurrency`` prompts of 64 tokens x
``--new-tokens``, greedy, ``ignore_eos``) once as ``LLM.generate`` does by default and once
with ``frozen_during`` replaced by a no-op, alternating which goes first. Per run: output tok/s
and every collection's pause by generation (count, total and longest). Pauses are what the
freeze removes; tok/s on a shared 2-vCPU machine moves by more than they are worth there, so
read it as a check that nothing got slower, not as the gain.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import engine.llm
from engine import LLM, SamplingParams


class CollectorPauses:
    """Every collection's duration, by generation, while ``recording()`` is entered."""

    def __init__(self) -> None:
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses[info["generation"]].append(time.perf_counter() - self._started)

    @contextlib.contextmanager
    def recording(self) -> Iterator[CollectorPauses]:
        gc.callbacks.append(self._callback)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for generation, pauses in self.pauses.items():
            out[f"gen{generation}_n"] = len(pauses)
            out[f"gen{generation}_ms"] = round(sum(pauses) * 1000, 2)
            out[f"gen{generation}_max_ms"] = round(max(pauses, default=0.0) * 1000, 2)
        out["total_ms"] = round(sum(sum(p) for p in self.pauses.values()) * 1000, 2)
        out["longest_ms"] = max(out[f"gen{g}_max_ms"] for g in self.pauses)
        return out


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams, frozen: bool) -> dict[str, Any]:
    original: Callable[[], contextlib.AbstractContextManager[None]] = engine.llm.frozen_during
    if not frozen:
        engine.llm.frozen_during = contextlib.nullcontext  # type: ignore[assignment]
    try:
        pauses = CollectorPauses()
        with pauses.recording():
            started = time.perf_counter()
            outputs = llm.generate(prompts, params)
            seconds = time.perf_counter() - started
    finally:
        engine.llm.frozen_during = original
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return dict(heap="frozen" if frozen else "unfrozen", out_tok_s=round(tokens / seconds, 1),
                seconds=round(seconds, 2), tracked_objects=len(gc.get_objects()), **pauses.summary())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model path (default: the embedded model)")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if min(args.concurrency, args.new_tokens, args.rounds) < 1:
        parser.error("--concurrency, --new-tokens and --rounds must be >= 1")
    llm = LLM(args.model, max_num_seqs=args.concurrency)
    prompts = [[100 + (i * 7 + j) % 900 for j in range(64)] for i in range(args.concurrency)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    rows: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for frozen in ((True, False) if round_ % 2 == 0 else (False, True)):
            row = _run(llm, prompts, params, frozen)
            rows[frozen].append(row)
            print(json.dumps(dict(round=round_, **row)), flush=True)
    pause = {f: sum(r["total_ms"] for r in rs) / len(rs) for f, rs in rows.items()}
    rate = {f: sum(r["out_tok_s"] for r in rs) / len(rs) for f, rs in rows.items()}
    print(json.dumps(dict(summary=True, pause_ms_frozen=round(pause[True], 1),
                          pause_ms_unfrozen=round(pause[False], 1),
                          longest_ms_frozen=max(r["longest_ms"] for r in rows[True]),
                          longest_ms_unfrozen=max(r["longest_ms"] for r in rows[False]),
                          tok_s_frozen_vs_unfrozen=round(rate[True] / rate[False], 3))), flush=True)


if __name__ == "__main__":
    main()
