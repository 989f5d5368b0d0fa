"""KV transfer bandwidth between two processes, NIXL and gRPC, against memcpy in one run.

    python -m loadtests.bench_kv_transfer [--blocks 8,64,256] [--repeats 5] [--methods ...]
    pdserve bench kv [...]

Geometry: the default model's KV cache (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64,
block 16, fp32 = 737,280 bytes per block). For each transfer size a sender process moves
the same scattered source blocks into scattered destination blocks of a receiver process,
with the project's connectors set up as the workers set them up (register the cache once,
handshake over ``KVTransferService.Handshake``, ``send_blocks``, ``poll``):

    nixl-lo   NixlKVSender -> NixlKVReceiver with UCX_NET_DEVICES=lo; UCX picks the
              transports (on one host: cma for the data, tcp for the notification)
    nixl-tcp  the same with UCX_TLS=tcp: the data goes over loopback TCP too
    grpc      GrpcKVSender -> KVTransferServicer.PushBlocks, no NIXL loaded: on one host the
              payload through a shared-memory segment, its name over gRPC (the default)
    grpc-bytes  the same with ``--kv-shared-memory off``: the bytes in 4 MiB messages

Set ``UCX_PROTO_INFO=y`` to have UCX print which transport each NIXL pair used.

Time is taken in the sender, from ``send_blocks`` to ``poll() == DONE``: NIXL's WRITE has
completed at the target; the gRPC receiver has written every byte and acked (the time
includes the sender's gather). The first send of each size is a warm-up; the table shows the
median of the timed ones. Baseline, in this process on one thread: a memcpy of the same bytes
(a plain tensor copy, the 1.00x row) and a gather of the same blocks into a packed buffer
(``index_select``, what the gRPC sender does first). Checked once per method and size: the
sha256 of the destination blocks (zero before) equals that of the source blocks, blocks that
were not written are still zero, and each send's notification names its request and blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace

import torch

from engine.config import CacheConfig, ModelConfig
from engine.kv_cache.storage import allocate_kv_cache, bytes_per_block
from engine.kv_transfer.base import TransferState
from engine.kv_transfer.packing import block_bytes_view, pack_blocks

# SmolLM2-135M-Instruct, the default model (see DESIGN.md); only the KV shape matters here.
MODEL_CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                           intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                           head_dim=64, name="SmolLM2-135M-Instruct")
CACHE_CONFIG = CacheConfig(block_size=16, dtype="float32")
BLOCK_BYTES = bytes_per_block(MODEL_CONFIG, CACHE_CONFIG)
SOURCE_SEED = 11
SEND_TIMEOUT_S = 60.0
REPLY_TIMEOUT_S = 120.0
SPAWN = mp.get_context("spawn")
Plan = dict[int, tuple[list[int], list[int]]]  # transfer size -> (src block ids, dst block ids)


@dataclass(frozen=True)
class Method:
    """A transport and the UCX environment both of its processes start with."""

    label: str
    transport: str  # "nixl" | "grpc"
    env: tuple[tuple[str, str], ...] = ()


METHODS = {
    "nixl-lo": Method("nixl UCX lo", "nixl", (("UCX_NET_DEVICES", "lo"),)),
    "nixl-tcp": Method("nixl UCX tcp", "nixl", (("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo"))),
    "grpc": Method("grpc PushBlocks shm", "grpc"),
    "grpc-bytes": Method("grpc PushBlocks bytes", "grpc", (("PDSERVE_KV_SHARED_MEMORY", "off"),)),
}


def _shared_memory(env: dict[str, str]) -> bool:
    """The workers' ``--kv-shared-memory``, from the method's environment."""
    return env.get("PDSERVE_KV_SHARED_MEMORY", "auto") != "off"


@dataclass
class Row:
    method: str
    num_blocks: int
    seconds: list[float] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.num_blocks * BLOCK_BYTES / statistics.median(self.seconds) / 1e9


def kv_cache_for(num_blocks: int) -> torch.Tensor:
    """A zeroed cache [num_blocks, 30, 2, 16, 3, 64] fp32, allocated as the engine does."""
    return allocate_kv_cache(MODEL_CONFIG, replace(CACHE_CONFIG, num_blocks=num_blocks))


def random_kv_cache(num_blocks: int) -> torch.Tensor:
    """Written on every page: reading untouched zero pages would flatter the copies."""
    return kv_cache_for(num_blocks).normal_(generator=torch.Generator().manual_seed(SOURCE_SEED))


def digest(kv_cache: torch.Tensor, block_ids: list[int]) -> str:
    """sha256 of the packed bytes of ``kv_cache[block_ids]``, in list order."""
    return hashlib.sha256(pack_blocks(kv_cache, block_ids).numpy()).hexdigest()


def make_plan(sizes: list[int]) -> tuple[int, Plan]:
    """(num_blocks per cache, {size: (src block ids, dst block ids)}): scattered ids, as a
    block pool hands them out; destinations of different sizes do not overlap."""
    num_blocks = max(2 * max(sizes), sum(sizes))
    gen = torch.Generator().manual_seed(0)
    src_order = torch.randperm(num_blocks, generator=gen).tolist()
    dst_order = torch.randperm(num_blocks, generator=gen).tolist()
    plan, start = {}, 0
    for n in sizes:
        plan[n] = (src_order[:n], dst_order[start:start + n])
        start += n
    return num_blocks, plan


def _receiver_main(conn, transport: str, env: dict[str, str], num_blocks: int) -> None:
    """Serve KVTransferService over a zeroed cache; answer ("landed", ...) and ("stop",)."""
    os.environ.update(env)
    from services.common.grpc_server import start_grpc_server
    from services.common.pb import kv_pb2_grpc
    from services.decode.kv_grpc_receiver import KVTransferServicer
    from services.decode.receivers import make_receivers

    async def main() -> None:
        kv_cache = kv_cache_for(num_blocks)
        receivers = make_receivers(transport, MODEL_CONFIG.name, kv_cache,  # (gRPC, NIXL?)
                                   _shared_memory(env))
        receiver = receivers[-1]
        servicer = KVTransferServicer(receivers[0], handshake_source=receiver)
        server = await start_grpc_server(
            [(kv_pb2_grpc.add_KVTransferServiceServicer_to_server, servicer)])
        conn.send(server.port)
        notes = []
        while True:
            notes += receiver.completed_requests()
            if not conn.poll():
                await asyncio.sleep(0.001)
                continue
            command, *args = conn.recv()
            if command == "stop":
                break
            num_sends, dst_ids, written_ids = args
            deadline = time.monotonic() + 10
            while len(notes) < num_sends and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
                notes += receiver.completed_requests()
            nonzero = torch.count_nonzero(kv_cache.view(torch.int32).view(num_blocks, -1), dim=1)
            nonzero[written_ids] = 0
            untouched_zero = not nonzero.any()
            conn.send(([(n.request_id, list(n.dst_block_ids), n.sender) for n in notes],
                       digest(kv_cache, dst_ids), untouched_zero))
            notes = []
        await server.stop(0)
        for each in receivers:
            each.close()

    asyncio.run(main())


def _sender_main(conn, transport: str, env: dict[str, str], num_blocks: int) -> None:
    """Connect to the receiver at the address sent first; answer ("send", ...),
    ("digest", ids) and ("stop",)."""
    os.environ.update(env)
    from services.common.wire import TRANSFER_METHODS
    from services.prefill.kv_grpc_sender import fetch_remote_handshake
    from services.prefill.pusher import sender_factories
    kv_cache = random_kv_cache(num_blocks)
    sender = sender_factories(transport, MODEL_CONFIG.name,
                              _shared_memory(env))[TRANSFER_METHODS[transport]]()
    sender.register(kv_cache)
    address = conn.recv()
    remote = sender.connect(fetch_remote_handshake(address, sender.handshake_info()), address)
    conn.send(sender.agent_name)
    while True:
        command, *args = conn.recv()
        if command == "stop":
            break
        if command == "digest":
            conn.send(digest(kv_cache, args[0]))
            continue
        request_id, src_ids, dst_ids = args
        start = time.perf_counter()
        handle = sender.send_blocks(request_id, src_ids, remote, dst_ids)
        while (sender.poll(handle) is TransferState.IN_PROGRESS
               and time.perf_counter() - start < SEND_TIMEOUT_S):
            time.sleep(0.0001)  # lets the gRPC push thread run
        conn.send((time.perf_counter() - start, handle.state.value, handle.error))
    sender.close()


def _reply(conn, proc, what: str):
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while not conn.poll(0.05):
        if not proc.is_alive():
            raise RuntimeError(f"the {what} process exited with code {proc.exitcode} "
                               "(its traceback is above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {what} process did not answer in {REPLY_TIMEOUT_S:.0f} s")
    return conn.recv()


def run_method(key: str, num_blocks: int, plan: Plan, repeats: int,
               max_seconds: float) -> list[Row]:
    """Spawn a receiver and a sender for ``METHODS[key]``, time every size, check the bytes."""
    method = METHODS[key]
    env = dict(method.env)
    conns, procs = {}, {}
    for role, target in (("receiver", _receiver_main), ("sender", _sender_main)):
        conns[role], child = SPAWN.Pipe()
        procs[role] = SPAWN.Process(target=target, args=(child, method.transport, env, num_blocks),
                                    daemon=True)
        procs[role].start()

    def ask(role: str, *message):
        conns[role].send(message)
        return _reply(conns[role], procs[role], f"{key} {role}")

    rows, written = [], []
    try:
        port = _reply(conns["receiver"], procs["receiver"], f"{key} receiver")
        conns["sender"].send(f"127.0.0.1:{port}")
        agent_name = _reply(conns["sender"], procs["sender"], f"{key} sender")
        for n, (src_ids, dst_ids) in plan.items():
            row, request_ids = Row(method.label, n), []
            stop_at = time.perf_counter() + max_seconds
            for i in range(1 + repeats):  # send 0 is the warm-up
                request_ids.append(f"{key}-{n}-{i}")
                seconds, state, error = ask("sender", "send", request_ids[-1], src_ids, dst_ids)
                if state != TransferState.DONE.value:
                    raise RuntimeError(f"{key}: send of {n} blocks ended {state}: {error}")
                if i > 0:
                    row.seconds.append(seconds)
                    if time.perf_counter() > stop_at:
                        break
            written += dst_ids
            notes, landed, untouched_zero = ask("receiver", "landed", len(request_ids), dst_ids,
                                                written)
            expected = [(rid, dst_ids, agent_name) for rid in request_ids]
            if sorted(notes) != sorted(expected):
                raise RuntimeError(f"{key}: notifications {notes[:3]}... != expected {expected[:3]}...")
            sent = ask("sender", "digest", src_ids)
            if landed != sent or not untouched_zero:
                raise RuntimeError(f"{key}: the bytes of {n} blocks did not land exactly "
                                   f"(sha256 sent {sent[:12]}, landed {landed[:12]}; "
                                   f"unwritten blocks still zero: {untouched_zero})")
            rows.append(row)
    finally:
        for role in ("sender", "receiver"):
            if procs[role].is_alive():
                conns[role].send(("stop",))
            procs[role].join(10)
            if procs[role].is_alive():
                procs[role].kill()
    return rows


def memcpy_rows(num_blocks: int, plan: Plan, repeats: int) -> list[Row]:
    """One-thread copies of the same bytes in this process: plain copy, then block gather."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cache = block_bytes_view(random_kv_cache(num_blocks))  # uint8 [num_blocks, BLOCK_BYTES]
    rows = []
    try:
        for n, (src_ids, _) in plan.items():
            index = torch.tensor(src_ids)
            out = torch.empty(n, BLOCK_BYTES, dtype=torch.uint8)
            copies = {"memcpy (copy)": functools.partial(out.copy_, cache[:n]),
                      "memcpy (gather)": functools.partial(torch.index_select, cache, 0, index, out=out)}
            for label, copy in copies.items():
                row = Row(label, n)
                for i in range(1 + repeats):  # the first touches the output's pages
                    start = time.perf_counter()
                    copy()
                    if i > 0:
                        row.seconds.append(time.perf_counter() - start)
                if not torch.equal(out, cache[index] if "gather" in label else cache[:n]):
                    raise RuntimeError(f"{label} of {n} blocks copied the wrong bytes")
                rows.append(row)
    finally:
        torch.set_num_threads(threads)
    return rows


