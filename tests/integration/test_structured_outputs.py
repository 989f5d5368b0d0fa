"""Structured outputs through the offline engine (the default model, CPU): every output obeys
its constraint, at temperature 0 and 1, in mixed batches, with n > 1, through preemption,
resumption and n-gram speculation (greedy output identical), and bad input leaves nothing held.

Compiled grammars are shared: one LLM per module, so each schema compiles once
(``llm.engine.constraints.stats``)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from engine import LLM
from engine.sampling_params import SamplingParams
from engine.structured.errors import StructuredOutputError
from tests.integration.schemas import SCHEMAS, validate

PROMPT = "Answer in JSON. Describe something."
MAX_TOKENS = 80


def json_params(schema, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured_outputs={"json": schema, "field": "response_format.json_schema"}, **kwargs)


def check_json(output, schema):
    assert output.finish_reason == "stop", (output.text, output.finish_reason)
    validate(output.text, schema)


@pytest.fixture(scope="module")
def llm(loaded_model):
    return LLM(loaded_model, max_model_len=512, num_kv_blocks=256)


def test_at_least_20_schemas_are_distinct_and_cover_the_keywords():
    assert len(SCHEMAS) >= 20
    text = json.dumps(SCHEMAS)
    for keyword in ("anyOf", "enum", "pattern", "format", "minItems", "maxItems", "minimum", "maximum"):
        assert keyword in text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_json_schema_output_validates(llm, temperature):
    params = [json_params(s, temperature=temperature, seed=11 + i) for i, s in enumerate(SCHEMAS)]
    outputs = llm.generate([PROMPT] * len(SCHEMAS), params)
    for out, schema in zip(outputs, SCHEMAS):
        check_json(out.outputs[0], schema)
    stats = llm.engine.constraints.stats
    assert stats.num_compiled <= len(SCHEMAS) + 8  # the second temperature reuses the grammars
    llm.engine.check_integrity()


def test_json_object_regex_choice_and_grammar(llm):
    grammar = 'root ::= "(" num (op num)* ")"\nnum ::= [1-9] [0-9]?\nop ::= " + " | " - "'
    constraints = [{"json_object": True}, {"regex": r"[0-9]{3}-[0-9]{4}"}, {"choice": ["cat", "dog", "bird"]},
                   {"grammar": grammar}]
    params = [SamplingParams(temperature=t, seed=5, max_tokens=m, structured_outputs=c)
              for t, m, c in zip((0, 1, 1, 0), (60, 20, 10, 30), constraints)]
    prompts = ["Write JSON about a cat.", "Phone number:", "Best pet:", "Sum:"]
    outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert all(o.finish_reason == "stop" for o in outputs), [(o.text, o.finish_reason) for o in outputs]
    assert isinstance(json.loads(outputs[0].text), dict)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outputs[1].text)
    assert outputs[2].text in ("cat", "dog", "bird")
    assert re.fullmatch(r"\([1-9][0-9]?( [+-] [1-9][0-9]?)*\)", outputs[3].text)


def test_mixed_batch_leaves_unconstrained_requests_as_they_were(llm):
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate("The capital of France is", free)[0].token_ids
    params = [free, json_params(SCHEMAS[0], temperature=0), free, json_params(SCHEMAS[5], temperature=1, seed=2)]
    outputs = llm.generate(["The capital of France is", PROMPT, "The capital of France is", PROMPT], params)
    assert outputs[0].token_ids == alone and outputs[2].token_ids == alone
    check_json(outputs[1].outputs[0], SCHEMAS[0])
    check_json(outputs[3].outputs[0], SCHEMAS[5])


def test_n_samples_each_obey_their_own_matcher(llm):
    (out,) = llm.generate(PROMPT, json_params(SCHEMAS[3], n=4, temperature=1.0, seed=7))
    assert len(out.outputs) == 4
    for sample in out.outputs:
        check_json(sample, SCHEMAS[3])
    assert len({s.text for s in out.outputs}) > 1


def test_a_constraint_that_cannot_finish_ends_with_length(llm):
    (out,) = llm.generate(PROMPT, json_params(SCHEMAS[16], temperature=0, max_tokens=4))
    assert out.outputs[0].finish_reason == "length" and len(out.token_ids) == 4


def test_a_resumed_request_replays_its_tokens_into_the_matcher(llm):
    """A migration (or a decode worker after the prefill worker's first token): the matcher is
    rebuilt from the tokens so far, and greedy output continues exactly."""
    params = json_params(SCHEMAS[16], temperature=0)
    (full,) = llm.generate(PROMPT, params)
    prompt = llm.tokenizer.encode(PROMPT)
    for cut in (1, len(full.token_ids) // 2):
        core = llm.engine
        core.add_request("resumed", prompt, params, resumed_output_token_ids=full.token_ids[:cut])
        rest = []
        while core.has_unfinished_requests():
            for out in core.step():
                rest += out.new_token_ids
        assert full.token_ids[:cut] + rest == full.token_ids


def test_preemption_gives_identical_greedy_constrained_output(loaded_model, llm):
    # 5 blocks of 16 tokens: each request fits alone (prompt + 48 <= 64 tokens), 6 do not
    params = [json_params(s, temperature=0, max_tokens=48) for s in SCHEMAS[:6]]
    expected = [o.token_ids for o in llm.generate([PROMPT] * 6, params)]
    small = LLM(loaded_model, block_size=16, num_kv_blocks=5, max_num_batched_tokens=64)
    outputs = small.generate([PROMPT] * 6, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == expected
    small.engine.check_integrity()


def test_ngram_speculation_gives_identical_greedy_constrained_output(loaded_model, llm):
    schemas = [SCHEMAS[16], SCHEMAS[4], SCHEMAS[18], SCHEMAS[0]]
    params = [json_params(s, temperature=0) for s in schemas]
    prompt = 'Repeat: {"items": [{"sku": "a1", "n": 1}, {"sku": "a1", "n": 1}]} {"scores": [1, 1, 1]}'
    expected = [o.token_ids for o in llm.generate([prompt] * 4, params)]
    spec = LLM(loaded_model, max_model_len=512, num_kv_blocks=256, spec_method="ngram", spec_k=4, spec_max_batch=32)
    outputs = spec.generate([prompt] * 4, params)
    assert [o.token_ids for o in outputs] == expected
    stats = spec.engine.spec_stats()
    assert stats["num_spec_steps"] > 0 and sum(stats["num_accepted_per_position"]) > 0
    for out, schema in zip(outputs, schemas):
        check_json(out.outputs[0], schema)
    spec.engine.check_integrity()


@pytest.mark.parametrize("constraint, field, words", [
    ({"json": {"type": "object", "properties": {"a": {"type": 7}}}, "field": "response_format.json_schema"},
     "response_format.json_schema", "does not compile"),
    ({"json": {"type": "object", "not": {"required": ["a"]}}, "field": "tools[0].function.parameters"},
     "tools[0].function.parameters", "unsupported schema keyword"),
    ({"json": "{\"type\": ", "field": "response_format.json_schema"}, "response_format.json_schema", "not valid JSON"),
    ({"regex": "[0-9", "field": "structured_outputs.regex"}, "structured_outputs.regex", "does not compile"),
    ({"grammar": "root ::= nothing_defined"}, "structured_outputs.grammar", "does not compile"),
])
def test_bad_input_raises_naming_the_field_and_holds_nothing(llm, constraint, field, words):
    core = llm.engine
    free_before = core.block_pool.num_free_blocks
    with pytest.raises(StructuredOutputError, match=words) as info:
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=4), SamplingParams(structured_outputs=constraint)])
    assert info.value.field == field
    assert not core.has_unfinished_requests()
    assert core.block_pool.num_free_blocks == free_before
    core.check_integrity()


def test_required_and_named_tool_calls_decode_to_valid_arguments(llm):
    """tool_choice required / a named function (services/router/tools) at temperature 1, so the
    model's own preference decides nothing: the constraint alone makes every call valid."""
    from services.router.tools.calls import calls_from_required
    from services.router.tools.spec import ToolChoice, parse_tools, tool_constraint
    from tests.unit.test_tools import ADD, NAMES, TOOLS, WEATHER

    tools = parse_tools(TOOLS)
    schemas = {"get_weather": WEATHER, "add": ADD}
    # one call per reply (parallel_tool_calls false): a sampled array may grow to max_tokens
    required = SamplingParams(temperature=1.0, seed=3, max_tokens=48, n=3,
                              structured_outputs=tool_constraint(ToolChoice("required"), tools, parallel=False))
    named = SamplingParams(temperature=1.0, seed=5, max_tokens=40, n=3,
                           structured_outputs=tool_constraint(ToolChoice("function", "get_weather"), tools))
    replies = llm.generate(["Call a tool.", "Call a tool."], [required, named])
    assert [len(r.outputs) for r in replies] == [3, 3]
    for output in replies[0].outputs:
        calls = calls_from_required(output.text, NAMES)
        assert len(calls) == 1, output.text
        jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])
    for output in replies[1].outputs:
        jsonschema.validate(json.loads(output.text), WEATHER)


