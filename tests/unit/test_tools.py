"""Tool calling's pure parts (services/router/tools): the request's tools and tool_choice, the
constraint each choice decodes under (compiled by the real grammar engine; decoded by the engine
in tests/integration/test_structured_outputs.py), the Hermes parser whole and streamed
character by character, and the history rendered for a template that does not know tools."""

from __future__ import annotations

import json

import pytest

from services.router.errors import InvalidRequest
from services.router.tools.calls import NamedCallStream, calls_from_required
from services.router.tools.hermes import Call, Content, HermesStream, parse_calls
from services.router.tools.render import render_messages
from services.router.tools.spec import ToolChoice, parse_tool_choice, parse_tools, tool_constraint

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
NAMES = frozenset({"get_weather", "add"})


@pytest.mark.parametrize("tools, field, words", [
    ({"type": "function"}, "tools", "must be a list"),
    ([{"type": "retrieval"}], "tools[0].type", "must be"),
    ([{"type": "function", "function": "add"}], "tools[0].function", "must be an object"),
    ([{"type": "function", "function": {"name": "no spaces"}}], "tools[0].function.name", "1-64 letters"),
    ([TOOLS[1], TOOLS[1]], "tools[1].function.name", "already the name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters",
     "JSON schema object"),
])
def test_bad_tools_name_the_field(tools, field, words):
    with pytest.raises(InvalidRequest, match=words) as info:
        parse_tools(tools)
    assert info.value.param == field and info.value.status == 400


def test_tools_and_their_choice():
    tools = parse_tools(TOOLS)
    assert [t.name for t in tools] == ["get_weather", "add"] and tools[1].field == "tools[1].function.parameters"
    assert parse_tools([{"type": "function", "function": {"name": "ping"}}])[0].parameters["type"] == "object"
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice("required", tools) == ToolChoice("required")
    assert parse_tool_choice({"type": "function", "function": {"name": "add"}}, tools) == ToolChoice("function", "add")
    for choice, field in [("always", "tool_choice"), ({"type": "function"}, "tool_choice"),
                          ({"type": "function", "function": {"name": "mul"}}, "tool_choice.function.name")]:
        with pytest.raises(InvalidRequest) as info:
            parse_tool_choice(choice, tools)
        assert info.value.param == field
    with pytest.raises(InvalidRequest, match="needs tools"):
        parse_tool_choice("required", [])


def test_the_constraints_compile_and_refuse_what_they_must(compiler):
    tools = parse_tools(TOOLS)
    assert tool_constraint(ToolChoice("auto"), tools) is None and tool_constraint(ToolChoice("none"), tools) is None
    named = tool_constraint(ToolChoice("function", "add"), tools)
    assert named is not None and named.json == ADD and named.field == "tools[1].function.parameters"
    required = tool_constraint(ToolChoice("required"), tools)
    assert required is not None and required.field == "tools"
    assert isinstance(required.json, dict) and "maxItems" not in required.json
    single = tool_constraint(ToolChoice("required"), tools, parallel=False)
    assert single is not None and isinstance(single.json, dict) and single.json["maxItems"] == 1
    for constraint in (named, required, single):
        compiler.compile(constraint)  # raises StructuredOutputError naming the field if not


