"""Authentication end to end with the internal token: ``pdserve up`` with API keys, over loopback.

The router takes two keys (one from ``PDSERVE_API_KEY``, one from ``--api-key-file``); every
HTTP route and the public gRPC API are tried with no key, a wrong key and a right one. The
internal services (prefill, decode with its KV transport, kvstore) are tried without the
launch's random token and with a wrong one: UNAUTHENTICATED everywhere but grpc.health.v1.
The token reaches the children through their environment, never their command lines.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from services.common.channels import internal_sync_channel
from services.common.health import SERVING
from services.common.internal_auth import InternalAuth
from services.common.pb import generate_pb2, generate_pb2_grpc
from tests.integration.auth_cluster import CLEAN_ENV, REPO, refusals, up_cluster

pytestmark = pytest.mark.slow
ENV_KEY, FILE_KEY = "sk-env-0123456789", "sk-file-9876543210"
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("up-token")
    key_file = log_dir / "keys.txt"
    key_file.write_text(f"# router keys\n{FILE_KEY}\n")
    yield from up_cluster(log_dir, "--api-key-file", str(key_file), env={"PDSERVE_API_KEY": ENV_KEY})


def _http(address: str, method: str, path: str, key: str | None, body: dict | None = None,
          scheme: str = "Bearer") -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection(address, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"{scheme} {key}"
    try:
        connection.request(method, path, body=json.dumps(body) if body else None, headers=headers)
        reply = connection.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        connection.close()


ROUTES = [("POST", "/v1/completions", COMPLETION), ("POST", "/v1/chat/completions", CHAT),
          ("POST", "/v1/completions", {**COMPLETION, "stream": True}), ("GET", "/v1/models", None),
          ("GET", "/v1/no-such-route", None)]


def test_every_http_route_needs_a_key_except_health_and_metrics(cluster):
    for method, path, body in ROUTES:
        for key, scheme in ((None, "Bearer"), ("sk-wrong", "Bearer"), (ENV_KEY, "Basic"), ("", "Bearer")):
            status, headers, raw = _http(cluster.http, method, path, key, body, scheme)
            assert status == 401, (path, key, raw)
            assert headers["WWW-Authenticate"].startswith("Bearer")
            error = json.loads(raw)["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
            assert "sk-" not in error["message"]  # nothing sent is echoed
        for key in (ENV_KEY, FILE_KEY):
            status, _, raw = _http(cluster.http, method, path, key, body)
            assert status == (404 if "no-such" in path else 200), (path, raw)
    assert _http(cluster.http, "GET", "/health", None)[0] == 200
    status, _, raw = _http(cluster.http, "GET", "/metrics", None)  # open without --metrics-auth
    assert status == 200 and b"# TYPE" in raw


def _generate(address: str, metadata: tuple[tuple[str, str], ...]) -> list[int]:
    request = generate_pb2.GenerateRequest(prompt="Hello, my name is", sampling_params=generate_pb2.SamplingParams(
        temperature=0.0, max_tokens=3))
    with grpc.insecure_channel(address) as channel:
        chunks = generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=60, metadata=metadata)
        return [t for chunk in chunks for t in chunk.token_ids]


def test_public_grpc_api_needs_a_key(cluster):
    for metadata in ((), (("authorization", "Bearer sk-wrong"),), (("authorization", ENV_KEY),)):
        with pytest.raises(grpc.RpcError) as error:
            _generate(cluster.grpc, metadata)
        assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED, metadata
    for key in (ENV_KEY, FILE_KEY):
        assert len(_generate(cluster.grpc, (("authorization", f"Bearer {key}"),))) == 3


def test_internal_services_refuse_calls_without_the_token(cluster):
    for auth in (InternalAuth(), InternalAuth(token="not-the-token")):
        channels = {role: internal_sync_channel(address, auth=auth)
                    for role, address in cluster.internal.items()}
        try:
            seen = refusals(channels)
        finally:
            for channel in channels.values():
                channel.close()
        assert set(seen.values()) == {"UNAUTHENTICATED"}, seen


def test_health_stays_open_and_the_operator_tools_work(cluster):
    import asyncio

    from services.common.health import check_health

    for address in cluster.internal.values():  # token-less, as Kubernetes' gRPC probe
        assert asyncio.run(check_health(address, is_internal=True)) == SERVING
    probe = subprocess.run([sys.executable, "-m", "services.cli", "health", cluster.internal["decode"]],
                           cwd=REPO, env={**CLEAN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True,
                           text=True, timeout=30)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    generate = [sys.executable, "-m", "services.cli", "generate", "Hi", "--max-tokens", "2",
                "--temperature", "0", "--address", cluster.grpc]
    refused = subprocess.run(generate, cwd=REPO, env={**CLEAN_ENV, "PYTHONPATH": str(REPO)},
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    served = subprocess.run(generate, cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**CLEAN_ENV, "PYTHONPATH": str(REPO), "PDSERVE_API_KEY": FILE_KEY})
    assert served.returncode == 0, served.stderr
    assert "completion 2 tokens" in served.stderr


def test_the_token_travels_in_the_environment_only(cluster):
    children = [int(pid) for task in Path(f"/proc/{cluster.proc.pid}/task").iterdir()
                for pid in (task / "children").read_text().split()]
    tokens, argvs = set(), []
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        tokens |= {e.split(b"=", 1)[1] for e in environ if e.startswith(b"PDSERVE_INTERNAL_TOKEN=")}
        argvs.append(Path(f"/proc/{pid}/cmdline").read_bytes())
    assert len(tokens) == 1 and len(next(iter(tokens))) >= 32  # one random token, every child
    token = next(iter(tokens))
    token_file = cluster.log_dir / "internal-token"  # for operator tools, private to the user
    assert token_file.read_bytes() == token + b"\n" and token_file.stat().st_mode & 0o777 == 0o600
    assert not any(token in argv for argv in argvs)
    assert not any(ENV_KEY.encode() in argv or FILE_KEY.encode() in argv for argv in argvs)
    logs = b"".join(p.read_bytes() for p in cluster.log_dir.glob("*.log"))
    assert token not in logs and ENV_KEY.encode() not in logs and FILE_KEY.encode() not in logs
