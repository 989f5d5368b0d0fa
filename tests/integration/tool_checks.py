"""Tool calling through a real router, with the official ``openai`` client: the checks the
colocated router and the 1 prefill + 1 decode cluster both pass, each on its module's cluster.

``required`` and a named function decode under the tools' schemas (services/router/tools): every
call's arguments validate, whole and streamed, at temperature 1. ``auto`` leaves the choice to
the model and round-trips a tool result through the history. Bad tools get 400 naming the field.
"""

from __future__ import annotations

import json

import jsonschema
import openai

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}}]
# auto: a short signature, so that the history with a call and its result fits a 256-token context
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SHORT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
MAX_TOKENS = 40


def _valid(calls, schema: dict = WEATHER) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schema)


def required_and_named_calls_validate(api: openai.OpenAI, model: str) -> None:
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = api.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                            parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=1,
                                            seed=11, n=2)
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content is None
            _valid(choice.message.tool_calls)
        stream = api.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                             parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=1,
                                             seed=12, stream=True)
        pieces: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            if not chunk.choices:
                continue
            finish = chunk.choices[0].finish_reason or finish
            for delta in chunk.choices[0].delta.tool_calls or []:  # OpenAI's accumulation rule
                entry = pieces.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
        assert finish == "tool_calls" and list(pieces) == [0], (tool_choice, pieces)
        assert pieces[0]["id"].startswith("call_") and pieces[0]["name"] == "get_weather"
        jsonschema.validate(json.loads(pieces[0]["arguments"]), WEATHER)


def auto_round_trips_a_tool_result(api: openai.OpenAI, model: str) -> None:
    first = api.chat.completions.create(model=model, messages=MESSAGES, tools=SHORT_TOOLS, max_tokens=MAX_TOKENS,
                                        temperature=0)
    message = first.choices[0].message
    if message.tool_calls:  # the model's own choice: whatever it called must be a valid call
        _valid(message.tool_calls, CITY)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"}]
    reply = api.chat.completions.create(model=model, messages=history, tools=SHORT_TOOLS, max_tokens=8,
                                        temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were rendered
    plain = api.chat.completions.create(model=model, messages=history, max_tokens=4, temperature=0)
    assert plain.choices[0].message.content is not None and not plain.choices[0].message.tool_calls


BAD = [  # (request fields, the field the 400 names)
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
]


def bad_tools_get_400_and_the_server_keeps_serving(api: openai.OpenAI, model: str) -> None:
    for fields, param in BAD:
        try:
            api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **fields)
        except openai.BadRequestError as error:
            assert error.status_code == 400 and error.param == param, (fields, error.body)
        else:
            raise AssertionError(f"{fields} was served")
    reply = api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3
