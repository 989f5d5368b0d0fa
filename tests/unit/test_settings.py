"""Flags readable from PDSERVE_* environment variables (services/common/settings.py)."""

from __future__ import annotations

import argparse

import pytest

from services.common.settings import add_env_argument, env_var_name


def _parser(environ: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve")
    add_env_argument(parser, "--http-port", type=int, default=8000, environ=environ)
    add_env_argument(parser, "--transfer", choices=["nixl", "grpc"], default="nixl", environ=environ)
    add_env_argument(parser, "--colocated", action="store_true", environ=environ)
    add_env_argument(parser, "--stop-token-ids", type=int, nargs="*", default=[], environ=environ)
    return parser


def test_env_var_name():
    assert env_var_name("--http-port") == "PDSERVE_HTTP_PORT"
    assert env_var_name("--kv-cache-dtype") == "PDSERVE_KV_CACHE_DTYPE"


def test_precedence_command_line_then_env_then_default():
    assert vars(_parser({}).parse_args([])) == {
        "http_port": 8000, "transfer": "nixl", "colocated": False, "stop_token_ids": []}
    env = {"PDSERVE_HTTP_PORT": "9001", "PDSERVE_TRANSFER": "grpc", "PDSERVE_COLOCATED": "yes",
           "PDSERVE_STOP_TOKEN_IDS": "2 7"}
    assert vars(_parser(env).parse_args([])) == {
        "http_port": 9001, "transfer": "grpc", "colocated": True, "stop_token_ids": [2, 7]}
    assert _parser(env).parse_args(["--http-port", "9002"]).http_port == 9002
    assert _parser({"PDSERVE_COLOCATED": "0"}).parse_args([]).colocated is False


def test_help_names_the_variable():
    assert "[env: PDSERVE_HTTP_PORT]" in _parser({}).format_help()


@pytest.mark.parametrize("env,message", [
    ({"PDSERVE_HTTP_PORT": "eighty"}, "PDSERVE_HTTP_PORT='eighty'"),
    ({"PDSERVE_TRANSFER": "rdma"}, "PDSERVE_TRANSFER='rdma': 'rdma' is not one of ['nixl', 'grpc']"),
    ({"PDSERVE_COLOCATED": "maybe"}, "PDSERVE_COLOCATED='maybe': expected one of"),
])
def test_malformed_variable_is_a_usage_error_naming_it(env, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser(env)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
