"""Access control of the gRPC bootstrap (services/common/grpc_server.py) and the channel
factory (services/common/channels.py), over loopback against a real server process.

The server has one echo method of each streaming kind under ``test.Echo`` and takes its
access from the environment like every pdserve service (PDSERVE_INTERNAL_TOKEN, PDSERVE_TLS_*)
or, with ``public KEY``, is a public server with one API key, as the router's is.
"""

from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.channels import internal_channel, internal_sync_channel, public_channel
from services.common.health import SERVING
from services.common.internal_auth import InternalAuth, TlsFiles
from tests.tls_certs import make_pki

REPO = Path(__file__).resolve().parents[2]
TOKEN = "internal-Token_123"
SERVER = """
import asyncio, sys, grpc
from services.common.auth import KeySet
from services.common.grpc_server import start_grpc_server

async def unary(request, context):
    return request

async def server_stream(request, context):
    for _ in range(2):
        yield request

async def client_stream(requests, context):
    return b"".join([r async for r in requests])

async def bidi(requests, context):
    async for r in requests:
        yield r

def add(handler, server):
    server.add_generic_rpc_handlers((handler,))

async def main():
    handler = grpc.method_handlers_generic_handler("test.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
        "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi)})
    keys = KeySet.of(sys.argv[2:]) if sys.argv[1:2] == ["public"] else None
    server = await start_grpc_server([(add, handler)], host="127.0.0.1", public_api_keys=keys)
    print(server.port, flush=True)
    await server.serve_until_signal(grace_s=0.5)

asyncio.run(main())
"""
CLEAN_ENV = {k: v for k, v in os.environ.items()
             if not k.startswith(("PDSERVE_INTERNAL_TOKEN", "PDSERVE_TLS_", "PDSERVE_API_KEY"))}


