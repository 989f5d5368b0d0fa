"""Same-host gRPC KV pushes through shared memory: the payload in a file under ``/dev/shm``,
only its name on the wire.

A gRPC push (kv_grpc_sender.py -> kv_grpc_receiver.py) otherwise streams the packed blocks as
message bytes: a copy into each message, its serialization, two socket copies, its parsing,
and a crc32 pass on each side, on one TCP connection. Between processes on one host that is
~0.3 GB/s on a 2-core EPYC (``loadtests/bench_kv_transfer.py``), where a prefill worker
feeding a GPU decode worker needs GB/s (25 MB per 128-token prompt of a 1.7B model).

Here the sender packs the blocks into a segment of its own (``ShmArena``: reused across pushes,
space reserved up front with ``posix_fallocate``, so a full ``/dev/shm`` is an error, never a
SIGBUS), and the PushBlocks stream is one header naming it (``shm_name``). The receiver maps it
read-only (``ShmReader``) and copies the bytes into the reserved blocks before it acks; the
sender reuses the segment only after that ack. No crc: nothing travels but the name.

Who may use it: the decode worker's gRPC handshake carries a probe (``ShmProbe``: a small file
with a random token); a sender that can open it and read the token shares the receiver's
``/dev/shm`` (same host, same IPC namespace), anyone else pushes bytes. ``--kv-shared-memory
off`` on either side turns it off. Files are named ``pdserve-kv-<pid namespace>-<pid>-...``;
each process removes its own at close, and a new arena removes those of processes of its pid
namespace that are gone, as does a new probe (a /dev/shm shared across pid namespaces keeps
the others' files).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.mathutils import cdiv

SHM_DIR = Path("/dev/shm")
PREFIX = "pdserve-kv-"
_NAME = re.compile(r"pdserve-kv-[0-9]+-[0-9]+-[0-9a-f]+-[0-9]+")
_PROBE_NAME = re.compile(r"pdserve-kv-[0-9]+-[0-9]+-[0-9a-f]+-probe")
SEGMENT_ALIGN = 1 << 20  # a segment's size is rounded up to this
MAX_FREE_SEGMENTS = 4  # segments an arena keeps for reuse (about its concurrent pushes)
MAX_FREE_BYTES = 1 << 30  # and their bytes at most (a long prompt's push is removed after use)
MAX_MAPPED = 16  # segments a reader keeps mapped


class ShmUnavailable(OSError):
    """No segment could be made (``/dev/shm`` full or missing): push the bytes instead."""


def _token() -> str:
    return secrets.token_hex(6)


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _owner() -> str:
    """``<pid namespace>-<pid>``: the start of this process's file names."""
    return f"{PREFIX}{_pid_namespace()}-{os.getpid()}-"


def remove_stale(shm_dir: Path = SHM_DIR) -> int:
    """Remove the files of gone processes of this pid namespace; returns how many."""
    removed = 0
    namespace = str(_pid_namespace())
    with contextlib.suppress(OSError):
        for path in shm_dir.glob(f"{PREFIX}{namespace}-*"):
            pid = path.name[len(PREFIX) + len(namespace) + 1:].split("-", 1)[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed += 1
    return removed


class ShmProbe:
    """The receiver's probe: ``advert`` ("name:token") goes in its handshake."""

    def __init__(self, shm_dir: Path = SHM_DIR) -> None:
        remove_stale(shm_dir)
        token = _token()
        self.path = shm_dir / f"{_owner()}{_token()}-probe"
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, token.encode())
        finally:
            os.close(fd)
        self.advert = f"{self.path.name}:{token}"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


def probe_visible(advert: str, shm_dir: Path = SHM_DIR) -> bool:
    """Whether the probe ``advert`` names can be read here with its token (shared /dev/shm)."""
    name, _, token = advert.partition(":")
    if not _PROBE_NAME.fullmatch(name) or not token:
        return False
    try:
        return (shm_dir / name).read_bytes() == token.encode()
    except OSError:
        return False


@dataclass(eq=False)
class Segment:
    """One sender segment: ``array`` is its writable uint8 view."""

    name: str
    path: Path
    size: int
    array: np.ndarray


