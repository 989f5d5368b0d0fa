"""The router's request limits and the input checks in front of them (fast, no workers).

RequestLimits / check_limits (services/router/pipeline/limits.py), their flags (limit_flags.py), and
the parsing checks the bad-input matrix relies on (openai_protocol.py): lone surrogates,
invalid UTF-8, deep nesting, refused chat-template fields, the ``timeout`` field.
"""

from __future__ import annotations

import argparse
import json

import pytest

from engine.sampling_params import SamplingParams
from services.router.errors import InvalidRequest
from services.router.http.protocol import parse_chat_request, parse_completion_request, parse_json_body
from services.router.limit_flags import add_limit_arguments, limits_from
from services.router.pipeline.limits import RequestLimits, check_limits, context_length_error

SMALL = RequestLimits(max_n=4, max_stop_strings=2, max_stop_chars=5, max_logprobs=3,
                      max_logit_bias=2, max_bad_words=1, max_token_id_list=3, max_cache_salt_chars=8)


@pytest.mark.parametrize("params, param, words", [
    (SamplingParams(n=5), "n", r"n must be in \[1, 4\], got 5"),
    (SamplingParams(stop=["a", "b", "c"]), "stop", "stop has 3 stop strings; at most 2"),
    (SamplingParams(stop=["abcdef"]), "stop", r"stop\[0\] is 6 characters; at most 5"),
    (SamplingParams(logprobs=4), "logprobs", r"logprobs must be in \[0, 3\], got 4"),
    (SamplingParams(prompt_logprobs=4), "prompt_logprobs", r"prompt_logprobs must be in \[0, 3\]"),
    (SamplingParams(logit_bias={1: 1.0, 2: 1.0, 3: 1.0}), "logit_bias", "logit_bias has 3 entries"),
    (SamplingParams(bad_words=["x", "y"]), "bad_words", "bad_words has 2 words; at most 1"),
    (SamplingParams(allowed_token_ids=[1, 2, 3, 4]), "allowed_token_ids", "has 4 token ids"),
    (SamplingParams(stop_token_ids=[1, 2, 3, 4]), "stop_token_ids", "has 4 token ids"),
    (SamplingParams(cache_salt="s" * 9), "cache_salt", "cache_salt is 9 characters; at most 8"),
])
def test_check_limits_names_the_field_and_the_limit(params, param, words):
    with pytest.raises(InvalidRequest, match=words) as info:
        check_limits(params, SMALL)
    assert info.value.param == param and info.value.status == 400


def test_within_limits_passes():
    check_limits(SamplingParams(n=4, stop=["ab", "cd"], logprobs=3, logit_bias={1: 2.0},
                                bad_words=["x"], allowed_token_ids=[1, 2, 3], cache_salt="t"), SMALL)


def test_limits_are_positive_and_below_the_engine_ceilings():
    with pytest.raises(ValueError, match="max_n must be an integer >= 1, got 0"):
        RequestLimits(max_n=0)
    with pytest.raises(ValueError, match="max_logprobs must be at most 20"):
        RequestLimits(max_logprobs=21)


def test_flags_come_from_the_dataclass_fields(monkeypatch):
    monkeypatch.setenv("PDSERVE_MAX_QUEUED_REQUESTS", "7")
    parser = argparse.ArgumentParser()
    add_limit_arguments(parser)
    limits, admission = limits_from(parser.parse_args(["--max-stop-strings", "3"]))
    assert limits.max_stop_strings == 3 and limits.max_n == RequestLimits().max_n
    assert admission.max_queued_requests == 7
    with pytest.raises(ValueError, match="--max-running-requests must be an integer >= 1"):
        limits_from(parser.parse_args(["--max-running-requests", "0"]))


def test_a_malformed_limit_variable_is_a_usage_error_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_MAX_QUEUED_REQUESTS", "seven")
    with pytest.raises(SystemExit) as exit_info:
        add_limit_arguments(argparse.ArgumentParser())
    assert exit_info.value.code == 2
    assert "PDSERVE_MAX_QUEUED_REQUESTS" in capsys.readouterr().err


def test_context_length_wording_is_openais():
    error = context_length_error(2048, 2000, 100, "messages")
    assert error.message == ("This model's maximum context length is 2048 tokens. However, you "
                             "requested 2100 tokens (2000 in the messages, 100 in the completion). "
                             "Please reduce the length of the messages or completion.")
    assert (error.code, error.param, error.status) == ("context_length_exceeded", "messages", 400)


@pytest.mark.parametrize("raw, words", [
    (b'{"prompt": "a\xff"}', "not valid UTF-8: invalid start byte at byte 13"),
    (b'{"prompt": ', "not valid JSON: Expecting value"),
    (b"[" * 100_000, "nested too deeply"),
    (b'[1, 2]', "must be a JSON object, got list"),
])
def test_undecodable_bodies_are_refused_without_internals(raw, words):
    with pytest.raises(InvalidRequest, match=words) as info:
        parse_json_body(raw)
    assert "/" not in info.value.message and "Traceback" not in info.value.message


@pytest.mark.parametrize("body, param", [
    ('{"prompt": "hi \\ud800"}', "prompt"),
    ('{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    ('{"prompt": "x", "stop": ["ok", "\\ud83d"]}', "stop"),
])
def test_lone_surrogates_are_refused_naming_the_field(body, param):
    with pytest.raises(InvalidRequest, match="lone UTF-16 surrogate") as info:
        parse_json_body(body.encode())
    assert info.value.param == param


def test_a_surrogate_pair_is_one_valid_character():
    assert parse_json_body(b'{"prompt": "\\ud83d\\ude00"}')["prompt"] == "\U0001F600"


@pytest.mark.parametrize("name, value", [("chat_template", "{{ 7 * 7 }}"),
                                         ("chat_template_kwargs", {"enable_thinking": True})])
def test_user_chat_templates_are_refused(name, value):
    with pytest.raises(InvalidRequest, match=f"{name} is not accepted") as info:
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], name: value})
    assert info.value.param == name


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan"), "5", True])
def test_timeout_must_be_a_positive_number(timeout):
    with pytest.raises(InvalidRequest, match="timeout must be") as info:
        parse_completion_request({"prompt": "hi", "timeout": timeout})
    assert info.value.param == "timeout"


def test_timeout_and_absurd_values_parse_as_documented():
    assert parse_completion_request({"prompt": "hi", "timeout": 2.5}).timeout_s == 2.5
    with pytest.raises(InvalidRequest, match="top_logprobs must be in \\[0, 20\\]"):
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                            "top_logprobs": 1000})
    with pytest.raises(InvalidRequest, match="n must be an integer, got True"):
        parse_completion_request({"prompt": "hi", "n": True})
    with pytest.raises(InvalidRequest, match="max_tokens must be an integer, got inf"):
        parse_completion_request(parse_json_body(b'{"prompt": "hi", "max_tokens": 1e999}'))
    with pytest.raises(InvalidRequest, match="logit_bias keys must be token ids"):
        parse_completion_request({"prompt": "hi", "logit_bias": {"\u0663": 1}})  # an Arabic-Indic 3
    body = parse_json_body(json.dumps({"prompt": "hi", "temperature": float("nan")}).encode())
    assert parse_completion_request(body).params.temperature != 0  # NaN: validate() refuses it