# a string schema xgrammar takes seconds to compile (~4 s on the 2-core dev box: each length up
# to maxLength is a grammar state), and one it compiles at once
SLOW_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "minLength": 1000, "maxLength": 2000}},
               "required": ["a"]}
COMPILE_LIMIT_S = 0.5


def test_a_schema_compiling_past_the_limit_is_a_400_naming_the_field(loaded_model):
    """The router's HTTP API over a colocated engine in this process, whose compile limit is
    COMPILE_LIMIT_S (this engine's own: the services' engines keep the default, 10 s, which a
    test would wait out): SLOW_SCHEMA is refused with 400 naming the field it came in, as the
    engine's StructuredOutputError maps to; the next request is served."""
    from aiohttp.test_utils import TestClient, TestServer

    from engine.args import EngineArgs
    from engine.config import Role
    from engine.core import EngineCore
    from engine.structured.params import StructuredOutputsParams
    from services.router.backends.colocated import ColocatedBackend
    from services.router.http.server import build_app
    from services.router.model_info import ModelInfo
    from services.router.pipeline.frontend import Frontend, RouterState

    class Colocated(ColocatedBackend):
        def _build_core(self) -> EngineCore:  # the session's model, not loaded again
            config = self.engine_args.build(loaded_model.config, Role.COLOCATED)
            self.tokenizer = loaded_model.tokenizer
            self.model_info = ModelInfo(config.model.name, config.model.vocab_size, config.model.max_model_len)
            core = EngineCore(config, loaded_model)
            core.constraints.compile(StructuredOutputsParams(regex="a"))  # reads the vocabulary (~0.5 s)
            core.constraints.timeout_s = COMPILE_LIMIT_S
            return core

    def body(schema: dict) -> dict:
        return {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}

    async def scenario() -> tuple[tuple[int, dict], tuple[int, dict]]:
        backend = Colocated(engine_args=EngineArgs(num_kv_blocks=16, max_model_len=256))
        await backend.start()
        try:
            state = RouterState(backend)
            state.frontend = Frontend(backend.tokenizer, backend, backend.model_info)
            async with TestClient(TestServer(build_app(state), host="127.0.0.1")) as client:
                replies = []
                for schema in (SLOW_SCHEMA, SCHEMAS[5]):
                    response = await client.post("/v1/chat/completions", json=body(schema))
                    replies.append((response.status, await response.json()))
                return replies[0], replies[1]
        finally:
            await backend.close()

    (status, refused), (served_status, served) = asyncio.run(scenario())
    assert status == 400, refused
    assert refused["error"]["param"] == "response_format.json_schema", refused
    assert f"did not compile within {COMPILE_LIMIT_S:g} s" in refused["error"]["message"], refused
    assert served_status == 200, served
    assert served["choices"][0]["finish_reason"] == "stop", served
    validate(served["choices"][0]["message"]["content"], SCHEMAS[5])
