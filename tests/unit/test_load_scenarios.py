"""Scenarios as data, seeded prompts from the real tokenizer, and arrival schedules."""

from __future__ import annotations

import itertools
import statistics

import pytest

from engine.models.loader import load_tokenizer
from loadtests.load.arrivals import Arrival, parse_arrivals
from loadtests.load.bench_compare import Target, parse_target
from loadtests.load.client import check_loopback
from loadtests.load.prompts import build_requests
from loadtests.load.scenario import load_scenario, parse_scenario, shipped_scenarios


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_every_shipped_scenario_loads_and_builds_identically(tokenizer) -> None:
    assert set(shipped_scenarios()) >= {"synthetic-chat", "shared-system-prompt", "multi-turn",
                                        "long-context-mix", "code-edit"}
    for name in shipped_scenarios():
        scenario = load_scenario(name)
        first = build_requests(scenario, tokenizer, seed=3, num_requests=12)
        assert first == build_requests(scenario, tokenizer, seed=3, num_requests=12)
        assert first != build_requests(scenario, tokenizer, seed=4, num_requests=12)
        assert [r.index for r in first] == list(range(12))


def test_prompt_lengths_follow_the_scenario(tokenizer) -> None:
    scenario = load_scenario("long-context-mix")
    requests = build_requests(scenario, tokenizer, seed=0)
    for r in requests:
        cls = next(c for c in scenario.classes if c.name == r.class_name)
        low, high = cls.prompt_tokens
        assert low - 1 <= len(tokenizer.encode(r.prompt)) <= high + 1
        assert cls.output_tokens[0] <= r.max_tokens <= cls.output_tokens[1]
        assert r.body("m")["ignore_eos"] and r.body("m")["stream_options"] == {"include_usage": True}
    assert {r.class_name for r in requests} == {"long-context", "short-chat"}


def test_tenants_share_system_prompts_and_turns_resend_history(tokenizer) -> None:
    shared = build_requests(load_scenario("shared-system-prompt"), tokenizer, seed=0)
    systems = {r.messages[0] for r in shared}
    assert all(m[0] == "system" for m in systems) and len(systems) == 4
    turns = build_requests(load_scenario("multi-turn"), tokenizer, seed=0)
    by_index = {r.index: r for r in turns}
    followers = [r for r in turns if r.after is not None]
    assert followers
    for r in followers:
        previous = by_index[r.after]
        assert r.after < r.index
        assert r.messages[:len(previous.messages)] == previous.messages
        assert r.messages[len(previous.messages)][0] == "assistant"


def test_bad_scenarios_name_the_field() -> None:
    base = {"classes": [{"prompt_tokens": [4, 8], "output_tokens": 4}]}
    assert parse_scenario(base).classes[0].output_tokens == (4, 4)
    with pytest.raises(ValueError, match=r"classes\[0\].prompt_tokens"):
        parse_scenario({"classes": [{"prompt_tokens": [9, 8], "output_tokens": 4}]})
    with pytest.raises(ValueError, match="unknown fields"):
        parse_scenario({"classes": [{"prompt_tokens": 4, "output_tokens": 4, "colour": 1}]})
    with pytest.raises(ValueError, match="turns > 1 needs api: chat"):
        parse_scenario({"classes": [{"prompt_tokens": 4, "output_tokens": 4, "turns": 2}]})
    with pytest.raises(ValueError, match="api must be"):
        parse_scenario({**base, "api": "embeddings"})
    with pytest.raises(ValueError, match="no such file"):
        load_scenario("no-such-scenario")


def test_open_loop_schedules_have_the_requested_mean_rate() -> None:
    poisson = Arrival.poisson(4.0).send_offsets(2000, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(poisson)]
    assert poisson[0] == 0.0 and statistics.fmean(gaps) == pytest.approx(0.25, rel=0.08)
    bursty = Arrival.gamma(4.0, burstiness=0.25).send_offsets(2000, seed=1)
    bursty_gaps = [b - a for a, b in itertools.pairwise(bursty)]
    assert statistics.fmean(bursty_gaps) == pytest.approx(0.25, rel=0.15)
    assert statistics.stdev(bursty_gaps) > 1.5 * statistics.stdev(gaps)
    assert Arrival.poisson(4.0).send_offsets(10, seed=1) == poisson[:10]
    assert [a.label for a in parse_arrivals("closed", "1,4,16")] == ["c=1", "c=4", "c=16"]
    with pytest.raises(ValueError, match="rate must be > 0"):
        parse_arrivals("poisson", "0")
    with pytest.raises(ValueError, match="whole numbers"):
        parse_arrivals("closed", "1.5")


def test_targets_and_loopback_checks() -> None:
    assert parse_target("co=up:--colocated --decode 1") == Target("co", up_args=("--colocated", "--decode", "1"))
    assert parse_target("ext=url:http://127.0.0.1:8080/") == Target("ext", base_url="http://127.0.0.1:8080")
    with pytest.raises(ValueError, match="NAME=up:FLAGS"):
        parse_target("colocated")
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:8000")
    with pytest.raises(ValueError, match="non-loopback"):
        check_loopback("http://10.1.2.3:8000")
    check_loopback("http://10.1.2.3:8000", allow_remote=True)
    with pytest.raises(ValueError, match="base URL"):
        check_loopback("127.0.0.1:8000")
