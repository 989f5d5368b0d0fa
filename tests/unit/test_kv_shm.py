"""Shared-memory segments of same-host gRPC KV pushes (services/worker/kv_shm.py), in one
process on a temporary directory (the pushes between processes: tests/integration/
test_kv_transfer.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from services.worker import kv_shm
from services.worker.kv_shm import ShmArena, ShmProbe, ShmReader, ShmUnavailable, probe_visible


def test_an_arena_reuses_a_released_segment_and_removes_a_failed_one(tmp_path):
    arena = ShmArena(tmp_path, max_free=1)
    first = arena.acquire(3 << 20)
    assert first.size == 3 << 20 and first.path.stat().st_size == first.size
    first.array[:4] = [1, 2, 3, 4]
    arena.release(first, reuse=True)
    again = arena.acquire(1 << 20)  # fits in the free one: no new file
    assert again is first and len(list(tmp_path.iterdir())) == 1
    arena.release(again, reuse=False)  # a failed push: the receiver may still read it
    assert not first.path.exists()
    a, b = arena.acquire(10), arena.acquire(10)
    arena.release(a, reuse=True)
    arena.release(b, reuse=True)  # over max_free: one is removed
    assert len(list(tmp_path.iterdir())) == 1
    arena.close()
    assert not list(tmp_path.iterdir())


def test_an_arena_keeps_at_most_its_byte_budget_for_reuse(tmp_path):
    arena = ShmArena(tmp_path, max_free=4, max_free_bytes=3 << 20)
    small, big = arena.acquire(1 << 20), arena.acquire(4 << 20)  # a long prompt's push
    arena.release(small, reuse=True)
    arena.release(big, reuse=True)  # over the budget alone: removed (the small one first)
    assert not list(tmp_path.iterdir())
    a, b = arena.acquire(1 << 20), arena.acquire(1 << 20)
    arena.release(a, reuse=True)
    arena.release(b, reuse=True)
    assert len(list(tmp_path.iterdir())) == 2  # 2 MiB: within it
    arena.close()


def test_an_arena_without_room_says_so(tmp_path):
    with pytest.raises(ShmUnavailable, match="cannot create"):
        ShmArena(tmp_path / "missing").acquire(10)


def test_a_reader_maps_what_the_sender_wrote_and_refuses_what_is_not_a_segment(tmp_path):
    arena, reader = ShmArena(tmp_path), ShmReader(tmp_path, max_mapped=1)
    segment = arena.acquire(100)
    segment.array[:100] = np.arange(100, dtype=np.uint8)
    view = reader.view(segment.name, 10, 20)
    assert view.tolist() == list(range(10, 30)) and not view.flags.writeable
    segment.array[10] = 99  # one mapping: the reader sees the sender's writes
    assert reader.view(segment.name, 10, 1).tolist() == [99]
    with pytest.raises(ValueError, match="outside shm segment"):
        reader.view(segment.name, segment.size - 1, 2)
    for name in ("../x", "pdserve-kv-1-2-ab-probe", "passwd"):
        with pytest.raises(ValueError, match="is not a pdserve KV segment"):
            reader.view(name, 0, 1)
    with pytest.raises(FileNotFoundError):
        reader.view(segment.name + "0", 0, 1)
    other = arena.acquire(10)  # a second map evicts the first (still readable: remapped)
    assert reader.view(other.name, 0, 1).size == 1
    assert reader.view(segment.name, 10, 1).tolist() == [99]
    arena.close()


def test_a_probe_is_visible_with_its_token_only(tmp_path):
    probe = ShmProbe(tmp_path)
    assert probe_visible(probe.advert, tmp_path)
    name, _, token = probe.advert.partition(":")
    assert not probe_visible(f"{name}:{'0' * len(token)}", tmp_path)
    assert not probe_visible(probe.advert, tmp_path / "elsewhere")  # another host's /dev/shm
    assert not probe_visible("", tmp_path) and not probe_visible("../x:1", tmp_path)
    probe.close()
    assert not probe_visible(probe.advert, tmp_path) and not list(tmp_path.iterdir())


def test_files_of_gone_processes_of_this_pid_namespace_are_removed(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    namespace = kv_shm._pid_namespace()
    stale = tmp_path / f"pdserve-kv-{namespace}-{gone}-abc-1"
    live = tmp_path / f"pdserve-kv-{namespace}-{os.getpid()}-abc-1"
    foreign = tmp_path / f"pdserve-kv-{namespace + 1}-{gone}-abc-1"  # another pid namespace
    for path in (stale, live, foreign):
        path.write_bytes(b"x")
    ShmArena(tmp_path).close()  # a new arena cleans up
    assert not stale.exists() and live.exists() and foreign.exists()
