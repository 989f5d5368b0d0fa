"""Command-line flags that can also come from ``PDSERVE_*`` environment variables.

Precedence: command line > environment > default. ``--http-port`` reads
``PDSERVE_HTTP_PORT``; the help text names the variable. Example::

    parser = argparse.ArgumentParser()
    add_env_argument(parser, "--http-port", type=int, default=8000, help="OpenAI HTTP port")
    add_env_argument(parser, "--colocated", action="store_true")
    args = parser.parse_args()
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any, Protocol

ENV_PREFIX = "PDSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_var_name(flag: str) -> str:
    """``--http-port`` -> ``PDSERVE_HTTP_PORT``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()



class ArgumentGroup(Protocol):
    """What ``parser.add_argument_group(...)`` returns, as add_env_argument uses it."""

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action: ...

def add_env_argument(parser: argparse.ArgumentParser, flag: str, *aliases: str,
                     environ: Mapping[str, str] | None = None,
                     group: ArgumentGroup | None = None, **kwargs: Any) -> argparse.Action:
    """``parser.add_argument(flag, *aliases, **kwargs)`` with the default taken from the env
    (added to ``group`` of ``parser`` when given: help sections; errors still go to ``parser``).

    Supports plain options (with ``type`` / ``choices``), ``action="store_true"`` / ``"store_false"``
    (the variable reads 1/true/yes/on = flag given, or 0/false/no/off) and ``nargs`` lists (space-separated).
    A malformed variable is a usage error that names the variable.
    """
    environ = os.environ if environ is None else environ
    name = env_var_name(flag)
    kwargs["help"] = f"{kwargs.get('help', '')} [env: {name}]".strip()
    raw = environ.get(name)
    if raw is not None:
        kwargs["default"] = _parse_env(parser, name, raw, kwargs)
    return (group or parser).add_argument(flag, *aliases, **kwargs)


def _parse_env(parser: argparse.ArgumentParser, name: str, raw: str, kwargs: Mapping[str, Any]) -> Any:
    action = kwargs.get("action")
    if action in ("store_true", "store_false"):
        value = raw.strip().lower()
        if value not in _TRUE | _FALSE:
            parser.error(f"{name}={raw!r}: expected one of 1/true/yes/on or 0/false/no/off")
        is_set = value in _TRUE  # as if the flag were given
        return is_set if action == "store_true" else not is_set
    if action not in (None, "store"):
        raise ValueError(f"add_env_argument does not support action={action!r}")
    convert = kwargs.get("type", str)
    items = raw.split() if kwargs.get("nargs") not in (None, "?") else [raw]
    try:
        values = [convert(item) for item in items]
    except (TypeError, ValueError) as exc:
        parser.error(f"{name}={raw!r}: {exc}")
    choices = kwargs.get("choices")
    bad = [v for v in values if choices is not None and v not in choices]
    if bad and choices is not None:  # bad is only ever non-empty with choices
        parser.error(f"{name}={raw!r}: {bad[0]!r} is not one of {list(choices)}")
    return values if kwargs.get("nargs") not in (None, "?") else values[0]
