"""Internal mutual TLS end to end: ``pdserve up --tls-cert/--tls-key/--tls-ca`` over loopback.

Every internal connection (router -> workers, prefill -> decode KV transport, workers ->
kvstore, the launcher's probes) runs TLS with the node certificate; a full request must work.
A client without a certificate, with one from another CA, or in plaintext is refused on every
internal service, health included. ``--metrics-auth`` puts ``/metrics`` behind the API key.
"""

from __future__ import annotations

import asyncio
import http.client
import subprocess
import sys

import grpc
import pytest

from services.common.channels import internal_sync_channel, public_channel
from services.common.health import SERVING, check_health
from services.common.internal_auth import InternalAuth, TlsFiles
from services.common.pb import generate_pb2, generate_pb2_grpc
from tests.integration.auth_cluster import CLEAN_ENV, REPO, refusals, up_cluster
from tests.tls_certs import make_pki

pytestmark = pytest.mark.slow
KEY = "sk-mtls-key-42"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, pki):
    yield from up_cluster(tmp_path_factory.mktemp("up-mtls"), "--tls-cert", str(pki.server.cert),
                          "--tls-key", str(pki.server.key), "--tls-ca", str(pki.ca),
                          "--metrics-auth", env={"PDSERVE_API_KEY": KEY})


def _tls_env(pki) -> dict[str, str]:
    return {"PDSERVE_TLS_CERT": str(pki.client.cert), "PDSERVE_TLS_KEY": str(pki.client.key),
            "PDSERVE_TLS_CA": str(pki.ca)}


def test_a_request_crosses_every_internal_hop_over_mtls(cluster):
    request = generate_pb2.GenerateRequest(prompt="The capital of France is", sampling_params=(
        generate_pb2.SamplingParams(temperature=0.0, max_tokens=4)))
    with public_channel(cluster.grpc, api_key=KEY) as channel:
        chunks = list(generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=120))
    assert sum(len(c.token_ids) for c in chunks) == 4
    assert chunks[-1].usage.completion_tokens == 4


def test_internal_services_refuse_clients_without_a_ca_signed_certificate(cluster, pki):
    rogue = InternalAuth(tls=TlsFiles(pki.rogue.cert.read_bytes(), pki.rogue.key.read_bytes(),
                                      pki.ca.read_bytes()))
    no_cert = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
    makers = {"plaintext": lambda address: grpc.insecure_channel(address),
              "tls without a client certificate": lambda address: grpc.secure_channel(address, no_cert),
              "a certificate from another CA": lambda address: internal_sync_channel(address, auth=rogue)}
    for what, make in makers.items():
        channels = {role: make(address) for role, address in cluster.internal.items()}
        try:
            seen = refusals(channels)
        finally:
            for channel in channels.values():
                channel.close()
        assert set(seen.values()) == {"UNAVAILABLE"}, (what, seen)
    good = InternalAuth(tls=TlsFiles(pki.client.cert.read_bytes(), pki.client.key.read_bytes(),
                                     pki.ca.read_bytes()))
    for address in cluster.internal.values():
        assert asyncio.run(check_health(address, auth=good)) == SERVING
        with pytest.raises(grpc.aio.AioRpcError) as error:  # no certificate: no health either
            asyncio.run(check_health(address, auth=InternalAuth()))
        assert error.value.code() is grpc.StatusCode.UNAVAILABLE


def test_pdserve_health_uses_the_certificates_it_is_given(cluster, pki):
    base = [sys.executable, "-m", "services.cli", "health", cluster.internal["prefill"]]
    env = {**CLEAN_ENV, "PYTHONPATH": str(REPO)}
    with_certs = subprocess.run(base, cwd=REPO, env={**env, **_tls_env(pki)}, capture_output=True,
                                text=True, timeout=30)
    assert with_certs.returncode == 0, with_certs.stdout + with_certs.stderr
    without = subprocess.run(base, cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert without.returncode == 1 and "UNAVAILABLE" in without.stdout
    router = subprocess.run([*base[:-1], cluster.grpc, "--public"], cwd=REPO,
                            env={**env, **_tls_env(pki)}, capture_output=True, text=True, timeout=30)
    assert router.returncode == 0, router.stdout + router.stderr


def test_metrics_auth_puts_metrics_behind_the_key(cluster):
    def get(path: str, key: str | None) -> int:
        connection = http.client.HTTPConnection(cluster.http, timeout=30)
        try:
            connection.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
            return connection.getresponse().status
        finally:
            connection.close()

    assert (get("/metrics", None), get("/metrics", "sk-wrong"), get("/metrics", KEY)) == (401, 401, 200)
    assert get("/health", None) == 200
