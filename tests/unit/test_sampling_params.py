"""SamplingParams: defaults, normalisation, and every validation error naming its parameter."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from engine.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams

VOCAB = 100
MAX_LEN = 64


def test_defaults_follow_vllm_and_openai():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 1.0, 0, 1.0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, [], [])
    assert p.logit_bias is None and p.allowed_token_ids is None and p.bad_words is None
    assert p.seed is None and p.logprobs is None and p.prompt_logprobs is None
    assert not p.include_stop_str_in_output and not p.ignore_eos and p.skip_special_tokens
    assert p.logprobs_mode == "processed"
    assert not p.is_greedy and not p.has_penalties
    p.validate(VOCAB, MAX_LEN, prompt_len=10)


def test_normalisation_of_json_shapes():
    p = SamplingParams(stop="###", stop_token_ids=(3, 4), logit_bias={"7": 1.5},
                       allowed_token_ids=(1, 2), bad_words="bad")
    assert p.stop == ["###"]
    assert p.stop_token_ids == [3, 4]
    assert p.logit_bias == {7: 1.5}
    assert p.allowed_token_ids == [1, 2]
    assert p.bad_words == ["bad"]
    assert SamplingParams(stop=None).stop == []


def test_greedy_and_frozen():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]
    SamplingParams(n=4, temperature=0.0).validate(VOCAB, MAX_LEN)  # identical samples: allowed


def test_for_sample_offsets_the_seed():
    p = SamplingParams(n=3, seed=10)
    assert [p.for_sample(i).seed for i in range(3)] == [10, 11, 12]
    assert p.for_sample(2).n == 1
    assert SamplingParams(n=2).for_sample(1).seed is None


def test_bad_words_tokenized_with_and_without_leading_space():
    vocab = {"foo": [5], " foo": [6], "a b": [1, 2], " a b": [3, 1, 2]}
    p = SamplingParams(bad_words=["foo", " a b"]).with_bad_words_tokenized(lambda s: vocab[s])
    assert p.bad_words_token_ids == [[5], [6], [1, 2], [3, 1, 2]]
    assert SamplingParams().with_bad_words_tokenized(lambda s: []).bad_words_token_ids is None


def test_resolve_max_tokens():
    assert SamplingParams(max_tokens=None).resolve_max_tokens(10, 64) == 54
    assert SamplingParams(max_tokens=5).resolve_max_tokens(10, 64) == 5


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty",
                                  "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_rejected(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be finite, got {value!r}"):
        SamplingParams(**{name: value}).validate(VOCAB, MAX_LEN)


BAD_VALUES = [
    ("n", 0, r"n must be in \[1, 16\], got 0"),
    ("n", MAX_N + 1, r"n must be in \[1, 16\], got 17"),
    ("n", 1.5, r"n must be an integer, got 1.5"),
    ("temperature", -0.1, r"temperature must be >= 0 \(0 means greedy\), got -0.1"),
    ("temperature", "hot", r"temperature must be a number, got 'hot'"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
    ("top_p", 1.01, r"top_p must be in \(0, 1\], got 1.01"),
    ("top_k", -2, r"top_k must be >= -1 \(0 or -1 disables it\), got -2"),
    ("top_k", True, r"top_k must be an integer, got True"),
    ("min_p", -0.01, r"min_p must be in \[0, 1\], got -0.01"),
    ("min_p", 1.5, r"min_p must be in \[0, 1\], got 1.5"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be > 0 \(1 disables it\), got 0.0"),
    ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\], got 2.5"),
    ("presence_penalty", -2.01, r"presence_penalty must be in \[-2, 2\], got -2.01"),
    ("frequency_penalty", -3, r"frequency_penalty must be in \[-2, 2\], got -3"),
    ("seed", 2**64, r"seed must fit in 64 bits, got 18446744073709551616"),
    ("seed", "1", r"seed must be an integer, got '1'"),
    ("max_tokens", 0, r"max_tokens must be >= 1, got 0"),
    ("min_tokens", -1, r"min_tokens must be >= 0, got -1"),
    ("min_tokens", 17, r"min_tokens must be <= max_tokens \(16\), got 17"),
    ("logprobs", -1, r"logprobs must be in \[0, 20\], got -1"),
    ("logprobs", MAX_LOGPROBS + 1, r"logprobs must be in \[0, 20\], got 21"),
    ("prompt_logprobs", 21, r"prompt_logprobs must be in \[0, 20\], got 21"),
    ("logprobs_mode", "logits", r"logprobs_mode must be one of \('processed', 'raw'\), "
                                r"got 'logits'"),
    ("logit_bias", {VOCAB: 1.0}, r"logit_bias token ids must be in \[0, 100\) \(the vocabulary "
                                 r"size\), got 100"),
    ("logit_bias", {-1: 1.0}, r"logit_bias token ids must be in \[0, 100\).*got -1"),
    ("logit_bias", {"x": 1.0}, r"logit_bias token id must be an integer, got 'x'"),
    ("logit_bias", {3: math.nan}, r"logit_bias\[3\] must be finite, got nan"),
    ("logit_bias", {3: 101.0}, r"logit_bias\[3\] must be in \[-100, 100\], got 101.0"),
    ("allowed_token_ids", [], r"allowed_token_ids must not be empty .*got \[\]"),
    ("allowed_token_ids", [1, 100], r"allowed_token_ids token ids must be in \[0, 100\).*got 100"),
    ("stop_token_ids", [250], r"stop_token_ids token ids must be in \[0, 100\).*got 250"),
    ("bad_words_token_ids", [[1], []], r"bad_words_token_ids must not contain an empty "
                                       r"sequence, got \[\]"),
    ("bad_words_token_ids", [[1, 100]], r"bad_words_token_ids token ids must be in .*got 100"),
    ("stop", ["ok", ""], r"stop\[1\] must be a non-empty string, got ''"),
    ("stop", [3], r"stop\[0\] must be a non-empty string, got 3"),
    ("bad_words", [" "], r"bad_words\[0\] must be a non-empty string, got ' '"),
]


@pytest.mark.parametrize("name,value,message", BAD_VALUES,
                         ids=[f"{n}={v!r}" for n, v, _ in BAD_VALUES])
def test_each_bad_value_is_rejected_with_its_name(name, value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        SamplingParams(**{name: value}).validate(VOCAB, MAX_LEN)


def test_boundary_values_are_accepted():
    for kwargs in [dict(n=MAX_N), dict(temperature=0.0), dict(top_p=1.0), dict(top_k=-1),
                   dict(min_p=1.0), dict(presence_penalty=-2.0, frequency_penalty=2.0),
                   dict(min_tokens=16, max_tokens=16), dict(logprobs=0, prompt_logprobs=20),
                   dict(logit_bias={99: -100.0}), dict(seed=-1), dict(max_tokens=None),
                   dict(stop_token_ids=[0, 99]), dict(logprobs_mode="raw")]:
        SamplingParams(**kwargs).validate(VOCAB, MAX_LEN, prompt_len=48)


def test_prompt_plus_max_tokens_over_context_names_both_numbers():
    with pytest.raises(ValueError, match=r"^prompt length 50 \+ max_tokens 16 = 66 exceeds the "
                                         r"model's context length 64"):
        SamplingParams().validate(VOCAB, MAX_LEN, prompt_len=50)
    SamplingParams().validate(VOCAB, MAX_LEN, prompt_len=48)  # exactly full is fine
    with pytest.raises(ValueError, match=r"^prompt length 64 leaves no room"):
        SamplingParams(max_tokens=None).validate(VOCAB, MAX_LEN, prompt_len=64)


def test_module_is_torch_free():
    code = ("import sys, engine.sampling_params, engine.sampling.detokenizer; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("salt, match", [("", "non-empty"), (7, "non-empty"), ("x" * 257, "at most 256")])
def test_bad_cache_salt_is_named(salt, match):
    with pytest.raises(ValueError, match=f"cache_salt.*{match}"):
        SamplingParams(cache_salt=salt).validate(vocab_size=100, max_model_len=64)


def test_cache_salt_separates_prefix_cache_hits():
    from engine.kv_cache.hashing import hash_request_blocks

    tokens = list(range(32))
    assert (hash_request_blocks(tokens, 16, SamplingParams(cache_salt="a").block_hash_extra_keys)
            != hash_request_blocks(tokens, 16, SamplingParams(cache_salt="b").block_hash_extra_keys))
