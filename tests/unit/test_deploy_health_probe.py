"""`pdserve health`: exit 0 for a SERVING gRPC server (a real kvstore process) and an HTTP 200,
1 for no answer or another status, 2 for a malformed address."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from tests.integration.cluster_fixtures import REPO, free_port


def probe(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", "health", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture()
def kvstore() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "kvstore", "--port",
                             str(port), "--transfer", "grpc", "--kvstore-gib", "0.01",
                             "--drain-grace-s", "0"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        # "listening on ..." once SERVING, after other start lines (the metrics address); EOF on error
        seen = [proc.stdout.readline() for _ in range(1)]
        while seen[-1] and "listening on" not in seen[-1] and len(seen) < 20:
            seen.append(proc.stdout.readline())
        assert "listening on" in seen[-1], "".join(seen)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(20)


def test_serving_grpc_server_exits_zero(kvstore: str) -> None:
    result = probe(kvstore)
    assert result.returncode == 0, result
    assert result.stdout.strip() == f"{kvstore}: SERVING"


def test_nothing_listening_exits_one() -> None:
    result = probe(f"127.0.0.1:{free_port()}", "--timeout-s", "1")
    assert result.returncode == 1 and "UNAVAILABLE" in result.stdout, result


@pytest.mark.parametrize("address", ["localhost", "127.0.0.1:port", ":50051"])
def test_malformed_address_is_a_usage_error(address: str) -> None:
    result = probe(address)
    assert result.returncode == 2 and "HOST:PORT" in result.stderr, result


def test_http_status_decides() -> None:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()
    try:
        port = server.server_address[1]
        assert probe(f"http://127.0.0.1:{port}/health").returncode == 0
        unhealthy = probe(f"http://127.0.0.1:{port}/draining")
        assert unhealthy.returncode == 1 and "HTTP 503" in unhealthy.stdout
    finally:
        server.shutdown()
        thread.join(5)
