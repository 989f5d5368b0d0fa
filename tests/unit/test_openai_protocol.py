"""OpenAI request parsing (JSON -> SamplingParams, prompts, messages), errors and response shapes."""

from __future__ import annotations

import json
import math

import pytest

from engine.sampling.logprobs import PositionLogprobs
from services.router.errors import InvalidRequest
from services.router.http.protocol import (
    error_body,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from services.router.http.responses import (
    NEG_INF_LOGPROB,
    chat_logprobs_json,
    completion_logprobs_json,
    usage_json,
)
from services.router.pipeline.generation import Usage


def test_completion_request_maps_every_sampling_field():
    request = parse_completion_request({
        "model": "m", "prompt": "hi", "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 40,
        "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
        "logit_bias": {"7": 3, "-1": -2.5}, "seed": 11, "max_tokens": 20, "min_tokens": 2,
        "stop": "\n", "stop_token_ids": [5], "include_stop_str_in_output": True, "ignore_eos": True,
        "skip_special_tokens": False, "logprobs": 3, "allowed_token_ids": [1, 2], "bad_words": ["x"],
        "cache_salt": "tenant-a", "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True})
    p = request.params
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (2, 0.5, 0.9, 40, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.logit_bias == {7: 3.0, -1: -2.5}  # -1 is left for validate() to reject
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (11, 20, 2, 3)
    assert (p.stop, p.stop_token_ids, p.allowed_token_ids, p.bad_words) == (["\n"], [5], [1, 2], ["x"])
    assert p.include_stop_str_in_output and p.ignore_eos and not p.skip_special_tokens
    assert p.cache_salt == "tenant-a"
    assert request.prompt == "hi" and request.model == "m" and not request.is_chat
    assert request.stream and request.include_usage and request.return_token_ids


def test_completion_defaults_follow_openai():
    request = parse_completion_request({"prompt": "hi"})
    p = request.params
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.n == 1 and p.logprobs is None
    assert p.stop == [] and request.model is None and not request.stream


@pytest.mark.parametrize("prompt, expected", [
    ("text", "text"), (["text"], "text"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5]),
])
def test_prompt_forms(prompt, expected):
    assert parse_completion_request({"prompt": prompt}).prompt == expected


@pytest.mark.parametrize("body, param, words", [
    ({}, "prompt", "required"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt"),
    ({"prompt": [1, "a"]}, "prompt", "token ids"),
    ({"prompt": [1, True]}, "prompt", "token ids"),
    ({"prompt": 5}, "prompt", "string or a list"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "must be a number"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", "must be an integer"),
    ({"prompt": "x", "n": True}, "n", "must be an integer"),
    ({"prompt": "x", "stream": "yes"}, "stream", "must be a boolean"),
    ({"prompt": "x", "stop": [1]}, "stop", "list of strings"),
    ({"prompt": "x", "stop_token_ids": "5"}, "stop_token_ids", "list of integers"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "token ids"),
    ({"prompt": "x", "logit_bias": {"1": "big"}}, "logit_bias", "must be a number"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "boolean"),
    ({"prompt": "x", "echo": True}, "echo", "not supported"),
    ({"prompt": "x", "best_of": 3}, "best_of", "not supported"),
    ({"prompt": "x", "cache_salt": 7}, "cache_salt", "must be a string"),
])
def test_completion_request_errors_name_the_field(body, param, words):
    with pytest.raises(InvalidRequest, match=words) as info:
        parse_completion_request(body)
    assert info.value.param == param


def test_nan_and_infinity_literals_parse_then_fail_validation():
    # Python's JSON reader accepts NaN / Infinity; validate() rejects them with the field name.
    body = parse_json_body(b'{"prompt": "x", "temperature": NaN, "top_p": Infinity}')
    params = parse_completion_request(body).params
    assert math.isnan(params.temperature)
    with pytest.raises(ValueError, match="temperature must be finite"):
        params.validate(vocab_size=100, max_model_len=64, prompt_len=1)


@pytest.mark.parametrize("raw, words", [
    (b"{bad", "not valid JSON"), (b"[1, 2]", "must be a JSON object"), (b"\xff\xfe", "not valid JSON"),
])
def test_malformed_bodies(raw, words):
    with pytest.raises(InvalidRequest, match=words):
        parse_json_body(raw)


def test_chat_request_flattens_text_parts_and_maps_logprobs():
    request = parse_chat_request({
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": None}],
        "logprobs": True, "top_logprobs": 4, "max_completion_tokens": 9, "max_tokens": 99})
    assert request.messages == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "a\nb"},
                                {"role": "assistant", "content": ""}]
    assert request.params.logprobs == 4 and request.params.max_tokens == 9
    assert request.is_chat and request.add_generation_prompt


def test_chat_defaults():
    request = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]})
    assert request.params.max_tokens is None  # until the context is full
    assert request.params.logprobs is None
    assert parse_chat_request({"messages": [{"role": "user", "content": "hi"}],
                               "logprobs": True}).params.logprobs == 0


@pytest.mark.parametrize("body, param, words", [
    ({}, "messages", "required"),
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": ["hi"]}, "messages", "string role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages", "only text parts"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "string or a list"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs", "boolean"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function",
     "must be an object"),
    ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format", "text"),
])
def test_chat_request_errors(body, param, words):
    with pytest.raises(InvalidRequest, match=words) as info:
        parse_chat_request(body)
    assert info.value.param == param


