"""OpenAI / vLLM structured-output fields -> SamplingParams.structured_outputs, naming the field.

The parse is pure (services/router/http/structured.py); the Frontend's schema-keyword check is
run here too, since it is what refuses an unsupported keyword before any worker sees it.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.structured.params import StructuredOutputsParams as S
from services.router.errors import InvalidRequest
from services.router.http.protocol import parse_chat_request, parse_completion_request

CHAT = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields):
    return parse_chat_request({"messages": CHAT, **fields}).params.structured_outputs


def completion(**fields):
    return parse_completion_request({"prompt": "hi", **fields}).params.structured_outputs


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, S(json_object=True, field="response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     S(json=SCHEMA, field="response_format.json_schema")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": False}}},
     S(json=SCHEMA, strict=False, field="response_format.json_schema")),
    ({"guided_json": SCHEMA}, S(json=SCHEMA, field="guided_json")),
    ({"guided_json": '{"type": "string"}'}, S(json='{"type": "string"}', field="guided_json")),
    ({"guided_regex": "[0-9]+"}, S(regex="[0-9]+", field="guided_regex")),
    ({"guided_choice": ["yes", "no"]}, S(choice=["yes", "no"], field="guided_choice")),
    ({"guided_grammar": 'root ::= "a"'}, S(grammar='root ::= "a"', field="guided_grammar")),
    ({"structured_outputs": {"json": SCHEMA}}, S(json=SCHEMA, field="structured_outputs.json")),
    ({"structured_outputs": {"regex": "a+"}}, S(regex="a+", field="structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["x"]}}, S(choice=["x"], field="structured_outputs.choice")),
    ({"structured_outputs": {"grammar": "root ::= [a-z]+"}},
     S(grammar="root ::= [a-z]+", field="structured_outputs.grammar")),
    ({"structured_outputs": {"json_object": True}}, S(json_object=True, field="structured_outputs.json_object")),
    ({"structured_outputs": {"json_object": False, "regex": "a"}}, S(regex="a", field="structured_outputs.regex")),
])
def test_each_form_maps_to_one_constraint_on_both_endpoints(fields, expected):
    assert chat(**fields) == expected
    assert completion(**fields) == expected


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": "json"}, "response_format", "json_object"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "schema must be a JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema", "schema must be a JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema", "strict must be a boolean"),
    ({"guided_json": 5}, "guided_json", "JSON schema"),
    ({"guided_regex": ["a"]}, "guided_regex", "must be a string"),
    ({"guided_choice": "yes"}, "guided_choice", "list of strings"),
    ({"guided_choice": ["a", 1]}, "guided_choice", "list of strings"),
    ({"guided_grammar": {}}, "guided_grammar", "must be a string"),
    ({"structured_outputs": "a+"}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {"regx": "a+"}}, "structured_outputs", "unknown keys"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object", "must be true"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "guided_regex and guided_choice are both set"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "response_format",
     "response_format and guided_json are both set"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.regex",
     "structured_outputs.regex and structured_outputs.choice are both set"),
])
def test_bad_or_doubled_constraints_are_refused_naming_the_field(fields, param, words):
    for parse in (chat, completion):
        with pytest.raises(InvalidRequest, match=words) as info:
            parse(**fields)
        assert info.value.param == param and info.value.status == 400


def _frontend_check(params):
    """The Frontend's checks of a constraint: shape (``check``) and schema keywords."""
    from services.router.pipeline.frontend import Frontend

    class _Model:
        name, vocab_size, max_model_len = "m", 100, 64

    class _Tokenizer:
        def encode(self, text, add_special_tokens=False):
            return [1]

    frontend = Frontend(_Tokenizer(), backend=None, model=_Model())  # type: ignore[arg-type]
    params = frontend.check([1, 2], params)
    asyncio.run(frontend.check_constraint(params))


@pytest.mark.parametrize("fields, param, words", [
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {"type": "string"}}}}},
     "response_format.json_schema", "unsupported schema keyword at '/not'"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"d": {"format": "color"}}}}},
     "structured_outputs.json", "unsupported schema keyword at '/properties/d/format'"),
])
def test_the_frontend_refuses_what_no_grammar_engine_would_take_naming_the_field(fields, param, words):
    params = parse_completion_request({"prompt": "hi", "max_tokens": 4, **fields}).params
    with pytest.raises(InvalidRequest, match=words) as info:
        _frontend_check(params)
    assert info.value.param == param


def test_the_frontend_passes_a_supported_schema():
    _frontend_check(parse_completion_request({"prompt": "hi", "max_tokens": 4, "guided_json": SCHEMA}).params)
