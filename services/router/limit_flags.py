"""The router's limit flags, derived from the config dataclasses that declare them.

Each field of RequestLimits (services/router/pipeline/limits.py) and AdmissionConfig
(services/router/pipeline/admission.py) is one flag: ``max_body_bytes`` -> ``--max-body-bytes`` and
``PDSERVE_MAX_BODY_BYTES``, with the field's default and its ``metadata["help"]``. Adding a
limit means adding a field; nothing here changes.

    add_limit_arguments(parser)
    args = parser.parse_args(argv)
    limits, admission = limits_from(args)   # argparse error naming the flag on a bad value
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from services.common.settings import add_env_argument
from services.router.pipeline.admission import AdmissionConfig
from services.router.pipeline.limits import RequestLimits

_CONFIGS: tuple[type[Any], ...] = (RequestLimits, AdmissionConfig)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("request limits and admission control")
    for config in _CONFIGS:
        for f in dataclasses.fields(config):
            add_env_argument(parser, _flag(f.name), group=group, type=int, default=f.default,
                             help=f"{f.metadata['help']} (default {f.default})")


def limits_from(args: argparse.Namespace,
                parser: argparse.ArgumentParser | None = None) -> tuple[RequestLimits, AdmissionConfig]:
    """The configs the parsed flags describe; a bad value is a usage error (with ``parser``)
    or ValueError naming the flag."""
    built = []
    for config in _CONFIGS:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config)}
        try:
            built.append(config(**values))
        except ValueError as exc:
            message = str(exc)
            name = message.split(" ", 1)[0]
            message = message.replace(name, _flag(name), 1)
            if parser is not None:
                parser.error(message)
            raise ValueError(message) from exc
    limits, admission = built
    return limits, admission
