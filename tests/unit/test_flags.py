"""services/common/flags.py: a settings dataclass is its flags, their env twins and an argv."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from engine.config import Role
from services.common.flags import add_flags, flags_argv, flags_from, setting


@dataclass(frozen=True)
class Example:
    port: int = setting(50081, "gRPC port")
    lookup_ms: float | None = setting(None, "budget")
    transfer: str = setting("nixl", "KV transport", choices=("nixl", "grpc"))
    is_verbose: bool = setting(False, "talk", flag="--verbose")
    has_cache: bool = setting(True, "disable the cache", flag="--no-cache")


def _parse(argv: list[str], environ: dict[str, str] | None = None, **defaults: object) -> Example:
    parser = argparse.ArgumentParser(add_help=False)
    add_flags(parser, Example, environ or {}, **defaults)
    return flags_from(Example, parser.parse_args(argv))


def test_fields_become_typed_flags_with_defaults_and_switches() -> None:
    assert _parse([]) == Example()
    parsed = _parse(["--port", "7", "--lookup-ms", "2.5", "--transfer", "grpc", "--verbose",
                     "--no-cache"])
    assert parsed == Example(7, 2.5, "grpc", True, False)
    assert _parse([], port=9).port == 9  # a caller's default (a role's port)
    with pytest.raises(SystemExit):
        _parse(["--transfer", "pigeon"])


def test_env_twins_sit_between_the_command_line_and_the_default() -> None:
    environ = {"PDSERVE_PORT": "11", "PDSERVE_VERBOSE": "1", "PDSERVE_TRANSFER": "grpc"}
    assert _parse([], environ) == Example(11, None, "grpc", True, True)
    assert _parse(["--port", "12"], environ).port == 12


def test_argv_round_trips_the_fields_that_differ() -> None:
    changed = Example(port=7, is_verbose=True, has_cache=False)
    assert flags_argv(changed) == ["--port", "7", "--verbose", "--no-cache"]
    assert _parse(flags_argv(changed)) == changed


def test_worker_flags_keep_their_names_defaults_and_env() -> None:
    from services.worker.settings import worker_parser

    decode = worker_parser(Role.DECODE, 50071).parse_args([])
    assert (decode.port, decode.transfer, decode.kvstore_transfer, decode.log_level,
            decode.reservation_lease_ms, decode.redis_url) == (50071, "nixl", "auto", "INFO", 60_000, "")
    prefill = worker_parser(Role.PREFILL, 50061).parse_args(["--transfer", "grpc"])
    assert prefill.port == 50061 and prefill.transfer == "grpc"
    assert not hasattr(prefill, "reservation_lease_ms")