def nixl_import_error() -> str | None:
    """Why ``import nixl`` fails, or None; probed in a child (this process never loads NIXL)."""
    probe = subprocess.run([sys.executable, "-c", "import nixl._api"], capture_output=True,
                           text=True)
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["?"])[-1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", default="8,64,256", help="transfer sizes, in blocks")
    parser.add_argument("--repeats", type=int, default=7, help="timed sends per size (at most)")
    parser.add_argument("--max-seconds", type=float, default=4.0,
                        help="stop repeating a size after this long (at least one timed send)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"of {','.join(METHODS)}")
    args = parser.parse_args(argv)
    sizes = sorted({int(b) for b in args.blocks.split(",")})
    keys = args.methods.split(",")
    unknown = [k for k in keys if k not in METHODS]
    if unknown or not sizes or min(sizes) < 1 or args.repeats < 1:
        parser.error(f"--methods must be of {list(METHODS)} (got {unknown}), --blocks and "
                     "--repeats positive")
    if any(METHODS[k].transport == "nixl" for k in keys) and (why := nixl_import_error()):
        print(f"skipping NIXL: it is not importable here ({why})")
        keys = [k for k in keys if METHODS[k].transport != "nixl"]

    num_blocks, plan = make_plan(sizes)
    started = time.perf_counter()
    rows = memcpy_rows(num_blocks, plan, args.repeats)
    for key in keys:
        rows += run_method(key, num_blocks, plan, args.repeats, args.max_seconds)

    print(f"KV of {MODEL_CONFIG.name}: {BLOCK_BYTES:,} bytes per block ({MODEL_CONFIG.num_layers} "
          f"layers x K,V x {CACHE_CONFIG.block_size} tokens x {MODEL_CONFIG.num_kv_heads} heads x "
          f"{MODEL_CONFIG.head_dim} x {CACHE_CONFIG.dtype}); caches of {num_blocks} blocks; "
          f"scattered block ids; median of timed sends after one warm-up; memcpy on one thread; "
          f"bytes checked for every method and size; {time.perf_counter() - started:.0f} s, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'method':21s} {'blocks':>6s} {'MB':>7s} {'GB/s':>7s} {'x memcpy':>9s} {'runs':>5s}")
    baseline = {r.num_blocks: r.gbps for r in rows if r.method == "memcpy (copy)"}
    for n in sizes:
        for row in (r for r in rows if r.num_blocks == n):
            print(f"{row.method:21s} {n:6d} {n * BLOCK_BYTES / 1e6:7.1f} {row.gbps:7.2f} "
                  f"{row.gbps / baseline[n]:8.3f}x {len(row.seconds):5d}")


if __name__ == "__main__":
    main()
