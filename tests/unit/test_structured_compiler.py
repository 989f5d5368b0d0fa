"""The constraint compiler: typed errors naming the field, the bounded hash cache, the time limit."""

from __future__ import annotations

import threading
import time

import pytest

from engine.sampling_params import SamplingParams
from engine.structured.compiler import NO_CONSTRAINT, ConstraintCompiler
from engine.structured.errors import StructuredOutputError
from engine.structured.params import StructuredOutputsParams as S
from engine.structured.protocol import NO_MATCHER


def test_no_constraint_compiles_to_the_null_matcher(compiler):
    assert compiler.compile(None) is NO_CONSTRAINT
    assert NO_CONSTRAINT.matcher(SamplingParams(), (2,)) is NO_MATCHER


@pytest.mark.parametrize("params, field, words", [
    (S(json={"type": 5}, field="response_format.json_schema"), "response_format.json_schema", "does not compile"),
    (S(json={"type": "object", "properties": {"a": {"not": {}}}}, field="tools[0].function.parameters"),
     "tools[0].function.parameters", "unsupported schema keyword at '/properties/a/not'"),
    (S(regex="(abc"), "structured_outputs.regex", "does not compile.*parenthesis"),
    (S(grammar='root ::= "a" missing', field="guided_grammar"), "guided_grammar", "does not compile.*missing"),
])
def test_constraints_that_do_not_compile_raise_naming_the_field(compiler, params, field, words):
    with pytest.raises(StructuredOutputError, match=words) as info:
        compiler.compile(params)
    assert info.value.field == field
    assert "/project/cpp" not in str(info.value)  # xgrammar's log prefix is stripped


def test_a_failure_is_reported_under_each_callers_field(compiler):
    for field in ("a.regex", "b.regex"):
        with pytest.raises(StructuredOutputError) as info:
            compiler.compile(S(regex="[z-a]", field=field))
        assert info.value.field == field


def test_one_constraint_compiles_once_and_is_shared(compiler):
    before = compiler.stats.num_compiled
    first = compiler.compile(S(regex="x[0-9]+", field="one"))
    again = compiler.compile(S(regex="x[0-9]+", field="two"))
    assert first is again
    assert compiler.stats.num_compiled == before + 1


def test_the_cache_keeps_the_most_recently_used(tokenizer):
    compiler = ConstraintCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, max_cached=2)
    a, b, c = (S(regex=f"{x}+") for x in "abc")
    first_a = compiler.compile(a)
    compiler.compile(b)
    assert compiler.compile(a) is first_a  # a is now the most recent
    compiler.compile(c)  # evicts b
    assert compiler.num_cached == 2
    assert compiler.compile(a) is first_a
    num = compiler.stats.num_compiled
    compiler.compile(b)
    assert compiler.stats.num_compiled == num + 1
    compiler.close()


def test_a_compile_past_the_limit_raises_and_holds_nothing(tokenizer, monkeypatch):
    compiler = ConstraintCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, timeout_s=0.05)
    release = threading.Event()
    real = compiler._compile

    def slow(params):
        release.wait(5)
        return real(params)

    monkeypatch.setattr(compiler, "_compile", slow)
    start = time.perf_counter()
    with pytest.raises(StructuredOutputError, match="did not compile within 0.05 s") as info:
        compiler.compile(S(json={"type": "object"}, field="response_format.json_schema"))
    assert info.value.field == "response_format.json_schema"
    assert time.perf_counter() - start < 2
    release.set()
    compiler.close()


def test_concurrent_callers_share_one_compile(compiler):
    params = S(json={"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]})
    before = compiler.stats.num_compiled
    results = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(params))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in results}) == 1
    assert compiler.stats.num_compiled == before + 1
