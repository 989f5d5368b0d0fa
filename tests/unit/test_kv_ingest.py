"""The gRPC push's two ends in engine/: the sender's gather (packing.py ``gather_blocks``: the
payload ``pack_blocks`` gives, on CUDA gathered on a side stream into pinned memory after what
the engine's stream queued) and the receiver's chunk writer (ingest.py): chunks of any size land
in the destination blocks and nowhere else, with the payload's crc32, from several threads at
once. On the CPU through numpy; where CUDA is present again through pinned staging on side
streams, with chunks larger than the staging buffer (marked ``gpu``; skipped with the reason
elsewhere)."""

from __future__ import annotations

import threading
import zlib

import pytest
import torch

from engine.kv_transfer.ingest import ChunkWriter
from engine.kv_transfer.packing import gather_blocks, iter_chunks, pack_blocks

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SHAPE = (12, 2, 2, 4, 2, 8)  # [blocks, K/V, layers, block_size, kv_heads, head_dim]: 512 bytes of fp32 per block


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[GPU, pytest.mark.gpu])])
def device(request):
    return request.param


def source_cache(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(3)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [700, 1024, 10**6])  # unaligned, block-aligned, all at once
def test_chunks_land_in_the_destination_blocks_with_the_payloads_crc(device, dtype, chunk):
    src = source_cache(dtype)
    dst = torch.zeros(SHAPE, dtype=dtype, device=device)
    src_ids, dst_ids = [4, 0, 2, 7], [1, 5, 3, 11]
    packed = pack_blocks(src, src_ids)
    writer = ChunkWriter(dst, max_chunk_bytes=1000)  # chunks above 1000 bytes go in pieces on CUDA
    crc = 0
    for offset, data in iter_chunks(packed, chunk):
        crc = writer.write(dst_ids, offset, data, crc)
    assert crc == zlib.crc32(packed.numpy().tobytes())
    assert torch.equal(dst[dst_ids].cpu(), src[src_ids])
    untouched = [i for i in range(SHAPE[0]) if i not in dst_ids]
    assert not dst[untouched].any()


def test_pushes_from_several_threads_each_land_whole(device):
    src = source_cache(torch.float32)
    dst = torch.zeros(SHAPE, device=device)
    writer = ChunkWriter(dst, max_chunk_bytes=512)
    pushes = [([0, 1, 2], [0, 1, 2]), ([3, 4, 5], [6, 7, 8]), ([6, 7], [9, 10])]
    errors: list[BaseException] = []

    def push(src_ids: list[int], dst_ids: list[int]) -> None:
        try:
            for offset, data in iter_chunks(pack_blocks(src, src_ids), 300):
                writer.write(dst_ids, offset, data)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=push, args=p) for p in pushes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors and not any(t.is_alive() for t in threads)
    for src_ids, dst_ids in pushes:
        assert torch.equal(dst[dst_ids].cpu(), src[src_ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gathered_payload_is_the_packed_one(device, dtype):
    src = source_cache(dtype)
    cache = src.to(device)
    stream = torch.cuda.Stream() if device == "cuda" else None
    ids = [4, 0, 2, 7, 7]
    gathered = gather_blocks(cache, ids, stream)
    assert gathered.nbytes == len(ids) * src[0].numel() * src.element_size()
    payload = gathered.host()
    assert payload.device.type == "cpu" and payload.is_pinned() == (device == "cuda")
    assert torch.equal(payload, pack_blocks(src, ids))


@GPU
@pytest.mark.gpu
def test_a_gather_sees_what_the_engines_stream_queued_before_it():
    """The gather runs on a side stream but after the current stream's work: a write queued
    behind ~50 ms of device time is in the payload, though the caller never waited."""
    cache = torch.zeros(SHAPE, device="cuda")
    torch.cuda._sleep(100_000_000)  # the current stream busy (cycles) before the write
    cache[3].fill_(7.0)
    gathered = gather_blocks(cache, [3, 5], torch.cuda.Stream())
    payload = gathered.host().view(torch.float32).view(2, -1)
    assert bool((payload[0] == 7.0).all()) and not payload[1].any()



def test_a_shared_memory_payload_lands_unchecked_from_a_read_only_array(device):
    """A same-host push (services/worker/kv_shm.py): the sender gathers into its segment
    (``pack_blocks(out=)``), the receiver writes from a read-only view of it with no crc."""
    import numpy as np

    src = source_cache(torch.bfloat16)
    src_ids, dst_ids = [5, 1, 9], [0, 4, 8]
    nbytes = 3 * src[0].numel() * src.element_size()
    segment = np.full(nbytes + 100, 7, dtype=np.uint8)  # bigger than the payload, as a segment is
    packed = pack_blocks(src, src_ids, out=segment[:nbytes])
    assert torch.equal(packed, pack_blocks(src, src_ids)) and (segment[nbytes:] == 7).all()
    view = segment[:nbytes]
    view.flags.writeable = False
    dst = torch.zeros(SHAPE, dtype=torch.bfloat16, device=device)
    assert ChunkWriter(dst, max_chunk_bytes=200).write(dst_ids, 0, view, None) is None
    assert torch.equal(dst[dst_ids].cpu(), src[src_ids])
    assert not dst[[i for i in range(SHAPE[0]) if i not in dst_ids]].any()
