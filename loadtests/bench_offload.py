"""Step-loop stall of host-tier copies: decode ITL while another request forces many evictions
and a long host-cached prefix reloads, block copies inline (the baseline) vs on the background
copier.

    python -m loadtests.bench_offload [--model PATH] [--prefix-len 1024] [--decoders 4] [--rounds 2]

One process, one run, the real engine (``EngineCore``) on the default model, two engines that
differ only in ``CacheConfig.kv_offload_sync`` (inline copies on the engine thread, as before,
vs the background copier with copy-ahead), measured in alternating rounds. Each round, per engine:

1. a ``--prefix-len`` prompt X runs (its blocks are cached on the device), then three unrelated
   prompts of the same length push X off the device pool (sized to hold X, Y and the decoders
   at once) to the host tier, and leave the pool full of cached blocks;
2. ``--decoders`` short requests start decoding;
3. X again (a host hit: its ``--prefix-len`` tokens reload) and a fresh prompt Y of the same
   length (its chunked prefill evicts, and offloads, a chunk's worth of blocks every step) join
   them; the decoders' inter-token latencies (ITL) are recorded until X and Y have their first
   token and the decoders a few more steps.

Printed per mode: decode ITL p50 / p99 / max over all rounds, the ratio to the inline baseline,
the engine thread's time in copies (inline: the copies themselves; background: waits for a copy
that had not landed) and how many allocations waited, and that X's greedy output is the same in
both modes. ITL here is dominated by the chunked prefill sharing each step; the copies' share is
what the stall columns show.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import time

from engine.args import EngineArgs
from engine.config import Role
from engine.core import EngineCore
from engine.kv_cache.tiers.host_tier import HostTier
from engine.mathutils import cdiv
from engine.models.loader import LoadedModel, load_model
from engine.sampling_params import SamplingParams

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
FIRST = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
MODES = ("inline", "background")


class Bench:
    def __init__(self, loaded: LoadedModel, args: argparse.Namespace) -> None:
        self.loaded, self.args, self.rng = loaded, args, random.Random(0)
        self.ids = iter(range(10**9))
        bs = args.block_size
        num_prompt_blocks = cdiv(args.prefix_len + args.tail_len + 4, bs)
        decoder_blocks = args.decoders * cdiv(args.decoder_prompt_len + args.decoder_tokens, bs)
        # X, Y and the decoders at once; three pushes evict all of X, X and Y evict the pushes.
        self.num_blocks = 2 * num_prompt_blocks + decoder_blocks + 4
        block_bytes = 2 * loaded.config.num_layers * bs * loaded.config.num_kv_heads * loaded.config.head_dim * 4
        host_gib = 4 * num_prompt_blocks * block_bytes / 2**30
        engine_args = EngineArgs(block_size=bs, num_kv_blocks=self.num_blocks, cpu_offload_gb=host_gib,
                                 max_num_batched_tokens=args.chunk, num_threads=args.num_threads)
        config = engine_args.build(loaded.config, Role.COLOCATED)
        self.cores = {mode: EngineCore(dataclasses.replace(config, cache=dataclasses.replace(
            config.cache, kv_offload_sync=mode == "inline")), loaded) for mode in MODES}
        for core in self.cores.values():  # first-forward costs out of the numbers
            self.run_alone(core, self.tokens(2 * bs), ONE)
            core.reset_prefix_cache()

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.loaded.config.vocab_size - 100) for _ in range(n)]

    def run_alone(self, core: EngineCore, prompt: list[int], params: SamplingParams) -> list[int]:
        request_id, tokens = f"r{next(self.ids)}", []
        core.add_request(request_id, prompt, params)
        for _ in range(100_000):
            if not core.has_unfinished_requests():
                break
            for output in core.step():
                tokens += output.new_token_ids
        return tokens

    def round(self, mode: str, prompts: dict[str, list[int]]) -> tuple[list[float], list[int], Stall]:
        """(decoder ITLs in seconds, X's output tokens, the engine thread's time in copies while
        they were measured) of one round on ``mode``'s engine."""
        core, args = self.cores[mode], self.args
        tier = core.host_tier
        assert isinstance(tier, HostTier)
        core.reset_prefix_cache()
        self.run_alone(core, prompts["x"], ONE)
        for push in ("push1", "push2", "push3"):
            self.run_alone(core, prompts[push], ONE)
        decode = SamplingParams(temperature=0.0, max_tokens=args.decoder_tokens, ignore_eos=True)
        decoders = [f"d{next(self.ids)}" for _ in range(args.decoders)]
        last: dict[str, float] = {}
        for request_id, prompt in zip(decoders, prompts["decoders"]):
            core.add_request(request_id, prompt, decode)
        for _ in range(1000):  # until every decoder has its first token
            if len(last) == len(decoders):
                break
            for output in core.step():
                if output.new_token_ids:
                    last[output.request_id] = time.perf_counter()
        before = dataclasses.replace(tier.stats)
        x_id, y_id = f"x{next(self.ids)}", f"y{next(self.ids)}"
        core.add_request(x_id, prompts["x"][:args.prefix_len] + prompts["x_tail"], FIRST)
        core.add_request(y_id, prompts["y"], ONE)
        itls: list[float] = []
        x_tokens: list[int] = []
        steps_after = None
        for _ in range(100_000):
            if not core.has_unfinished_requests() or (steps_after is not None and steps_after <= 0):
                break
            outputs = core.step()
            now = time.perf_counter()
            for output in outputs:
                if output.request_id in last and output.new_token_ids:
                    itls.append(now - last[output.request_id])
                    last[output.request_id] = now
                if output.request_id == x_id:
                    x_tokens += output.new_token_ids
            if steps_after is None and x_tokens and y_id not in core.scheduler.requests:
                steps_after = 4
            elif steps_after is not None:
                steps_after -= 1
        after = tier.stats
        engine_s = (after.copy_s - before.copy_s) if mode == "inline" else (after.wait_s - before.wait_s)
        stall = Stall(engine_s, after.num_offload_waits - before.num_offload_waits,
                      after.num_load_waits - before.num_load_waits)
        for request_id in [*decoders, x_id, y_id]:
            core.abort_request(request_id)
        for _ in range(100):  # loads of aborted requests land and give their blocks back
            if not core.has_unfinished_requests():
                break
            core.step()
        core.check_integrity()
        return itls, x_tokens, stall


