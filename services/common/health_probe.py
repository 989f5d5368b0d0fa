"""``pdserve health ADDRESS``: one health probe, for container healthchecks and scripts.

    pdserve health 127.0.0.1:50051                 # grpc.health.v1 Check, overall service ""
    pdserve health 127.0.0.1:50051 --service pdserve.v1.DecodeService
    pdserve health http://127.0.0.1:8000/health    # an HTTP URL: GET, 200 means healthy
    pdserve health 127.0.0.1:50051 --public        # a router's public gRPC port (plaintext)

Internal addresses are probed over an internal channel: with ``PDSERVE_TLS_*`` (or the
``--tls-*`` flags) it presents the client certificate mutual TLS needs. Health answers without
the internal token, so none is needed.

Exit status: 0 when the address answers SERVING (HTTP 200), 1 when it answers anything else or
does not answer within ``--timeout-s`` seconds, 2 for a malformed address (usage error). One line
on stdout says what was seen. Used by docker-compose.yml; Kubernetes uses its native gRPC probe.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

from services.common.internal_auth import add_internal_auth_arguments, install_from_args
from services.common.settings import add_env_argument


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve health", description=__doc__.split("\n\n")[0])
    parser.add_argument("address", help="HOST:PORT of a gRPC server, or an http:// URL")
    add_env_argument(parser, "--service", default="",
                     help="grpc.health.v1 service name (empty: the whole server)")
    add_env_argument(parser, "--timeout-s", type=float, default=2.0,
                     help="seconds to wait for the answer")
    add_env_argument(parser, "--public", action="store_true",
                     help="the address is a router's public gRPC port: plaintext even with mTLS set")
    add_internal_auth_arguments(parser)
    return parser


def probe_grpc(address: str, service: str, timeout_s: float,
               is_internal: bool = True) -> tuple[bool, str]:
    """(is_serving, what was seen) for one grpc.health.v1 Check of ``address``."""
    import grpc
    from grpc_health.v1 import health_pb2

    from services.common.health import SERVING, check_health

    try:
        status = asyncio.run(check_health(address, service, timeout_s, is_internal))
    except grpc.aio.AioRpcError as error:
        return False, f"{error.code().name}: {error.details()}"
    return status == SERVING, health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def probe_http(url: str, timeout_s: float) -> tuple[bool, str]:
    """(is 200, what was seen) for one GET of ``url``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status == 200, f"HTTP {reply.status}"
    except urllib.error.HTTPError as error:
        return False, f"HTTP {error.code}"
    except OSError as error:
        return False, f"{type(error).__name__}: {error}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    install_from_args(args, parser)
    if args.timeout_s <= 0:
        parser.error(f"--timeout-s must be > 0, got {args.timeout_s}")
    if args.address.startswith(("http://", "https://")):
        is_healthy, seen = probe_http(args.address, args.timeout_s)
    else:
        host, _, port = args.address.rpartition(":")
        if not host or not port.isdigit():
            parser.error(f"address must be HOST:PORT or an http:// URL, got {args.address!r}")
        is_healthy, seen = probe_grpc(args.address, args.service, args.timeout_s, not args.public)
    print(f"{args.address}: {seen}", flush=True)
    sys.exit(0 if is_healthy else 1)


if __name__ == "__main__":
    main()
