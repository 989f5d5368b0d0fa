"""KV transfer: the compatibility contract, the packed format, and real transfers between
processes — NIXL agents over UCX (two spawned processes) and the gRPC PushBlocks fallback
(a grpc.aio server in a spawned process, this process as the sender). Bytes are checked exactly.
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from engine.kv_transfer.base import (
    KV_LAYOUT_VERSION,
    KVCompat,
    KVHandshake,
    KVRegion,
    KVTransferError,
    TransferState,
    kv_compat_hash,
)
from engine.kv_transfer.packing import block_bytes_view, iter_chunks, pack_blocks, write_packed_range

MODEL = "tiny-test-model"
# [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]; a block is 128 KiB in fp32.
SHAPE = (48, 4, 2, 16, 4, 64)
SPAWN = mp.get_context("spawn")


def fake_kv_cache(seed: int, shape=SHAPE, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------- contract (in-process, fast)

def test_compat_hash_is_pinned_and_covers_every_field():
    base = dict(model_name="SmolLM2-135M-Instruct", dtype="float32", block_size=16,
                num_layers=30, num_kv_heads=3, head_dim=64, layout_version=KV_LAYOUT_VERSION)
    # Golden value: changing it breaks mixed-version clusters, so bump KV_WIRE_VERSION too.
    assert kv_compat_hash(**base) == (
        "68ac3dd8a45a17a3ad4878c5dd271c9a1615ff712fe0a40a2808429b040d5618")
    changed = {"model_name": "other", "dtype": "bfloat16", "block_size": 32, "num_layers": 31,
               "num_kv_heads": 4, "head_dim": 128, "layout_version": KV_LAYOUT_VERSION + 1}
    hashes = {kv_compat_hash(**{**base, key: value}) for key, value in changed.items()}
    assert len(hashes) == len(changed) and kv_compat_hash(**base) not in hashes


def test_mismatch_error_lists_both_sides_of_each_differing_field():
    local = KVCompat.from_kv_cache(MODEL, torch.zeros(2, 4, 2, 16, 4, 64))
    remote = replace(local, dtype="bfloat16", block_size=32)
    with pytest.raises(KVTransferError) as err:
        local.check_matches(remote, sides=("sender", "receiver"))
    message = str(err.value)
    assert "dtype: sender='float32' receiver='bfloat16'" in message
    assert "block_size: sender=16 receiver=32" in message
    assert "model_name" not in message


def test_handshake_bytes_round_trip_and_reject_garbage():
    handshake = KVHandshake(compat=KVCompat(MODEL, "float16", 16, 2, 1, 8), agent_name="a",
                            region=KVRegion("DRAM", 4096, 0, 7, 512), agent_metadata=b"\x00\xffmd")
    assert KVHandshake.from_bytes(handshake.to_bytes()) == handshake
    with pytest.raises(KVTransferError, match="not a pdserve KV handshake"):
        KVHandshake.from_bytes(b"garbage!")


def test_nixl_connector_without_nixl_fails_at_construction(monkeypatch):
    from engine.kv_transfer.nixl import NixlKVReceiver
    monkeypatch.setitem(sys.modules, "nixl", None)  # what an environment without NIXL sees
    with pytest.raises(KVTransferError, match="NIXL is not usable.*use --transfer grpc"):
        NixlKVReceiver(MODEL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1000, 4096, 10**9])  # unaligned, block-aligned, one chunk
def test_packed_bytes_land_in_destination_blocks(dtype, chunk):
    shape = (6, 2, 2, 4, 2, 8)  # 512 bytes per block in fp32
    src, dst = fake_kv_cache(1, shape, dtype), torch.zeros(shape, dtype=dtype)
    src_ids, dst_ids = [4, 0, 2], [1, 5, 3]
    packed = pack_blocks(src, src_ids)
    assert packed.dtype == torch.uint8 and packed.numel() == 3 * block_bytes_view(src).shape[1]
    assert raw(packed) == raw(src[src_ids])
    for offset, data in iter_chunks(packed, chunk):
        write_packed_range(dst, dst_ids, offset, data)
    assert raw(dst[dst_ids]) == raw(src[src_ids])
    assert not dst[[0, 2, 4]].any()


# ---------------------------------------------------------------- gRPC fallback, two processes

def _grpc_receiver_main(conn, model_name: str) -> None:
    """Spawned: serve KVTransferService over a zeroed cache; report each landing on ``conn``."""
    from services.common.grpc_server import start_grpc_server
    from services.common.pb import kv_pb2_grpc
    from services.common.wire import KV_SERVICE_NAME
    from services.decode.kv_grpc_receiver import KVTransferServicer
    from services.decode.receivers import make_receivers

    async def main() -> None:
        kv_cache = torch.zeros(SHAPE)
        (receiver,) = make_receivers("grpc", model_name, kv_cache)
        server = await start_grpc_server(
            [(kv_pb2_grpc.add_KVTransferServiceServicer_to_server, KVTransferServicer(receiver))],
            service_names=[KV_SERVICE_NAME])
        conn.send(server.port)
        while not conn.poll():
            for note in receiver.completed_requests():
                conn.send_bytes(json.dumps({"request_id": note.request_id, "sender": note.sender,
                                            "dst_block_ids": list(note.dst_block_ids)}).encode())
                conn.send_bytes(raw(kv_cache))
            await asyncio.sleep(0.005)
        await server.stop(0)
        receiver.close()

    asyncio.run(main())


def _spawn_grpc_receiver():
    """A receiver process (``_grpc_receiver_main``) serving: (process, its pipe, address)."""
    from services.common.health import wait_until_serving
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_grpc_receiver_main, args=(child, MODEL), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "receiver process did not start"
        address = f"127.0.0.1:{parent.recv()}"
        asyncio.run(wait_until_serving(address, timeout_s=10))
    except BaseException:
        proc.kill()
        raise
    return proc, parent, address


@pytest.fixture(scope="module")
def grpc_receiver():
    proc, parent, address = _spawn_grpc_receiver()
    try:
        yield address, parent
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _landed(conn, timeout_s: float = 30.0) -> tuple[dict, torch.Tensor]:
    assert conn.poll(timeout_s), "no KVNotification from the receiver"
    note = json.loads(conn.recv_bytes())
    cache = torch.frombuffer(bytearray(conn.recv_bytes()), dtype=torch.float32).view(SHAPE)
    return note, cache


def _grpc_sender(**kwargs):
    from services.prefill.kv_grpc_sender import GrpcKVSender
    sender = GrpcKVSender(MODEL, **kwargs)
    sender.register(fake_kv_cache(seed=7))
    return sender


def _wait(sender, handle, timeout_s: float = 30.0) -> TransferState:
    deadline = time.monotonic() + timeout_s
    while sender.poll(handle) is TransferState.IN_PROGRESS and time.monotonic() < deadline:
        time.sleep(0.002)
    return handle.state


@pytest.mark.parametrize("max_chunk_bytes,src_ids,dst_ids", [
    (50_000, [3, 9, 1], [40, 2, 17]),            # chunks split blocks (128 KiB) unevenly
    (4 * 1024 * 1024, list(range(40)), list(range(47, 7, -1))),  # 5 MiB: two 4 MiB messages
])
@pytest.mark.parametrize("path", ["bytes", "shared-memory", "probe-not-visible"])
def test_grpc_push_blocks_bytes_exact(grpc_receiver, max_chunk_bytes, src_ids, dst_ids, path, tmp_path):
    """The same blocks land whichever way the payload goes: as gRPC bytes (shared memory off),
    through a shared-memory segment (the receiver's probe is readable here, as between two
    workers on one host), or as bytes because the probe is not (the sender looks for it in
    another directory, as a sender on another host would)."""
    from services.prefill.kv_grpc_sender import fetch_remote_handshake
    address, conn = grpc_receiver
    options = {"bytes": {"shared_memory": False}, "shared-memory": {},
               "probe-not-visible": {"shm_dir": tmp_path}}[path]
    sender = _grpc_sender(max_chunk_bytes=max_chunk_bytes, **options)
    try:
        remote = sender.connect(fetch_remote_handshake(address, sender.handshake_info()), address)
        assert remote.handshake.region.num_blocks == SHAPE[0]
        assert remote.handshake.shm_probe  # the receiver offers it
        assert sender.is_shared(address) is (path == "shared-memory")
        for attempt in range(2):  # the second push reuses the first one's segment
            request_id = f"req-{max_chunk_bytes}-{attempt}"
            handle = sender.send_blocks(request_id, src_ids, remote, dst_ids)
            assert _wait(sender, handle) is TransferState.DONE, handle.error
            note, cache = _landed(conn)
            assert note == {"request_id": request_id, "sender": sender.agent_name,
                            "dst_block_ids": dst_ids}
            assert raw(cache[dst_ids]) == raw(fake_kv_cache(seed=7)[src_ids])
        segments = list(Path("/dev/shm").glob(f"{sender._arena._prefix}*")) if sender._arena else []
        assert len(segments) == (1 if path == "shared-memory" else 0), segments
    finally:
        sender.close()
    if sender._arena is not None:
        assert not list(Path("/dev/shm").glob(f"{sender._arena._prefix}*")), "close() left segments"


def test_grpc_push_refuses_a_bad_shared_memory_header(grpc_receiver):
    """A header naming a file that is no pdserve segment, a range past its end, data chunks
    beside a segment: INVALID_ARGUMENT naming it; a segment that is not on this host:
    FAILED_PRECONDITION. Nothing is delivered."""
    from services.common.pb import kv_pb2
    from services.worker.kv_shm import ShmArena
    address, conn = grpc_receiver
    compat = KVCompat.from_kv_cache(MODEL, torch.zeros(SHAPE))
    block_bytes = torch.zeros(SHAPE)[0].numel() * 4
    header = kv_pb2.PushBlocksHeader(request_id="shm-bad", dst_block_ids=[5],
                                     compat_hash=compat.hash, dtype="float32",
                                     block_shape=list(compat.block_shape),
                                     total_bytes=block_bytes, shm_name="../etc/passwd")
    err = _push_raw(address, header, [])
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "'../etc/passwd' is not a pdserve KV segment" in err.details()

    arena = ShmArena()
    segment = arena.acquire(100)  # 1 MiB: smaller than two blocks at an offset
    try:
        header.shm_name, header.shm_offset = segment.name, segment.size - 10
        err = _push_raw(address, header, [])
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f"outside shm segment {segment.name!r} of {segment.size} bytes" in err.details()

        header.shm_offset = 0
        err = _push_raw(address, header, [kv_pb2.PushBlocksChunk(offset=0, data=b"\0" * 8)])
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "carries no data chunks" in err.details()

        header.shm_name = segment.name[:-1] + "999"  # well formed, not there
        err = _push_raw(address, header, [])
        assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "is not readable here" in err.details()
    finally:
        arena.close()
    assert not conn.poll(0.2), "a refused push was delivered"


def test_grpc_handshake_mismatch_names_differing_fields(grpc_receiver):
    from services.common.pb import kv_pb2_grpc
    from services.common.wire import handshake_to_proto
    from services.prefill.kv_grpc_sender import GrpcKVSender, fetch_remote_handshake
    address, _ = grpc_receiver
    other = GrpcKVSender("another-model")
    other.register(torch.zeros(SHAPE[0], SHAPE[1], 2, 8, SHAPE[4], SHAPE[5], dtype=torch.float16))
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
        kv_pb2_grpc.KVTransferServiceStub(channel).Handshake(
            handshake_to_proto(other.handshake_info()), timeout=5)
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    details = err.value.details()
    assert f"model_name: receiver='{MODEL}' sender='another-model'" in details
    assert "dtype: receiver='float32' sender='float16'" in details
    assert "block_size: receiver=16 sender=8" in details
    assert "num_layers" not in details
    with pytest.raises(KVTransferError, match="FAILED_PRECONDITION: KV caches are incompatible"):
        fetch_remote_handshake(address, other.handshake_info())
    other.close()


def test_grpc_handshake_refuses_a_bf16_sender_into_an_fp32_receiver(grpc_receiver):
    # same model, shape and block size; only the storage dtype differs (--kv-cache-dtype bf16)
    from services.prefill.kv_grpc_sender import GrpcKVSender, fetch_remote_handshake
    address, _ = grpc_receiver
    bf16 = GrpcKVSender(MODEL)
    bf16.register(fake_kv_cache(seed=7).bfloat16())
    try:
        with pytest.raises(KVTransferError, match="FAILED_PRECONDITION: KV caches are incompatible") as err:
            fetch_remote_handshake(address, bf16.handshake_info())
    finally:
        bf16.close()
    assert "dtype: receiver='float32' sender='bfloat16'" in str(err.value)
    assert "block_size" not in str(err.value) and "model_name" not in str(err.value)


def _push_raw(address: str, header, chunks=()):
    from services.common.pb import kv_pb2, kv_pb2_grpc
    messages = [kv_pb2.PushBlocksChunk(header=header), *chunks]
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
        kv_pb2_grpc.KVTransferServiceStub(channel).PushBlocks(iter(messages), timeout=5)
    return err.value


def test_grpc_push_rejects_bad_block_ids_and_foreign_hash(grpc_receiver):
    from services.common.pb import kv_pb2
    address, _ = grpc_receiver
    compat = KVCompat.from_kv_cache(MODEL, torch.zeros(SHAPE))
    block_bytes = torch.zeros(SHAPE)[0].numel() * 4
    header = kv_pb2.PushBlocksHeader(request_id="bad", dst_block_ids=[3, 48, 99],
                                     compat_hash=compat.hash, dtype="float32",
                                     block_shape=list(compat.block_shape),
                                     total_bytes=3 * block_bytes)
    err = _push_raw(address, header)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "dst block ids [48, 99] out of range [0, 48)" in err.details()

    header.dst_block_ids[:] = [5, 5, 6]
    assert "repeat" in _push_raw(address, header).details()

    header.dst_block_ids[:] = [5]
    header.total_bytes = block_bytes
    short = _push_raw(address, header, [kv_pb2.PushBlocksChunk(offset=0, data=b"\0" * 100)])
    assert short.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"stream ended after 100 of {block_bytes} bytes" in short.details()

    header.compat_hash = replace(compat, dtype="bfloat16").hash
    foreign = _push_raw(address, header)
    assert foreign.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "compat hash" in foreign.details()


def test_grpc_push_rejects_a_corrupted_payload_by_crc32(grpc_receiver):
    """One flipped byte: DATA_LOSS naming both checksums, and nothing is delivered (the next
    landing the receiver reports is the intact push that follows)."""
    import zlib

    from services.common.pb import kv_pb2
    address, conn = grpc_receiver
    compat = KVCompat.from_kv_cache(MODEL, torch.zeros(SHAPE))
    payload = raw(fake_kv_cache(seed=3)[[4]])
    header = kv_pb2.PushBlocksHeader(request_id="corrupt", dst_block_ids=[4],
                                     compat_hash=compat.hash, dtype="float32",
                                     block_shape=list(compat.block_shape),
                                     total_bytes=len(payload), crc32=zlib.crc32(payload))
    flipped = bytearray(payload)
    flipped[1000] ^= 0xFF
    err = _push_raw(address, header, [kv_pb2.PushBlocksChunk(offset=0, data=bytes(flipped))])
    assert err.code() is grpc.StatusCode.DATA_LOSS
    assert f"!= header crc32 {zlib.crc32(payload):#010x}" in err.details()
    assert "corrupted in transit" in err.details()
    assert not conn.poll(0.2), "a corrupted push was delivered"


def test_grpc_sender_with_corrupt_fault_fails_the_transfer(grpc_receiver, monkeypatch):
    """PDSERVE_FAULTS=kv_transfer:corrupt:1 in the sender's process: the push fails DATA_LOSS."""
    from services.common.faults import faults
    from services.prefill.kv_grpc_sender import fetch_remote_handshake
    address, conn = grpc_receiver
    monkeypatch.setenv("PDSERVE_FAULTS", "kv_transfer:corrupt:1")
    faults.cache_clear()
    sender = _grpc_sender(shared_memory=False)  # bytes in transit: what the fault corrupts
    try:
        remote = sender.connect(fetch_remote_handshake(address, sender.handshake_info()), address)
        handle = sender.send_blocks("faulted", [1, 2], remote, [8, 9])
        assert _wait(sender, handle) is TransferState.FAILED
        assert handle.error.startswith("DATA_LOSS: PushBlocks: payload crc32"), handle.error
        assert not conn.poll(0.2)
    finally:
        sender.close()
        monkeypatch.delenv("PDSERVE_FAULTS")
        faults.cache_clear()
    assert not faults().plan.is_active