@dataclasses.dataclass
class Stall:
    """The engine thread's time in copies (inline) or in waits for one (background), seconds."""

    seconds: float = 0.0
    num_offload_waits: int = 0
    num_load_waits: int = 0

    def __iadd__(self, other: Stall) -> Stall:
        self.seconds += other.seconds
        self.num_offload_waits += other.num_offload_waits
        self.num_load_waits += other.num_load_waits
        return self


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded)")
    parser.add_argument("--prefix-len", type=int, default=1024, help="tokens of X's host-cached prefix and of Y")
    parser.add_argument("--tail-len", type=int, default=16, help="X's uncached tokens after the prefix")
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--decoder-prompt-len", type=int, default=32)
    parser.add_argument("--decoder-tokens", type=int, default=96)
    parser.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens (the prefill chunk)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-threads", type=int, default=0, help="engine threads (0: the engine's default)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    bench = Bench(load_model(args.model), args)
    itls: dict[str, list[float]] = {mode: [] for mode in MODES}
    outputs: dict[str, list[list[int]]] = {mode: [] for mode in MODES}
    stalls = {mode: Stall() for mode in MODES}
    for _ in range(args.rounds):
        prompts = {"x": bench.tokens(args.prefix_len), "x_tail": bench.tokens(args.tail_len),
                   "push1": bench.tokens(args.prefix_len), "push2": bench.tokens(args.prefix_len),
                   "push3": bench.tokens(args.prefix_len),
                   "y": bench.tokens(args.prefix_len),
                   "decoders": [bench.tokens(args.decoder_prompt_len) for _ in range(args.decoders)]}
        for mode in MODES:  # same prompts, alternating, so drift hits both alike
            round_itls, x_tokens, stall = bench.round(mode, prompts)
            itls[mode] += round_itls
            stalls[mode] += stall
            outputs[mode].append(x_tokens)
    print(f"{os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after (1 min)")
    print(f"X: {args.prefix_len} host-cached + {args.tail_len} tokens; Y: {args.prefix_len} fresh tokens; "
          f"{args.decoders} decoders; chunk {args.chunk}; block size {args.block_size}; device pool "
          f"{bench.num_blocks} blocks; {args.rounds} rounds\n")
    base = percentile(itls["inline"], 0.99)
    print("| copies | ITL p50 (ms) | ITL p99 (ms) | p99 / inline | ITL max (ms) | engine thread in copies (ms) "
          "| waits (offload / load) | greedy X equal |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for mode in MODES:
        stall, p99 = stalls[mode], percentile(itls[mode], 0.99)
        print(f"| {mode} | {statistics.median(itls[mode]) * 1000:.1f} | {p99 * 1000:.1f} | {p99 / base:.2f}x "
              f"| {max(itls[mode]) * 1000:.1f} | {stall.seconds * 1000:.1f} | {stall.num_offload_waits} / "
              f"{stall.num_load_waits} | {'yes' if outputs[mode] == outputs['inline'] else 'NO'} |")
    for core in bench.cores.values():
        core.close()


if __name__ == "__main__":
    main()
