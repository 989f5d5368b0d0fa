"""StructuredOutputsParams: shape checks naming the field, the cache key, and SamplingParams."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from engine.structured.errors import StructuredOutputError
from engine.structured.params import StructuredOutputsParams
from engine.structured.schema_check import unsupported_keyword


def test_a_dict_in_sampling_params_becomes_the_params_object():
    params = SamplingParams(structured_outputs={"regex": "a+", "field": "guided_regex"})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+", field="guided_regex")
    params.validate(100, 64)


@pytest.mark.parametrize("kwargs, field, words", [
    ({}, "structured_outputs", "exactly one"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs", "exactly one"),
    ({"json": "{not json", "field": "response_format.json_schema"}, "response_format.json_schema", "not valid JSON"),
    ({"json": "[1, 2]"}, "structured_outputs.json", "object"),
    ({"choice": ["a", ""]}, "structured_outputs.choice", "non-empty"),
    ({"regex": ""}, "structured_outputs.regex", "non-empty string"),
    ({"grammar": 5}, "structured_outputs.grammar", "non-empty string"),
])
def test_malformed_constraints_raise_naming_the_field(kwargs, field, words):
    with pytest.raises(StructuredOutputError, match=words) as info:
        StructuredOutputsParams(**kwargs).validate()
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_unknown_keys_in_a_dict_are_refused():
    with pytest.raises(StructuredOutputError, match="unknown keys"):
        SamplingParams(structured_outputs={"json_schema": {}})


def test_the_key_depends_on_kind_strictness_and_order_not_on_the_field():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {}, "y": {}}}, field="a")
    same_text = StructuredOutputsParams(json='{"type": "object", "properties": {"x": {}, "y": {}}}', field="b")
    reordered = StructuredOutputsParams(json={"type": "object", "properties": {"y": {}, "x": {}}})
    loose = StructuredOutputsParams(json=a.json, strict=False)
    assert a.key == same_text.key
    assert len({a.key, reordered.key, loose.key}) == 3
    assert StructuredOutputsParams(regex="a").key != StructuredOutputsParams(grammar="a").key


@pytest.mark.parametrize("schema, pointer", [
    ({"not": {"type": "string"}}, "/not"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "credit-card"}}}, "/properties/a/format"),
    ({"$ref": "https://example.com/s.json"}, "/$ref"),
    ({"type": "array", "items": {"allOf": [{"type": "integer"}, {"minimum": 3}]}}, "/items/allOf"),
    ({"anyOf": [{"type": "string"}, {"$defs": {"x": {"not": {}}}}]}, "/anyOf/1/$defs/x/not"),
])
def test_keywords_the_engine_would_not_enforce_are_found(schema, pointer):
    found = unsupported_keyword(schema)
    assert found is not None and found[0] == pointer


def test_supported_schemas_pass_the_keyword_check():
    schema = {"type": "object", "$defs": {"p": {"type": "string", "format": "email"}},
              "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"type": "array", "uniqueItems": True,
                                                                "items": {"enum": [1, 2]}, "maxItems": 2},
                             "c": {"anyOf": [{"type": "number", "minimum": 0}, {"type": "null"}]}},
              "required": ["a"]}
    assert unsupported_keyword(schema) is None


def test_the_wire_carries_a_schema_as_its_json_text_in_property_order():
    from services.common.pb import generate_pb2
    from services.common.wire import params_from_proto, params_to_proto

    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "string"}},
              "required": ["zeta", "alpha"]}
    params = SamplingParams(max_tokens=3, structured_outputs={"json": schema, "field": "guided_json"})
    msg = params_to_proto(params)
    assert msg.structured_outputs.WhichOneof("kind") == "json"
    assert msg.structured_outputs.json == '{"type":"object","properties":{"zeta":{"type":"integer"},' \
                                          '"alpha":{"type":"string"}},"required":["zeta","alpha"]}'
    back = params_from_proto(generate_pb2.SamplingParams.FromString(msg.SerializeToString()))
    assert back.structured_outputs == StructuredOutputsParams(json=msg.structured_outputs.json, field="guided_json")
    assert back.structured_outputs.key == params.structured_outputs.key  # compiles to the same grammar
    assert back.structured_outputs.schema() == schema and list(back.structured_outputs.schema()["properties"]) == [
        "zeta", "alpha"]


def test_an_absent_constraint_is_unconstrained_and_an_empty_one_is_refused_naming_its_field():
    from services.common.pb import generate_pb2
    from services.common.wire import params_from_proto, params_to_proto

    assert not params_to_proto(SamplingParams(max_tokens=3)).HasField("structured_outputs")
    assert params_from_proto(generate_pb2.SamplingParams(max_tokens=3)).structured_outputs is None  # an old client
    empty = params_from_proto(generate_pb2.SamplingParams(
        structured_outputs=generate_pb2.StructuredOutputs(field="guided_regex")))
    with pytest.raises(StructuredOutputError, match="exactly one") as info:
        empty.validate(100, 64)
    assert info.value.field == "guided_regex"
    with pytest.raises(StructuredOutputError, match="exactly one"):
        params_to_proto(SamplingParams(structured_outputs=StructuredOutputsParams()))
