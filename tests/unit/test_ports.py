"""``free_port`` draws server ports from below the OS's ephemeral range (services/common/ports.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

from services.common import ports


def _bind(port: int) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_ports_come_from_below_the_ephemeral_range_and_bind(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_PORTS_DIR", str(tmp_path / "reserved"))
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("32768\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", range_file)
    drawn = {ports.free_port() for _ in range(50)}
    assert all(ports.LOWEST_PORT <= p < 32768 for p in drawn), sorted(drawn)
    assert len(drawn) > 40  # drawn at random, not one port over and over
    for port in list(drawn)[:5]:
        _bind(port)


def test_a_port_in_use_is_never_returned(tmp_path, monkeypatch):
    range_file = tmp_path / "ip_local_port_range"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        busy = held.getsockname()[1]
        held.listen()
        # a pool of one port, the busy one: free_port falls back to the OS's choice
        monkeypatch.setattr(ports, "LOWEST_PORT", busy)
        monkeypatch.setattr(ports, "MIN_POOL", 1)
        range_file.write_text(f"{busy + 1} 60999")
        monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", range_file)
        assert ports.server_port_range() == range(busy, busy + 1)
        port = ports.free_port()
        assert port != busy
        _bind(port)


def test_without_the_range_the_os_chooses(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    assert ports.server_port_range() is None
    _bind(ports.free_port())
    # a range that leaves too few ports below it: the OS's choice too
    (tmp_path / "low").write_text("10500 60999")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "low")
    assert ports.server_port_range() is None


def _pool_of(tmp_path, monkeypatch, size: int) -> range:
    """A pool of ``size`` free ports, reserved under tmp_path."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        low = probe.getsockname()[1]
    for start in range(max(low - 500, 1025), low):
        if all(ports._bindable("127.0.0.1", p) for p in range(start, start + size)):
            break
    else:
        raise AssertionError("no run of free ports")
    (tmp_path / "range").write_text(f"{start + size} 60999")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "range")
    monkeypatch.setattr(ports, "LOWEST_PORT", start)
    monkeypatch.setattr(ports, "MIN_POOL", 1)
    monkeypatch.setenv("PDSERVE_PORTS_DIR", str(tmp_path / "reserved"))
    return range(start, start + size)


def test_a_port_drawn_by_another_process_is_not_handed_out_until_stale(tmp_path, monkeypatch):
    pool = _pool_of(tmp_path, monkeypatch, 2)
    # another process draws from the same pool and does not bind what it got
    other = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(f"""
            from services.common import ports
            from pathlib import Path
            ports.EPHEMERAL_RANGE_FILE = Path({str(tmp_path / 'range')!r})
            ports.LOWEST_PORT, ports.MIN_POOL = {pool.start}, 1
            print(ports.free_port())""")],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    theirs = int(other.stdout)
    assert theirs in pool
    # mine: the one they did not take, then (the pool reserved) the OS's choice
    mine = ports.free_port()
    assert mine == pool[0] + pool[1] - theirs
    assert ports.free_port() not in pool
    # once their reservation is stale, their port is handed out again
    stale = time.time() - ports.RESERVE_S - 1
    os.utime(ports.reservation_dir() / str(theirs), (stale, stale))
    assert ports.free_port() == theirs
    assert ports.reservation_dir().joinpath(str(theirs)).stat().st_mtime > stale + 1


def test_an_unwritable_reservation_dir_does_not_stop_free_port(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("PDSERVE_PORTS_DIR", str(tmp_path / "file" / "sub"))
    _bind(ports.free_port())
