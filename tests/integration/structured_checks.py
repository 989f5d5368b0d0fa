"""Structured outputs through a real router, with the official ``openai`` client: the checks the
colocated router (test_router_colocated.py), the 1 prefill + 1 decode cluster with n-gram
speculation (test_bad_input_matrix.py) and the clusters over each KV transfer (test_cluster.py)
pass, each on its own module's cluster.

Greedy constrained output must equal the offline engine's token for token (so colocated,
disaggregated, speculation on and off agree with each other); sampled output must validate
against its schema with ``jsonschema``; bad constraints get HTTP 400 naming the field, and the
server keeps serving. Short outputs: every schema's strings are short and its arrays small.

``every_schema_validates`` sends every schema of tests/integration/schemas.py at temperature 0
and 1 at once. A JSON number's fraction digits are unbounded (the schema bounds the value, not
its digits), so a sampled number may run on for many digits: the schemas with a number get
``NUMBER_MAX_TOKENS``, room for a run ten times longer than sampling produced here (at most 16
tokens for a whole reply), instead of the others' ``SCHEMA_MAX_TOKENS``, which bounds their
longest reply even at one token per character (``max_tokens_for``). The smaller checks sample NESTED only, and
decode MIXED (a number) greedily.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from engine.sampling_params import SamplingParams
from services.common.pb import generate_pb2, generate_pb2_grpc
from tests.integration.schemas import SCHEMAS, validate

if TYPE_CHECKING:  # imported where used: without the client only these checks fail, not their modules
    import openai

PROMPT = "Answer in JSON. Describe something."
MAX_TOKENS = 60
S = {"type": "string", "maxLength": 8}
# nested objects, an array with minItems/maxItems, enums
NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {
        "name": S, "role": {"enum": ["admin", "guest"]},
        "tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 2}},
        "required": ["name", "role", "tags"]}},
    "required": ["user"]}
# anyOf, a string pattern, numbers with bounds
MIXED = {"type": "object", "properties": {
    "shape": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 9}, {"type": "null"}]},
    "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"},
    "price": {"type": "number", "minimum": 0, "maximum": 100},
    "level": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["shape", "code", "price", "level"]}
REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["cat", "dog", "bird"]


def client(http_address: str) -> openai.OpenAI:
    import openai  # the test extras' (pyproject.toml)

    return openai.OpenAI(base_url=f"http://{http_address}/v1", api_key="unused", max_retries=0, timeout=60)


def json_schema(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


_OFFLINE: dict[str, tuple[list[int], str]] = {}  # schema -> the offline engine's greedy output, once a session


def offline_greedy(llm, schema: dict) -> tuple[list[int], str]:
    key = json.dumps(schema)
    if key not in _OFFLINE:
        (output,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs={
            "json": schema, "field": "response_format.json_schema"}))[0].outputs
        _OFFLINE[key] = (list(output.token_ids), output.text)
    return _OFFLINE[key]


def greedy_matches_the_offline_engine(api: openai.OpenAI, model: str, llm) -> None:
    """/v1/completions at temperature 0 with response_format json_schema: the offline engine's
    tokens (the same constraint, as the field it came from). One schema: each costs a request."""
    for schema in (MIXED,):
        expected_ids, expected_text = offline_greedy(llm, schema)
        reply = api.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"response_format": json_schema(schema), "return_token_ids": True})
        choice = reply.choices[0]
        assert choice.model_extra["token_ids"] == expected_ids, (choice.text, expected_text)
        assert choice.finish_reason == "stop", choice
        validate(choice.text, schema)


SCHEMA_MAX_TOKENS = 80
NUMBER_MAX_TOKENS = 160
KINDS = [(False, False), (False, True), (True, False), (True, True)]  # (is_chat, is_stream)


def max_tokens_for(schema: dict) -> int:
    """SCHEMA_MAX_TOKENS, or NUMBER_MAX_TOKENS for a schema with a JSON number (module docstring)."""
    return NUMBER_MAX_TOKENS if '"number"' in json.dumps(schema) else SCHEMA_MAX_TOKENS


@dataclass(frozen=True)
class SchemaRequest:
    """One request of ``every_schema_validates``: SCHEMAS[schema_index] at ``temperature``."""

    schema_index: int
    temperature: int
    is_chat: bool
    is_stream: bool

    @property
    def schema(self) -> dict:
        return SCHEMAS[self.schema_index]

    @property
    def seed(self) -> int:
        return 100 + self.schema_index


@dataclass
class Reply:
    text: str
    finish_reason: str | None
    token_ids: list[int]
    prompt_token_ids: list[int]


# Each temperature covers every kind (chat or completions, streamed or not); each schema gets
# two kinds, one per temperature.
SCHEMA_REQUESTS = [SchemaRequest(i, t, *KINDS[(i + t) % len(KINDS)]) for t in (0, 1) for i in range(len(SCHEMAS))]


def _send(api: openai.OpenAI, model: str, request: SchemaRequest) -> Reply:
    common = {"model": model, "max_tokens": max_tokens_for(request.schema), "temperature": request.temperature,
              "seed": request.seed, "stream": request.is_stream}
    if request.is_chat:  # chat: the official response_format argument; completions: vLLM's guided_json
        reply = api.chat.completions.create(messages=[{"role": "user", "content": PROMPT}],
                                            response_format=json_schema(request.schema),
                                            extra_body={"return_token_ids": True}, **common)
    else:
        reply = api.completions.create(prompt=PROMPT, extra_body={
            "guided_json": request.schema, "return_token_ids": True}, **common)
    if not request.is_stream:
        (choice,) = reply.choices
        text = choice.message.content if request.is_chat else choice.text
        return Reply(text, choice.finish_reason, choice.model_extra["token_ids"],
                     choice.model_extra["prompt_token_ids"])
    whole = Reply("", None, [], [])
    for chunk in reply:
        for choice in chunk.choices:
            whole.text += (choice.delta.content if request.is_chat else choice.text) or ""
            whole.finish_reason = choice.finish_reason or whole.finish_reason
            whole.token_ids += choice.model_extra.get("token_ids") or []
            whole.prompt_token_ids += choice.model_extra.get("prompt_token_ids") or []
    return whole


def offline_greedy_batch(llm, requests: list[tuple[list[int], dict]]) -> list[list[int]]:
    """The offline engine's greedy token ids for each (prompt ids, schema), the missing ones
    computed in one batch and kept for the session (``_OFFLINE_IDS``)."""
    keys = [(tuple(ids), json.dumps(schema)) for ids, schema in requests]
    missing = list(dict.fromkeys(key for key in keys if key not in _OFFLINE_IDS))
    if missing:
        outputs = llm.generate([list(ids) for ids, _ in missing], [SamplingParams(
            temperature=0, max_tokens=max_tokens_for(json.loads(schema)),
            structured_outputs={"json": schema, "field": "guided_json"}) for _, schema in missing])
        for key, output in zip(missing, outputs):
            _OFFLINE_IDS[key] = list(output.outputs[0].token_ids)
    return [_OFFLINE_IDS[key] for key in keys]


_OFFLINE_IDS: dict[tuple[tuple[int, ...], str], list[int]] = {}


def every_schema_validates(api: openai.OpenAI, model: str, llm, concurrency: int = 8) -> None:
    """Every schema (tests/integration/schemas.py) at temperature 0 and 1 (seeded), sent
    ``concurrency`` at a time (at most the router's queue bound), chat and completions,
    streamed and not: every reply stops and validates (formats included), and every greedy
    reply's tokens are the offline engine's for the same prompt and constraint."""
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(lambda request: _send(api, model, request), SCHEMA_REQUESTS))
    for request, reply in zip(SCHEMA_REQUESTS, replies):
        assert reply.finish_reason == "stop", (request, reply)
        validate(reply.text, request.schema)
    greedy = [(request, reply) for request, reply in zip(SCHEMA_REQUESTS, replies) if request.temperature == 0]
    expected = offline_greedy_batch(llm, [(reply.prompt_token_ids, request.schema) for request, reply in greedy])
    for (request, reply), want in zip(greedy, expected):
        assert reply.token_ids == want, (request, reply, llm.tokenizer.decode(want))


def chat_streamed_at_temperature_1_validates(api: openai.OpenAI, model: str, schema: dict = NESTED) -> None:
    """Chat, streamed, sampled, through vLLM's guided_json."""
    chunks = api.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                         max_tokens=MAX_TOKENS, temperature=1, seed=3, stream=True,
                                         extra_body={"guided_json": schema})
    parts = [(c.choices[0].delta.content or "", c.choices[0].finish_reason) for c in chunks if c.choices]
    assert parts[-1][1] == "stop", parts
    validate("".join(text for text, _ in parts), schema)