class ShmArena:
    """The sender's segments: ``acquire`` one for a push, ``release`` it after the ack (to be
    reused) or after a failure (removed: the receiver may still be reading it). At most
    ``max_free`` segments of ``max_free_bytes`` in all are kept for reuse (the smallest go
    first); a push holds its segment only while it runs, as a push of bytes holds its packed
    payload. Thread-safe."""

    def __init__(self, shm_dir: Path = SHM_DIR, max_free: int = MAX_FREE_SEGMENTS,
                 max_free_bytes: int = MAX_FREE_BYTES) -> None:
        self.shm_dir = shm_dir
        self.max_free = max_free
        self.max_free_bytes = max_free_bytes
        self._prefix = f"{_owner()}{_token()}-"
        self._lock = threading.Lock()
        self._free: list[Segment] = []
        self._count = 0
        self._live: set[Segment] = set()
        remove_stale(shm_dir)

    def acquire(self, nbytes: int) -> Segment:
        """A segment of at least ``nbytes``; ShmUnavailable when none can be made."""
        with self._lock:
            fits = [s for s in self._free if s.size >= nbytes]
            if fits:
                segment = min(fits, key=lambda s: s.size)
                self._free.remove(segment)
                self._live.add(segment)
                return segment
            self._count += 1
            name = f"{self._prefix}{self._count}"
        size = cdiv(max(nbytes, 1), SEGMENT_ALIGN) * SEGMENT_ALIGN
        path = self.shm_dir / name
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise ShmUnavailable(f"cannot create {path}: {exc}") from exc
        try:
            os.posix_fallocate(fd, 0, size)  # the pages exist now: a full tmpfs fails here
            mapped = mmap.mmap(fd, size)
        except OSError as exc:
            with contextlib.suppress(OSError):
                path.unlink()
            raise ShmUnavailable(f"cannot reserve {size} bytes in {path}: {exc}") from exc
        finally:
            os.close(fd)
        segment = Segment(name, path, size, np.frombuffer(mapped, dtype=np.uint8))
        with self._lock:
            self._live.add(segment)
        return segment

    def release(self, segment: Segment, reuse: bool) -> None:
        removed = [segment]
        with self._lock:
            self._live.discard(segment)
            if reuse:
                self._free.append(segment)
                removed = []
                while self._free and (len(self._free) > self.max_free
                                      or sum(s.size for s in self._free) > self.max_free_bytes):
                    smallest = min(self._free, key=lambda s: s.size)
                    self._free.remove(smallest)
                    removed.append(smallest)
        for each in removed:
            self._remove(each)

    def close(self) -> None:
        with self._lock:
            segments, self._free = [*self._free, *self._live], []
            self._live.clear()
        for segment in segments:
            self._remove(segment)

    @staticmethod
    def _remove(segment: Segment) -> None:
        # unmapped when the last view of it goes (a push thread may still hold one)
        with contextlib.suppress(OSError):
            segment.path.unlink()


class ShmReader:
    """The receiver's read-only maps of sender segments, the last ``MAX_MAPPED`` kept open."""

    def __init__(self, shm_dir: Path = SHM_DIR, max_mapped: int = MAX_MAPPED) -> None:
        self.shm_dir = shm_dir
        self.max_mapped = max_mapped
        self._maps: OrderedDict[str, tuple[int, np.ndarray]] = OrderedDict()  # name -> (inode, view)
        self._lock = threading.Lock()

    def view(self, name: str, offset: int, nbytes: int) -> np.ndarray:
        """Bytes ``[offset, offset + nbytes)`` of segment ``name``, read-only, not copied.
        ValueError for a name that is no pdserve segment or a range outside it; OSError
        (FileNotFoundError) when it is not here."""
        if not _NAME.fullmatch(name):
            raise ValueError(f"shm_name {name!r} is not a pdserve KV segment "
                             f"({_NAME.pattern})")
        path = self.shm_dir / name
        fd = os.open(path, os.O_RDONLY)
        try:
            stat = os.fstat(fd)
            with self._lock:
                known = self._maps.get(name)
                if known is not None and known[0] == stat.st_ino and known[1].size == stat.st_size:
                    self._maps.move_to_end(name)
                    array = known[1]
                else:
                    if stat.st_size == 0:
                        raise ValueError(f"shm segment {name!r} is empty")
                    array = np.frombuffer(mmap.mmap(fd, stat.st_size, prot=mmap.PROT_READ),
                                          dtype=np.uint8)
                    self._maps[name] = (stat.st_ino, array)
                    while len(self._maps) > self.max_mapped:
                        self._maps.popitem(last=False)  # unmapped with its last view
        finally:
            os.close(fd)
        if offset < 0 or nbytes < 0 or offset + nbytes > array.size:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside shm segment "
                             f"{name!r} of {array.size} bytes")
        return array[offset:offset + nbytes]
