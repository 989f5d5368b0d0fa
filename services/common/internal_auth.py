"""How pdserve processes prove to each other that they belong to the cluster.

Internal gRPC is everything between our own processes: router -> prefill / decode workers,
prefill -> decode (the KV handshake and the gRPC KV transport), workers -> kvstore, and the
health probes our tools send. Two mechanisms, each on when configured, both when both are:

- **mutual TLS** with ``--tls-cert/--tls-key/--tls-ca`` (``PDSERVE_TLS_CERT`` ...; PEM files):
  every server requires a client certificate signed by the CA, every client presents the same
  certificate and checks the server's against the CA. The certificate must name the addresses
  the processes dial (IP or DNS SANs) and allow both server and client use.
- **a shared internal token** with ``PDSERVE_INTERNAL_TOKEN`` (or ``--internal-token-file``;
  ``--internal-token`` works but shows in ps): sent as ``pdserve-internal-token`` metadata on
  every internal call and compared in constant time (services/common/auth.py) by a server
  interceptor; a call without it gets UNAUTHENTICATED. ``pdserve up`` makes a random one per
  launch.

Neither configured: internal gRPC is open, as before; keep the ports on loopback or a private
network then. ``grpc.health.v1`` Check / Watch answer without the token (Kubernetes' native
gRPC probes cannot send metadata) but not without a client certificate under mTLS.

Not covered: the NIXL / UCX data path (one-sided RDMA / TCP transfers of KV bytes between
workers and the kvstore) is not gRPC and UCX has no authentication. Its handshake (agent
metadata, region addresses) travels over the protected gRPC services, but the UCX endpoints
themselves accept any peer: run them on loopback (``UCX_NET_DEVICES=lo``, what ``pdserve up``
sets) or a cluster network no untrusted host can reach.

Process-wide: each service calls ``install(InternalAuth.from_args(args))`` once at start, before
any channel or server exists; ``current()`` before that reads the ``PDSERVE_*`` environment.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from services.common.auth import KeySet, read_key_file
from services.common.settings import add_env_argument

TOKEN_METADATA = "pdserve-internal-token"
TOKEN_ENV = "PDSERVE_INTERNAL_TOKEN"


@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes of this process's certificate chain, its private key and the cluster CA."""

    cert_chain: bytes = field(repr=False)
    private_key: bytes = field(repr=False)
    root_ca: bytes = field(repr=False)


@dataclass(frozen=True)
class InternalAuth:
    """``token`` ("" = none) and ``tls`` (None = plaintext) for internal gRPC."""

    token: str = field(default="", repr=False)
    tls: TlsFiles | None = None

    @property
    def is_enabled(self) -> bool:
        return bool(self.token) or self.tls is not None

    @property
    def accepted(self) -> KeySet:
        return KeySet.of([self.token]) if self.token else KeySet()

    def describe(self) -> str:
        """A log line's worth, without secrets: ``mTLS + token``, ``token``, ``off``."""
        parts = (["mTLS"] if self.tls else []) + (["token"] if self.token else [])
        return " + ".join(parts) or "off"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> InternalAuth:
        """From ``add_internal_auth_arguments``' flags. Raises ValueError for a partial TLS set
        or an unreadable file (naming the flag and the path, never a secret)."""
        token = args.internal_token or ""
        if args.internal_token_file:
            lines = read_key_file(args.internal_token_file)
            if len(lines) != 1:
                raise ValueError(f"--internal-token-file {args.internal_token_file}: expected one "
                                 f"token line, found {len(lines)}")
            token = lines[0]
        if token:
            KeySet.of([token])  # the same rules as an API key (sendable as metadata)
        paths = {"--tls-cert": args.tls_cert, "--tls-key": args.tls_key, "--tls-ca": args.tls_ca}
        given = [flag for flag, path in paths.items() if path]
        if not given:
            return cls(token, None)
        if len(given) != len(paths):
            missing = sorted(set(paths) - set(given))
            raise ValueError(f"mutual TLS needs --tls-cert, --tls-key and --tls-ca together; "
                             f"missing {', '.join(missing)}")
        return cls(token, TlsFiles(*(_read_pem(flag, paths[flag]) for flag in paths)))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> InternalAuth:
        parser = argparse.ArgumentParser(add_help=False)
        add_internal_auth_arguments(parser, environ)
        return cls.from_args(parser.parse_args([]))


def _read_pem(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot read ({type(error).__name__})") from None


def add_internal_auth_arguments(parser: argparse.ArgumentParser,
                                environ: Mapping[str, str] | None = None) -> None:
    """``--internal-token``, ``--internal-token-file``, ``--tls-cert``, ``--tls-key``,
    ``--tls-ca``, each with its ``PDSERVE_*`` twin."""
    add = add_env_argument
    add(parser, "--internal-token", default="", environ=environ,
        help="shared secret every internal gRPC call carries (prefer the env: argv shows in ps)")
    add(parser, "--internal-token-file", default="", environ=environ,
        help="a file holding the internal token (one line)")
    add(parser, "--tls-cert", default="", environ=environ,
        help="PEM certificate (chain) of this process for internal mutual TLS")
    add(parser, "--tls-key", default="", environ=environ, help="PEM private key of --tls-cert")
    add(parser, "--tls-ca", default="", environ=environ,
        help="PEM CA that signs every internal certificate")


_installed: InternalAuth | None = None


def install(auth: InternalAuth) -> None:
    """Make ``auth`` what this process's internal servers and channels use."""
    global _installed
    _installed = auth


def current() -> InternalAuth:
    """What ``install`` set; before that, what the ``PDSERVE_*`` environment says."""
    global _installed
    if _installed is None:
        _installed = InternalAuth.from_env(os.environ)
    return _installed


def install_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> InternalAuth:
    """``install(InternalAuth.from_args(args))``; a bad setting is ``parser.error`` (exit 2)."""
    try:
        auth = InternalAuth.from_args(args)
    except ValueError as error:
        parser.error(str(error))
    install(auth)
    return auth