def _serve(env: dict[str, str], *argv: str) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, *argv], cwd=REPO, text=True,
                            env={**CLEAN_ENV, "PYTHONPATH": str(REPO), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        port = proc.stdout.readline().strip()
        assert port.isdigit(), proc.stderr.read()
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_server():
    yield from _serve({"PDSERVE_INTERNAL_TOKEN": TOKEN})


@pytest.fixture(scope="module")
def mtls_server(pki):
    yield from _serve({"PDSERVE_TLS_CERT": str(pki.server.cert), "PDSERVE_TLS_KEY": str(pki.server.key),
                       "PDSERVE_TLS_CA": str(pki.ca)})


def _tls(pki, pair) -> TlsFiles:
    return TlsFiles(pair.cert.read_bytes(), pair.key.read_bytes(), pki.ca.read_bytes())


async def _every_kind(channel: grpc.aio.Channel) -> list[bytes]:
    """One call of each streaming kind; their results in order."""
    unary = await channel.unary_unary("/test.Echo/Unary")(b"a", timeout=5)
    streamed = [r async for r in channel.unary_stream("/test.Echo/ServerStream")(b"b", timeout=5)]
    joined = await channel.stream_unary("/test.Echo/ClientStream")(iter([b"c", b"d"]), timeout=5)
    bidi = [r async for r in channel.stream_stream("/test.Echo/Bidi")(iter([b"e"]), timeout=5)]
    return [unary, *streamed, joined, *bidi]


async def _codes_of_every_kind(channel: grpc.aio.Channel) -> set[grpc.StatusCode]:
    codes = set()
    calls = [lambda: channel.unary_unary("/test.Echo/Unary")(b"a", timeout=5),
             lambda: _drain(channel.unary_stream("/test.Echo/ServerStream")(b"b", timeout=5)),
             lambda: channel.stream_unary("/test.Echo/ClientStream")(iter([b"c"]), timeout=5),
             lambda: _drain(channel.stream_stream("/test.Echo/Bidi")(iter([b"e"]), timeout=5))]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call()
        codes.add(error.value.code())
    return codes


async def _drain(call) -> list[bytes]:
    return [r async for r in call]


async def _health(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


def test_token_server_refuses_calls_without_the_token_but_not_health(token_server):
    async def scenario() -> None:
        for auth in (InternalAuth(), InternalAuth(token="wrong-token")):
            async with internal_channel(token_server, auth=auth) as channel:
                assert await _codes_of_every_kind(channel) == {grpc.StatusCode.UNAUTHENTICATED}
                assert await _health(channel) == SERVING  # probes need no token
        async with internal_channel(token_server, auth=InternalAuth(token=TOKEN)) as channel:
            assert await _every_kind(channel) == [b"a", b"b", b"b", b"cd", b"e"]

    asyncio.run(scenario())


def test_a_refused_client_stream_is_always_unauthenticated_never_internal(token_server):
    """grpc.aio's client replaced the status with INTERNAL when a write of its request stream
    raced the refusal (about 1 call in 60 here before the fix); 300 of each kind caught it."""
    async def scenario() -> collections.Counter[grpc.StatusCode]:
        codes: collections.Counter[grpc.StatusCode] = collections.Counter()
        async with internal_channel(token_server, auth=InternalAuth(token="wrong-token")) as channel:
            client_stream = channel.stream_unary("/test.Echo/ClientStream")
            bidi = channel.stream_stream("/test.Echo/Bidi")
            for _ in range(300):
                for call in (lambda: client_stream(iter([b"c", b"d"]), timeout=5),
                             lambda: _drain(bidi(iter([b"e"]), timeout=5))):
                    with pytest.raises(grpc.aio.AioRpcError) as error:
                        await call()
                    codes[error.value.code()] += 1
        return codes

    assert asyncio.run(scenario()) == {grpc.StatusCode.UNAUTHENTICATED: 600}


def test_blocking_channel_sends_the_token(token_server):
    with internal_sync_channel(token_server, auth=InternalAuth(token=TOKEN)) as channel:
        assert channel.unary_unary("/test.Echo/Unary")(b"x", timeout=5) == b"x"
        assert list(channel.unary_stream("/test.Echo/ServerStream")(b"y", timeout=5)) == [b"y", b"y"]
        assert channel.stream_unary("/test.Echo/ClientStream")(iter([b"z"]), timeout=5) == b"z"
    with internal_sync_channel(token_server, auth=InternalAuth()) as channel:
        with pytest.raises(grpc.RpcError) as error:
            channel.unary_unary("/test.Echo/Unary")(b"x", timeout=5)
        assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "internal token" in error.value.details()


def test_mtls_server_needs_a_client_certificate_from_the_ca(mtls_server, pki):
    async def scenario() -> None:
        good = InternalAuth(tls=_tls(pki, pki.client))
        async with internal_channel(mtls_server, auth=good) as channel:
            assert await _every_kind(channel) == [b"a", b"b", b"b", b"cd", b"e"]
        no_cert = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
        rogue = InternalAuth(tls=TlsFiles(pki.rogue.cert.read_bytes(), pki.rogue.key.read_bytes(),
                                          pki.ca.read_bytes()))
        channels = [grpc.aio.insecure_channel(mtls_server),  # plaintext
                    grpc.aio.secure_channel(mtls_server, no_cert),  # TLS without a client cert
                    internal_channel(mtls_server, auth=rogue)]  # a cert the CA did not sign
        for channel in channels:
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError) as error:  # health too: no TLS, no talk
                    await _health(channel)
                assert error.value.code() is grpc.StatusCode.UNAVAILABLE
                codes = await _codes_of_every_kind(channel)
                assert codes == {grpc.StatusCode.UNAVAILABLE}

    asyncio.run(scenario())


def test_public_server_takes_a_bearer_api_key():
    for address in _serve({}, "public", "key-one", "key-two"):
        for key, is_allowed in (("", False), ("nope", False), ("key-two", True), ("key-one", True)):
            with public_channel(address, api_key=key) as channel:
                call = channel.unary_unary("/test.Echo/Unary")
                if is_allowed:
                    assert call(b"k", timeout=5) == b"k"
                    continue
                with pytest.raises(grpc.RpcError) as error:
                    call(b"k", timeout=5)
                assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED, key
                assert "API key" in error.value.details()
                assert "key-one" not in error.value.details()
