"""Prefix-cache benchmark: TTFT by the tier a cached prefix comes from, and a multi-turn chat replay.

    python -m loadtests.bench_prefix [--model PATH] [--prompt-len 2000] [--cached-len 1900]
    pdserve bench prefix ...

One process, one run, the real engine (``EngineCore``) on the default model. A ``--prompt-len``
prompt whose first ``--cached-len`` tokens are cached

- on device: the same engine ran a prompt with that prefix just before;
- on host: that prompt was then pushed off the device by two others (host tier large enough);
- in the kvstore: the same, with two more prompts pushing it off a host tier of one prompt's
  blocks, on to a real ``pdserve serve kvstore --transfer nixl`` process (started here, loopback)
  through the worker's ``KVStoreTier`` (loaded back through host slots), twice: one engine whose
  tier loads over NIXL (PrepareRead, a one-sided READ into its staging region, Release), one
  whose tier loads over gRPC ``Get``; the row says which transport moved the bytes;
- not at all: a fresh prefix (the miss, the baseline of every ratio).

Each case uses its own random prefix and a fresh engine state, and its greedy output is compared
with the same prompt recomputed from scratch (``greedy-equal``). TTFT is the wall time from
``add_request`` to the first output token, engine stepped in this thread; each number is the
best of ``--rounds``. Then the chat replay: every turn resends the whole conversation (system
prompt, every user turn, every generated answer) and the share of prompt tokens served from the
prefix cache is printed per turn and overall.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable

from engine.args import EngineArgs
from engine.config import Role
from engine.core import EngineCore
from engine.kv_cache.hashing import hash_request_blocks
from engine.kv_transfer.base import KVCompat
from engine.mathutils import cdiv
from engine.models.loader import LoadedModel, load_model
from engine.sampling_params import SamplingParams
from services.worker.kvstore_tier import KVStoreTier, KVStoreTierConfig

CPU_FLAGS = ("avx", "avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile", "fma")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
FILLER = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
CHAT_SYSTEM_LEN, CHAT_USER_LEN, CHAT_ANSWER_LEN = 200, 60, 40  # tokens
KVSTORE_TRANSFERS = ("auto", "grpc")  # auto: NIXL when an agent starts in this process
CASES = ("none", "device", "host", "kvstore:auto", "kvstore:grpc")


def run(core: EngineCore, prompt: list[int], params: SamplingParams, request_id: str) -> tuple[float, list[int], int]:
    """(TTFT s, output tokens, prompt tokens served from cache) of ``prompt`` run alone."""
    start = time.perf_counter()
    core.add_request(request_id, prompt, params)
    ttft, tokens, num_cached = 0.0, [], -1
    for _ in range(10_000):
        if not core.has_unfinished_requests():
            break
        for output in core.step():
            if output.new_token_ids and not tokens:
                ttft = time.perf_counter() - start
            tokens += output.new_token_ids
            num_cached = output.num_cached_tokens
    return ttft, tokens, num_cached


class Bench:
    def __init__(self, loaded: LoadedModel, args: argparse.Namespace, kvstore_address: str) -> None:
        self.loaded, self.args, self.rng = loaded, args, random.Random(0)
        self.ids = iter(range(10**9))
        block_bytes = 2 * loaded.config.num_layers * args.block_size * loaded.config.num_kv_heads \
            * loaded.config.head_dim * 4
        num_prompt_blocks = cdiv(args.prompt_len + (GREEDY.max_tokens or 0), args.block_size)
        chat_len = CHAT_SYSTEM_LEN + args.chat_turns * (CHAT_USER_LEN + CHAT_ANSWER_LEN)
        self.device = self.engine(max(num_prompt_blocks, cdiv(chat_len, args.block_size)) + 16, 0.0)
        host_gib = (3 * num_prompt_blocks) * block_bytes / 2**30
        self.host = self.engine(num_prompt_blocks + 16, host_gib)
        self.tiers: dict[str, KVStoreTier] = {}
        self.kvstore: dict[str, EngineCore] = {}
        for transfer in KVSTORE_TRANSFERS:
            tier = KVStoreTier(KVStoreTierConfig(kvstore_address, lookup_budget_s=args.lookup_ms / 1000,
                                                 load_budget_s=30.0, max_queued_blocks=4096,
                                                 transfer=transfer, staging_blocks=num_prompt_blocks))
            # A host tier that holds one prompt's blocks (the kvstore's continuation is staged there).
            core = self.engine(num_prompt_blocks + 16, (num_prompt_blocks + 8) * block_bytes / 2**30, tier)
            tier.start(KVCompat.from_kv_cache(loaded.config.name, core.kv_cache))
            self.tiers[transfer], self.kvstore[transfer] = tier, core
        for core in (self.device, self.host, *self.kvstore.values()):  # first-forward costs out of the numbers
            self._run(core, self.tokens(2 * args.block_size))
            core.reset_prefix_cache()

    def engine(self, num_blocks: int, host_gib: float, lower: KVStoreTier | None = None) -> EngineCore:
        engine_args = EngineArgs(block_size=self.args.block_size, num_kv_blocks=num_blocks,
                                 max_num_batched_tokens=2048, cpu_offload_gb=host_gib,
                                 num_threads=self.args.num_threads)
        return EngineCore(engine_args.build(self.loaded.config, Role.COLOCATED), self.loaded, lower_tier=lower)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.loaded.config.vocab_size - 100) for _ in range(n)]

    def prompts(self) -> tuple[list[int], list[int]]:
        """(a warm-up prompt, the measured prompt): the same ``--cached-len`` prefix, other tails."""
        prefix, tail = self.tokens(self.args.cached_len), self.args.prompt_len - self.args.cached_len
        return prefix + self.tokens(tail), prefix + self.tokens(tail)

    def _run(self, core: EngineCore, prompt: list[int],
             params: SamplingParams = GREEDY) -> tuple[float, list[int], int]:
        return run(core, prompt, params, f"r{next(self.ids)}")

    def push_out(self, core: EngineCore, num_prompts: int) -> None:
        """Unrelated prompts, so that everything cached before leaves the device (2) and the
        host tier too (4, with the kvstore case's host of one prompt's blocks)."""
        for _ in range(num_prompts):
            self._run(core, self.tokens(self.args.prompt_len), FILLER)

    def case(self, case: str) -> tuple[float, int, bool, float]:
        """(TTFT s, cached tokens, greedy-equal, s of it in the kvstore tier's ``load``) of one
        measured prompt cached as ``case`` says (one of CASES: a tier, and for the kvstore the
        tier's transfer setting)."""
        warm, prompt = self.prompts()
        tier, _, transfer = case.partition(":")
        core = {"device": self.device, "host": self.host, "none": self.device}.get(tier) \
            or self.kvstore[transfer]
        if tier != "none":
            self._run(core, warm)
        if tier in ("host", "kvstore"):
            self.push_out(core, 2 if tier == "host" else 4)
        counters = self.tiers[transfer].counters if tier == "kvstore" else None
        if counters is not None:
            self.wait_in_kvstore(self.tiers[transfer], prompt)
        load_s_before = counters.nixl_load_s + counters.grpc_load_s if counters is not None else 0.0
        ttft, tokens, num_cached = self._run(core, prompt)
        load_s = counters.nixl_load_s + counters.grpc_load_s - load_s_before if counters is not None else 0.0
        self.device.reset_prefix_cache()
        _, expected, _ = self._run(self.device, prompt)  # recomputed from scratch
        self.device.reset_prefix_cache()
        return ttft, num_cached, tokens == expected, load_s

    def wait_in_kvstore(self, tier: KVStoreTier, prompt: list[int], timeout_s: float = 120.0) -> None:
        hashes = hash_request_blocks(prompt[:self.args.cached_len], self.args.block_size)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and tier.match(hashes) < len(hashes):
            time.sleep(0.05)

    def chat(self, num_turns: int, user_len: int, answer_len: int) -> list[tuple[int, int]]:
        """[(prompt tokens, of which served from cache) per turn] of a replayed conversation."""
        self.device.reset_prefix_cache()
        conversation = self.tokens(CHAT_SYSTEM_LEN)
        params = SamplingParams(temperature=0.0, max_tokens=answer_len, ignore_eos=True)
        turns = []
        for _ in range(num_turns):
            conversation += self.tokens(user_len)
            _, answer, num_cached = self._run(self.device, conversation, params)
            turns.append((len(conversation), num_cached))
            conversation += answer
        return turns


def start_kvstore(port: int, gib: float) -> subprocess.Popen[str]:
    """``pdserve serve kvstore`` on loopback; returns once it printed its listening line."""
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "kvstore", "--port", str(port),
                             "--transfer", "nixl", "--kvstore-gib", str(gib)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for _ in range(50):  # its first lines are at most a warning and the listening line
        line = proc.stdout.readline()
        if not line or line.startswith("listening on"):
            break
    if proc.poll() is not None:
        raise RuntimeError(f"pdserve serve kvstore exited with {proc.returncode}")
    return proc


def cpu_flags() -> str:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return " ".join(sorted(set(flags) & set(CPU_FLAGS)))


def best_of(rounds: int, fn: Callable[[], tuple[float, int, bool, float]]) -> tuple[float, int, bool, float]:
    results = [fn() for _ in range(rounds)]
    return (min(r[0] for r in results), min(r[1] for r in results), all(r[2] for r in results),
            min(r[3] for r in results))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded)")
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--cached-len", type=int, default=1900)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-threads", type=int, default=0, help="engine threads (0: the engine's default)")
    parser.add_argument("--lookup-ms", type=float, default=50.0, help="the kvstore tier's lookup budget")
    parser.add_argument("--kvstore-port", type=int, default=50981)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--chat-turns", type=int, default=8)
    args = parser.parse_args(argv)
    if not 0 < args.cached_len < args.prompt_len:
        parser.error("need 0 < --cached-len < --prompt-len")
    load_before = os.getloadavg()
    store = start_kvstore(args.kvstore_port, 1.0)
    try:
        bench = Bench(load_model(args.model), args, f"127.0.0.1:{args.kvstore_port}")
        cases = {case: best_of(args.rounds, lambda c=case: bench.case(c)) for case in CASES}
        turns = bench.chat(args.chat_turns, user_len=CHAT_USER_LEN, answer_len=CHAT_ANSWER_LEN)
        moved = {transfer: (tier.counters.num_nixl_loaded_bytes, tier.counters.num_grpc_loaded_bytes)
                 for transfer, tier in bench.tiers.items()}
        for tier in bench.tiers.values():
            tier.close()
    finally:
        store.terminate()
        store.wait(10)
    print(f"CPU flags: {cpu_flags()}; {os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after (1 min)")
    print(f"prompt {args.prompt_len} tokens, first {args.cached_len} cached; block size {args.block_size}; "
          f"best of {args.rounds}; kvstore lookup budget {args.lookup_ms} ms\n")
    miss = cases["none"][0]
    print("| cached on | TTFT (ms) | miss / this | cached tokens | greedy-equal | of TTFT: kvstore load (ms) |")
    print("|---|---:|---:|---:|---|---:|")
    for case, (ttft, num_cached, equal, load_s) in cases.items():
        tier, _, transfer = case.partition(":")
        if transfer:  # name the transport by the bytes it moved, not by the setting
            nixl_bytes, grpc_bytes = moved[transfer]
            tier = (f"kvstore over NIXL ({nixl_bytes / 2**20:.0f} MiB in all)" if nixl_bytes and not grpc_bytes else
                    f"kvstore over gRPC ({grpc_bytes / 2**20:.0f} MiB in all)" if grpc_bytes and not nixl_bytes else
                    f"kvstore ({transfer}: NIXL {nixl_bytes} B, gRPC {grpc_bytes} B)")
        load, verdict = (f"{load_s * 1000:.1f}" if transfer else "-"), ("yes" if equal else "NO")
        print(f"| {tier} | {ttft * 1000:.1f} | {miss / ttft:.1f}x | {num_cached} | {verdict} | {load} |")
    print("\n| turn | prompt tokens | from cache | share |")
    print("|---:|---:|---:|---:|")
    for i, (num_prompt, num_cached) in enumerate(turns, 1):
        print(f"| {i} | {num_prompt} | {num_cached} | {num_cached / num_prompt:.1%} |")
    total, cached = sum(t[0] for t in turns), sum(t[1] for t in turns)
    print(f"| all | {total} | {cached} | {cached / total:.1%} |")


if __name__ == "__main__":
    main()