def sampled_and_streamed_output_validates(api: openai.OpenAI, model: str) -> None:
    """Chat not streamed at temperature 0 (response_format), streamed at 1 (guided_json), and
    completions streamed at 1 (response_format)."""
    reply = api.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                        max_tokens=MAX_TOKENS, temperature=0, response_format=json_schema(NESTED))
    assert reply.choices[0].finish_reason == "stop", reply
    validate(reply.choices[0].message.content, NESTED)
    chat_streamed_at_temperature_1_validates(api, model)
    stream = api.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1, seed=5,
                                    stream=True, extra_body={"response_format": json_schema(NESTED)})
    validate("".join(c.choices[0].text for c in stream if c.choices), NESTED)


def choice(api: openai.OpenAI, model: str) -> None:
    """n = 2 samples, each with its own matcher (the disaggregated router sends them as 2 requests)."""
    reply = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Best pet?"}],
                                        max_tokens=6, temperature=1, seed=3, n=2,
                                        extra_body={"structured_outputs": {"choice": CHOICES}})
    assert len(reply.choices) == 2 and all(c.message.content in CHOICES for c in reply.choices), reply.choices


def json_object_regex_and_choice(api: openai.OpenAI, model: str) -> None:
    reply = api.completions.create(model=model, prompt="Write JSON about a cat.", max_tokens=MAX_TOKENS, temperature=0,
                                   extra_body={"response_format": {"type": "json_object"}})
    assert reply.choices[0].finish_reason == "stop", reply
    assert isinstance(json.loads(reply.choices[0].text), dict)
    reply = api.completions.create(model=model, prompt="Phone number:", max_tokens=12, temperature=1, seed=2,
                                   extra_body={"guided_regex": REGEX})
    assert re.fullmatch(REGEX, reply.choices[0].text), reply.choices[0]
    choice(api, model)


