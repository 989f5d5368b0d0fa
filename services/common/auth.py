"""Secrets a caller must present: the router's API keys and the cluster's internal token.

    keys = api_keys_from(args)                      # --api-key (repeatable), PDSERVE_API_KEY
    if keys.is_enabled and not keys.matches(bearer_token(request.headers.get("Authorization"))):
        ...  # 401 / UNAUTHENTICATED

Sources of API keys (all of them are merged): ``--api-key KEY`` (repeatable),
``PDSERVE_API_KEY`` (comma-separated) and ``--api-key-file PATH`` / ``PDSERVE_API_KEY_FILE``
(one key per line; blank lines and lines starting with ``#`` are skipped). No key at all
means the API is open, as before authentication existed.

``KeySet`` keeps only SHA-256 digests of the keys, never the keys: nothing can log them.
``matches`` compares the digest of the presented secret with every stored digest using
``hmac.compare_digest`` and no early exit, so neither the time taken nor anything else says
which key (or how much of one) matched; hashing first makes every comparison the same length.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.common.settings import add_env_argument

API_KEY_ENV = "PDSERVE_API_KEY"
BEARER = "bearer"


@dataclass(frozen=True)
class KeySet:
    """Digests of the accepted secrets; empty = authentication off."""

    digests: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, secrets: Iterable[str]) -> KeySet:
        """Raises ValueError for a key that is empty or has whitespace, a comma (the env list
        separator) or control characters (it could not be sent in a header)."""
        digests = []
        for number, secret in enumerate(secrets, 1):
            if not secret or any(c.isspace() or c == "," or not c.isprintable() for c in secret):
                raise ValueError(f"key #{number} is empty or contains whitespace, ',' or control "
                                 f"characters; keys must be printable, one token each")
            digests.append(_digest(secret))
        return cls(tuple(dict.fromkeys(digests)))

    @property
    def is_enabled(self) -> bool:
        return bool(self.digests)

    def matches(self, presented: str | None) -> bool:
        """True if ``presented`` is one of the keys; constant time in which key matched."""
        if presented is None:
            presented = ""
        candidate = _digest(presented)
        is_match = False
        for digest in self.digests:  # every key, no early exit
            is_match |= hmac.compare_digest(candidate, digest)
        return is_match and bool(presented)

    def __repr__(self) -> str:
        return f"KeySet({len(self.digests)} keys)"


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def bearer_token(authorization: str | None) -> str | None:
    """The credentials of an ``Authorization: Bearer <token>`` value (scheme case-insensitive,
    RFC 6750), or None when the header is missing or uses another scheme."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != BEARER:
        return None
    return token.strip() or None


def read_key_file(path: str) -> list[str]:
    """One key per line; blank lines and ``#`` comments skipped. Raises ValueError naming the
    file when it cannot be read (never its contents)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read key file {path}: {type(error).__name__}") from None
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def add_api_key_arguments(parser: argparse.ArgumentParser) -> None:
    """``--api-key`` (repeatable; env PDSERVE_API_KEY, comma-separated), ``--api-key-file``
    and ``--metrics-auth``. Read them back with ``api_keys_from``."""
    parser.add_argument("--api-key", action="append", default=[],
                        help="a key clients must send as 'Authorization: Bearer KEY' (repeat for "
                             f"several; visible in ps, prefer the env or a file) [env: {API_KEY_ENV}, "
                             "comma-separated]")
    add_env_argument(parser, "--api-key-file", default="", help="a file with one key per line")
    add_env_argument(parser, "--metrics-auth", action="store_true",
                     help="require a key for GET /metrics too (default: open, like /health)")


def api_keys_from(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> KeySet:
    """Every key from ``--api-key``, ``PDSERVE_API_KEY`` and ``--api-key-file``, merged.
    Raises ValueError for an unreadable file or a malformed key."""
    environ = os.environ if environ is None else environ
    keys = list(args.api_key or [])
    keys += [k.strip() for k in environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    if args.api_key_file:
        keys += read_key_file(args.api_key_file)
    return KeySet.of(keys)


def api_key_argv(args: argparse.Namespace) -> list[str]:
    """The ``--api-key-file`` / ``--metrics-auth`` flags to hand a child router. Keys given with
    ``--api-key`` are not passed on the command line (ps shows argv): the caller puts them in
    the child's PDSERVE_API_KEY with ``api_key_env``."""
    argv = ["--api-key-file", str(Path(args.api_key_file).resolve())] if args.api_key_file else []
    return argv + (["--metrics-auth"] if args.metrics_auth else [])


def api_key_env(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """PDSERVE_API_KEY for a child: the parent's variable plus every ``--api-key``."""
    keys = [k.strip() for k in environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    keys += list(args.api_key or [])
    return {API_KEY_ENV: ",".join(keys)} if keys else {}