def test_hermes_whole_and_streamed_alike():
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
            '</tool_call>\n<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')
    content, calls = parse_calls(text, NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo", "unit": "c"}),
                                                                   ("add", {"a": 1, "b": 2})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    stream = HermesStream(NAMES)
    events = [e for ch in text for e in stream.feed(ch)] + stream.finish()
    assert "".join(e.text for e in events if isinstance(e, Content)).strip() == "Let me check."
    assert [(e.index, e.call.name, e.call.arguments) for e in events if isinstance(e, Call)] == [
        (i, c.name, c.arguments) for i, c in enumerate(calls)]
    assert not any(isinstance(e, Content) and "<" in e.text for e in events)  # no tag leaked as content


def test_hermes_keeps_what_is_not_a_call():
    assert parse_calls("2 < 3 and <tool_", NAMES) == ("2 < 3 and <tool_", [])  # a held prefix comes out at the end
    bad_json = 'x <tool_call>{"name": "add", "arguments": {</tool_call>'
    assert parse_calls(bad_json, NAMES) == (bad_json, [])
    unknown = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    assert parse_calls(unknown, NAMES) == (unknown, [])
    cut = parse_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', NAMES)  # max_tokens
    assert cut[0] is None and [c.name for c in cut[1]] == ["add"]
    stream = HermesStream(NAMES)
    assert stream.feed("Hello <tool") == [Content("Hello ")]  # the tag's start is held back
    assert stream.feed("box>") == [Content("<toolbox>")]


def test_named_stream_and_required_reply():
    stream = NamedCallStream("add")
    first = stream.feed('{"a": ')
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "add", "arguments": '{"a": '}
    assert stream.feed('1, "b": 2}') == {"index": 0, "function": {"arguments": '1, "b": 2}'}}
    assert stream.feed("") is None
    assert [c.name for c in calls_from_required('[{"name": "add", "arguments": {"a": 1, "b": 2}}]', NAMES)] == ["add"]
    assert calls_from_required('[{"name": "add", "arguments": {"a": 1', NAMES) == []  # cut at max_tokens


def test_history_rendered_for_a_template_without_tools():
    from engine.models.chat_template import check_messages
    from engine.models.loader import load_tokenizer

    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo, and 1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "unit": "c"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "3"},
    ]
    rendered = render_messages(history, parse_tools(TOOLS))
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2]["content"].count("<tool_call>") == 2
    assert parse_calls(rendered[2]["content"], NAMES)[1][1].arguments == '{"a": 1, "b": 2}'  # reads back
    assert rendered[3]["content"] == "<tool_response>\n4 C\n</tool_response>\n<tool_response>\n3\n</tool_response>"
    check_messages(rendered)
    prompt = load_tokenizer().apply_chat_template(rendered)
    assert "<tools>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert render_messages([{"role": "user", "content": "hi"}], [])[0] == {"role": "user", "content": "hi"}
    with pytest.raises(InvalidRequest) as info:
        render_messages([{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": "{oops"}}]}], [])
    assert info.value.param == "messages[0].tool_calls[0].function.arguments"


def _stream(reply, text):
    """The delta fields of ``text`` fed a character at a time, then the finish."""
    fields = [reply.delta(ch) for ch in text] + [reply.finish()]
    return [f for f in fields if f]


def test_replies_whole_and_streamed_per_choice():
    from services.router.tools.reply import ToolReply

    tools = parse_tools(TOOLS)
    said = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    message, finish = ToolReply(ToolChoice("auto"), tools).message(said, "stop")
    assert finish == "tool_calls" and message["content"] == "Sure."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("add", '{"a": 1, "b": 2}')]
    assert ToolReply(ToolChoice("auto"), tools).message("Just text.", "stop") == (
        {"role": "assistant", "content": "Just text."}, "stop")
    streamed = _stream(ToolReply(ToolChoice("auto"), tools), said)
    assert "".join(f.get("content", "") for f in streamed) == "Sure. "
    calls = [c for f in streamed for c in f.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "add"

    array = '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]'
    message, finish = ToolReply(ToolChoice("required"), tools).message(array, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    reply = ToolReply(ToolChoice("required"), tools)
    assert _stream(reply, array)[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert reply.finish_reason("stop") == "tool_calls"
    cut = ToolReply(ToolChoice("required"), tools)
    assert _stream(cut, array[:20]) == [{"content": array[:20]}] and cut.finish_reason("length") == "length"

    arguments = '{"a": 4, "b": 5}'
    message, finish = ToolReply(ToolChoice("function", "add"), tools).message(arguments, "stop")
    assert finish == "tool_calls" and message["tool_calls"][0]["function"] == {"name": "add", "arguments": arguments}
    streamed = _stream(ToolReply(ToolChoice("function", "add"), tools), arguments)
    assert streamed[0]["tool_calls"][0]["function"]["name"] == "add"
    assert "".join(f["tool_calls"][0]["function"]["arguments"] for f in streamed) == arguments
    assert all(f["tool_calls"][0]["index"] == 0 for f in streamed)