def grpc_regex(channel: grpc.Channel) -> None:
    """The public gRPC API's SamplingParams.structured_outputs."""
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    constraint = generate_pb2.StructuredOutputs(regex=REGEX)
    responses = list(stub.Generate(generate_pb2.GenerateRequest(prompt="Phone number:", sampling_params=(
        generate_pb2.SamplingParams(max_tokens=12, temperature=0, structured_outputs=constraint))), timeout=60))
    assert re.fullmatch(REGEX, "".join(r.text for r in responses)), responses
    assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_STOP
    bad = generate_pb2.StructuredOutputs(regex="[0-9", field="guided_regex")
    try:
        list(stub.Generate(generate_pb2.GenerateRequest(prompt="hi", sampling_params=generate_pb2.SamplingParams(
            max_tokens=4, structured_outputs=bad)), timeout=60))
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "guided_regex: does not compile" in error.details(), error.details()
        assert dict(error.trailing_metadata() or ()).get("pdserve-invalid-param") == "guided_regex"
    else:
        raise AssertionError("a regex that does not compile was served")


BAD = [  # (extra body, the field the 400 names, words of its message)
    ({"response_format": json_schema({"type": "object", "properties": {"a": {"type": 7}}})},
     "response_format.json_schema", "does not compile"),
    ({"guided_json": {"type": "object", "not": {"required": ["a"]}}}, "guided_json", "unsupported schema keyword"),
    ({"guided_regex": "[0-9"}, "guided_regex", "does not compile"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar", "does not compile"),
    ({"guided_regex": "a+", "guided_choice": ["b"]}, "guided_regex", "guided_regex and guided_choice are both set"),
]


def bad_constraints_get_400_and_the_server_keeps_serving(api: openai.OpenAI, model: str) -> None:
    """Each BAD row over completions, and one over a streamed chat: the 400 comes before the stream."""
    import openai

    calls = [(lambda extra=extra: api.completions.create(model=model, prompt="hi", max_tokens=4, extra_body=extra),
              param, words) for extra, param, words in BAD]
    calls.append((lambda: api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4, stream=True, extra_body={"guided_regex": "(a"}),
                  "guided_regex", "does not compile"))
    for call, param, words in calls:
        try:
            call()
        except openai.BadRequestError as error:
            assert error.status_code == 400 and error.param == param, (param, error.body)
            assert words in error.message, (param, error.message)
        else:
            raise AssertionError(f"a bad {param} was served")
    reply = api.completions.create(model=model, prompt="hi", max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3