def test_error_body_has_openai_shape():
    assert error_body("bad n", "n") == {"error": {
        "message": "bad n", "type": "invalid_request_error", "param": "n", "code": None}}


def test_usage_json():
    assert usage_json(Usage(prompt_tokens=5, completion_tokens=7, cached_tokens=4)) == {
        "prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 4}}


TEXT = {1: "a", 2: "bc", 3: "d"}


def test_completion_logprobs_include_sampled_token_and_map_neg_inf():
    entries = [PositionLogprobs(2, -0.5, 2, [(1, -0.1), (3, -math.inf)]),
               PositionLogprobs(1, -0.2, 1, [(1, -0.2)])]
    body = completion_logprobs_json(entries, TEXT.__getitem__, text_offset=10)
    assert body == {"tokens": ["bc", "a"], "token_logprobs": [-0.5, -0.2],
                    "top_logprobs": [{"a": -0.1, "d": NEG_INF_LOGPROB, "bc": -0.5}, {"a": -0.2}],
                    "text_offset": [10, 12]}
    json.dumps(body, allow_nan=False)  # no -inf left


def test_chat_logprobs_shape():
    body = chat_logprobs_json([PositionLogprobs(3, -math.inf, 2, [(1, -0.1)])], TEXT.__getitem__)
    assert body == {"content": [{"token": "d", "logprob": NEG_INF_LOGPROB, "bytes": [100],
                                 "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}]}]}


def test_chat_request_with_tools_renders_them_and_constrains_required_calls():
    from services.router.tools.spec import ToolChoice

    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    body = {"messages": [{"role": "user", "content": "1+1?"}], "tools": [tool]}
    auto = parse_chat_request(body)
    assert auto.tool_choice == ToolChoice("auto") and [t.name for t in auto.tools] == ["add"]
    assert auto.messages[0]["role"] == "system" and '"name": "add"' in auto.messages[0]["content"]
    assert auto.params.structured_outputs is None  # auto: free text, parsed for <tool_call> blocks
    required = parse_chat_request({**body, "tool_choice": "required", "parallel_tool_calls": False})
    assert required.params.structured_outputs is not None and required.params.structured_outputs.field == "tools"
    assert required.params.structured_outputs.json["maxItems"] == 1
    named = parse_chat_request({**body, "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert named.params.structured_outputs.json == tool["function"]["parameters"]
    none = parse_chat_request({**body, "tool_choice": "none"})
    assert none.tool_choice == ToolChoice("none") and none.messages == body["messages"]  # tools not offered
    history = parse_chat_request({"messages": [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}]})
    assert [m["role"] for m in history.messages] == ["user", "assistant", "user"]
    assert "<tool_call>" in history.messages[1]["content"] and "<tool_response>" in history.messages[2]["content"]
    plain = parse_chat_request({"messages": [{"role": "user", "content": "hi", "name": "ann"}]})
    assert plain.messages == [{"role": "user", "content": "hi", "name": "ann"}]  # untouched without tools


def _renderer(body: dict, parse=parse_completion_request, n: int = 1):
    from types import SimpleNamespace

    from services.router.http.responses import ResponseRenderer

    api = parse({"model": "m", "stream": True, "n": n, **body})
    frontend = SimpleNamespace(model=SimpleNamespace(name="m"),
                               tokenizer=SimpleNamespace(decode=lambda ids, **_: "t"))
    generation = SimpleNamespace(request_id="r-1", params=api.params, prompt_token_ids=[1, 2],
                                 usage=Usage(prompt_tokens=2))
    return ResponseRenderer(api, frontend, generation)  # type: ignore[arg-type]


_CHUNK_BODIES = [
    ({"prompt": "hi"}, parse_completion_request),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, parse_completion_request),
    ({"prompt": "hi", "logprobs": 2}, parse_completion_request),
    ({"prompt": "hi", "return_token_ids": True}, parse_completion_request),
    ({"messages": [{"role": "user", "content": "hi"}]}, parse_chat_request),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
     parse_chat_request),
]


@pytest.mark.parametrize("body, parse", _CHUNK_BODIES)
def test_chunk_json_is_the_chunk_dumped(body, parse):
    """The templated text-only chunk is byte for byte what dumping the chunk's dict gives, for
    any text (quotes, escapes, control characters, astral and lone-surrogate code points), every
    sample index, and the chunks that do not take the template (finish, logprobs, token ids)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from services.router.http.responses import dumps
    from services.router.pipeline.generation import SampleDelta

    position = PositionLogprobs(5, -0.5, 1, [(5, -0.5)])
    wants_logprobs = "logprobs" in body

    @settings(max_examples=150, deadline=None)
    @given(text=st.text(st.characters(codec=None, categories=None)), index=st.integers(0, 2),
           finish=st.sampled_from([None, None, "stop", "length"]))
    def check(text, index, finish):
        def warm():  # one chunk first (a renderer keeps text offsets, the prompt ids sent)
            return SampleDelta(index, "warm", [5], [position] if wants_logprobs else None)

        delta = SampleDelta(index, text, [5], [position] if wants_logprobs else None,
                            finish_reason=finish, stop_reason="\n" if finish == "stop" else None)
        render, templated = _renderer(body, parse, n=3), _renderer(body, parse, n=3)
        templated.created = render.created  # each read the clock: they may straddle a second
        render.chunk(warm())
        templated.chunk_json(warm())
        expected = render.chunk(delta)
        got = templated.chunk_json(delta)
        assert got == (None if expected is None else dumps(expected))
        assert got is None or json.loads(got) == json.loads(dumps(expected))

    check()
