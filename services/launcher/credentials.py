"""The launch's credentials: API keys checked before anything starts, one random internal
token per launch handed to the children by environment (never argv, which ps shows) and
written, mode 0600, for operator tools, and the ``--tls-*`` paths."""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from services.common.auth import api_keys_from
from services.common.internal_auth import TOKEN_ENV, install_from_args

TOKEN_FILE = "internal-token"  # in the log dir: the launch's internal token, mode 0600


def prepare_auth(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Check the API keys (a bad one fails ``up`` before anything starts), set
    ``args.internal_token`` to the user's token or a new random one (one per launch) and install
    it in this process, which probes its children with it. Errors are ``parser.error``."""
    try:
        api_keys_from(args)
    except ValueError as error:
        parser.error(f"API keys: {error}")
    auth = install_from_args(args, parser)
    args.internal_token = auth.token or secrets.token_urlsafe(32)
    args.internal_token_file = ""
    install_from_args(args, parser)


def write_token_file(path: Path, token: str) -> None:
    """The launch's internal token, readable by its user only, for operator tools
    (``pdserve health --internal-token-file``, a script reading GetStats)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode otherwise
    with os.fdopen(fd, "w") as file:
        file.write(token + "\n")


def internal_auth_env(args: argparse.Namespace) -> dict[str, str]:
    """The children's internal credentials: ``args.internal_token`` (what ``--internal-token``,
    its file or env gave, as installed in this process) or a new random token, and absolute
    ``--tls-*`` paths. Environment only: argv shows in ps."""
    env = {TOKEN_ENV: args.internal_token}
    for flag in ("tls_cert", "tls_key", "tls_ca"):
        if getattr(args, flag):
            env[f"PDSERVE_{flag.upper()}"] = str(Path(getattr(args, flag)).resolve())
    return env
