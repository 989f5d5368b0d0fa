"""``free_port`` draws server ports from below the OS's ephemeral range (services/common/ports.py)."""

from __future__ import annotations

import socket

from services.common import ports


def _bind(port: int) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_ports_come_from_below_the_ephemeral_range_and_bind(tmp_path, monkeypatch):
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