def test_grpc_sender_checks_ids(grpc_receiver):
    from services.prefill.kv_grpc_sender import fetch_remote_handshake
    address, _ = grpc_receiver
    sender = _grpc_sender()
    try:
        remote = sender.connect(fetch_remote_handshake(address, sender.handshake_info()), address)
        with pytest.raises(KVTransferError, match=r"destination block ids \[48\] out of range"):
            sender.send_blocks("r", [0], remote, [48])
        with pytest.raises(KVTransferError, match="pair up 1:1"):
            sender.send_blocks("r", [0, 1], remote, [2])
    finally:
        sender.close()


def test_grpc_sender_reports_deadline_from_a_receiver_that_stops_answering():
    """A push to a receiver that has stopped answering fails with DEADLINE_EXCEEDED once
    ``timeout_s`` has passed, through shared memory and as bytes. The receiver is a real one,
    connected to by a first push that lands, then frozen with SIGSTOP. (A live receiver with a
    0.1 ms deadline was a race: on a loaded machine gRPC's deadline timer could fire after the
    one-header shared-memory push had been acked.)"""
    import signal

    from services.prefill.kv_grpc_sender import CLOSE_WAIT_S, fetch_remote_handshake
    proc, parent, address = _spawn_grpc_receiver()
    senders = [_grpc_sender(timeout_s=0.3, shared_memory=shm) for shm in (True, False)]
    try:
        remotes = [s.connect(fetch_remote_handshake(address, s.handshake_info()), address)
                   for s in senders]
        assert [s.is_shared(address) for s in senders] == [True, False]
        for sender, remote in zip(senders, remotes):
            handle = sender.send_blocks("first", [1], remote, [2])
            assert _wait(sender, handle) is TransferState.DONE, handle.error
            assert _landed(parent)[0]["request_id"] == "first"
        os.kill(proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        handles = [s.send_blocks("late", list(range(40)), r, list(range(40)))
                   for s, r in zip(senders, remotes)]
        for sender, handle in zip(senders, handles):
            assert _wait(sender, handle) is TransferState.FAILED
            assert handle.error.startswith("DEADLINE_EXCEEDED"), handle.error
        assert time.monotonic() - started >= 0.3
        closing = time.monotonic()  # gRPC's own close waits for the frozen receiver
        for sender in senders:
            sender.close()
        assert time.monotonic() - closing < 2 * CLOSE_WAIT_S + 1
    finally:
        proc.kill()
        proc.join(10)
        for sender in senders:
            sender.close()


# ---------------------------------------------------------------- NIXL, two processes

NIXL_CASES = {  # UCX environment, and how the receiver's handshake reaches the sender
    # cma (cross-memory attach) for the writes, tcp on loopback for the notifications;
    # handshake over the real KVTransferService.Handshake RPC, as the workers will do it.
    "default-ucx/grpc-handshake": ({"UCX_NET_DEVICES": "lo"}, "grpc"),
    # everything over loopback TCP; handshake as KVHandshake.to_bytes() through a pipe.
    "tcp-ucx/bytes-handshake": ({"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}, "bytes"),
}
NIXL_TRANSFERS = [  # (request id, src block ids, dst block ids)
    ("req-a", [0, 1, 2], [30, 31, 32]),  # req-a in two chunks, as chunked prefill sends it
    ("req-a", [3], [10]),
    ("req-b", [47, 5, 20, 21], [0, 7, 3, 46]),
]


@functools.cache
def nixl_import_error() -> str | None:
    """Why ``import nixl`` fails, or None. Probed in a child so this process never loads
    NIXL's bundled libprotobuf/libgrpc next to the ones grpc and protoc use."""
    probe = subprocess.run([sys.executable, "-c", "import nixl._api"], capture_output=True,
                           text=True)
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["?"])[-1]


def _nixl_receiver_main(conn, env: dict[str, str]) -> None:
    """Spawned: a NIXL receiver whose handshake is served by KVTransferService and sent raw."""
    os.environ.update(env)
    from services.common.grpc_server import start_grpc_server
    from services.common.pb import kv_pb2_grpc
    from services.decode.kv_grpc_receiver import KVTransferServicer
    from services.decode.receivers import make_receivers

    async def main() -> None:
        kv_cache = torch.zeros(SHAPE)
        fallback, receiver = make_receivers("nixl", MODEL, kv_cache)
        servicer = KVTransferServicer(fallback, handshake_source=receiver)
        server = await start_grpc_server(
            [(kv_pb2_grpc.add_KVTransferServiceServicer_to_server, servicer)])
        conn.send(server.port)
        conn.send_bytes(receiver.handshake_info().to_bytes())
        notes, deadline = [], time.monotonic() + 60
        while len(notes) < len(NIXL_TRANSFERS) and time.monotonic() < deadline:
            notes += [{"request_id": n.request_id, "dst_block_ids": list(n.dst_block_ids),
                       "sender": n.sender} for n in receiver.completed_requests()]
            await asyncio.sleep(0.001)
        conn.send_bytes(json.dumps(notes).encode())
        conn.send_bytes(raw(kv_cache))
        while not conn.poll():  # keep the registered memory alive until the parent has read it
            await asyncio.sleep(0.01)
        await server.stop(0)
        receiver.close()
        fallback.close()

    asyncio.run(main())


def _nixl_sender_main(conn, env: dict[str, str]) -> None:
    os.environ.update(env)
    from engine.kv_transfer.nixl import NixlKVSender
    from services.prefill.kv_grpc_sender import fetch_remote_handshake
    sender = NixlKVSender(MODEL)
    sender.register(fake_kv_cache(seed=11))
    how, payload = conn.recv()
    remote_handshake = (fetch_remote_handshake(payload, sender.handshake_info()) if how == "grpc"
                        else KVHandshake.from_bytes(payload))
    remote = sender.connect(remote_handshake)
    handles = [sender.send_blocks(rid, src, remote, dst) for rid, src, dst in NIXL_TRANSFERS]
    deadline = time.monotonic() + 60
    while (any(sender.poll(h) is TransferState.IN_PROGRESS for h in handles)
           and time.monotonic() < deadline):
        time.sleep(0.001)
    try:
        sender.send_blocks("bad", [0], remote, [SHAPE[0]])
        bad = "accepted"
    except KVTransferError as exc:
        bad = str(exc)
    conn.send({"agent": sender.agent_name, "states": [h.state.value for h in handles],
               "errors": [h.error for h in handles], "bad": bad})
    conn.recv()
    sender.close()


@pytest.mark.slow  # two fresh processes importing torch + NIXL: ~10 s on the shared 2-core box
@pytest.mark.parametrize("case", sorted(NIXL_CASES))
def test_nixl_write_between_two_processes(case):
    if nixl_import_error() is not None:
        pytest.skip(f"NIXL is not importable here: {nixl_import_error()}")
    env, how = NIXL_CASES[case]
    recv_conn, recv_child = SPAWN.Pipe()
    send_conn, send_child = SPAWN.Pipe()
    procs = [SPAWN.Process(target=_nixl_receiver_main, args=(recv_child, env), daemon=True),
             SPAWN.Process(target=_nixl_sender_main, args=(send_child, env), daemon=True)]
    for proc in procs:
        proc.start()
    try:
        assert recv_conn.poll(60), "NIXL receiver did not start"
        address = f"127.0.0.1:{recv_conn.recv()}"
        handshake_bytes = recv_conn.recv_bytes()
        send_conn.send((how, address if how == "grpc" else handshake_bytes))
        assert send_conn.poll(90), "NIXL sender did not finish"
        result = send_conn.recv()
        assert recv_conn.poll(60), "NIXL receiver did not report"
        notes = json.loads(recv_conn.recv_bytes())
        cache = torch.frombuffer(bytearray(recv_conn.recv_bytes()), dtype=torch.float32).view(SHAPE)
        for conn in (recv_conn, send_conn):
            conn.send("done")
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    assert result["states"] == ["done"] * len(NIXL_TRANSFERS), result["errors"]
    assert "destination block ids [48] out of range [0, 48)" in result["bad"]
    assert sorted(notes, key=lambda n: n["dst_block_ids"]) == sorted(
        [{"request_id": rid, "dst_block_ids": dst, "sender": result["agent"]}
         for rid, _, dst in NIXL_TRANSFERS], key=lambda n: n["dst_block_ids"])
    src = fake_kv_cache(seed=11)
    written = set()
    for _, src_ids, dst_ids in NIXL_TRANSFERS:
        assert raw(cache[dst_ids]) == raw(src[src_ids])
        written |= set(dst_ids)
    untouched = [b for b in range(SHAPE[0]) if b not in written]
    assert not cache[untouched].any()
