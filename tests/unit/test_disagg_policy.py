"""Routing policy, the decode reservation table and the worker-RPC conversions (in-process)."""

from __future__ import annotations

import asyncio

import pytest

from engine.kv_transfer.base import KVNotification
from engine.sampling_params import SamplingParams
from services.common.wire import (
    logprobs_list_from_proto,
    logprobs_list_to_proto,
    params_from_proto,
    params_to_proto,
)
from services.decode.reservations import LeaseState, ReservationTable
from services.router.routing.policy import LoadPolicy
from services.router.routing.worker_load import WorkerLoad


def test_prefill_pick_fewest_outstanding_tokens_then_fewest_requests_then_oldest_pick():
    policy = LoadPolicy()
    a = WorkerLoad("a", num_outstanding_prefill_tokens=300, num_running=0)
    b = WorkerLoad("b", num_outstanding_prefill_tokens=100, num_running=5)
    c = WorkerLoad("c", num_outstanding_prefill_tokens=100, num_running=2)
    assert policy.pick_prefill([a, b, c], [1] * 10).address == "c"
    tied = [WorkerLoad("x"), WorkerLoad("y")]
    assert [policy.pick_prefill(tied, [1]).address for _ in range(4)] == ["x", "y", "x", "y"]
    assert policy.pick_prefill([], [1]) is None


def test_decode_pick_most_free_blocks_among_those_that_fit_then_fewest_running():
    policy = LoadPolicy()
    small = WorkerLoad("small", num_free_blocks=1, block_size=16)
    busy = WorkerLoad("busy", num_free_blocks=50, num_running=9)
    idle = WorkerLoad("idle", num_free_blocks=50, num_running=1)
    roomy = WorkerLoad("roomy", num_free_blocks=80, num_running=30)
    assert policy.pick_decode([small, busy, idle], [1] * 40).address == "idle"
    assert policy.pick_decode([small, busy, idle, roomy], [1] * 40).address == "roomy"
    # nobody fits 3 blocks: the one with the most room is still tried (it may say no)
    assert policy.pick_decode([small, WorkerLoad("two", num_free_blocks=2)], [1] * 40).address == "two"


def _table(lease_s: float = 10.0) -> ReservationTable:
    return ReservationTable(lease_s)


def test_reservation_lands_when_every_block_was_notified_once():
    async def scenario():
        table = _table()
        table.add("r", [1, 2, 3], SamplingParams(), [7, 3, 9])
        table.claim("r")
        assert table.on_landed(KVNotification("r", (7, 3))) is None
        assert table.on_landed(KVNotification("r", (7,))) is None  # a repeat counts once
        assert table.on_landed(KVNotification("other", (9,))) is None  # not ours
        done = table.on_landed(KVNotification("r", (9, 100)))  # 100 is not reserved
        assert done is not None and done.is_landed and done.changed.is_set()
        assert not table.has_pending_kv()
    asyncio.run(scenario())


def test_claim_lease_expiry_and_abandon():
    async def scenario():
        table = _table(lease_s=5.0)
        leased = table.add("leased", [1], SamplingParams(), [0])
        claimed = table.add("claimed", [1], SamplingParams(), [1])
        table.claim("claimed")
        with pytest.raises(KeyError):
            table.claim("claimed")  # one Decode call per reservation
        later = leased.expires_at + 0.1
        assert table.expired(later) == [leased]  # a claimed one has no lease
        table.abandon("claimed")  # its Decode call gave up while KV was arriving
        assert claimed.state is LeaseState.ABANDONED and table.expired(later) == [leased, claimed]
        assert table.mark_released("leased") is leased and table.mark_released("leased") is None
        with pytest.raises(KeyError):
            table.claim("leased")
    asyncio.run(scenario())


def test_pushes_only_into_live_reservations_and_their_blocks():
    async def scenario():
        table = _table()
        table.add("r", [1], SamplingParams(), [4, 5])
        assert table.begin_push("r", [5]) is None
        assert "not reserved" in table.begin_push("r", [5, 6])
        assert "no live reservation 'x'" in table.begin_push("x", [4])
        table.mark_released("r")
        assert "no live reservation 'r'" in table.begin_push("r", [4])
        assert table.get("r").num_active_pushes == 1
        table.end_push("r")
        assert table.get("r").num_active_pushes == 0
    asyncio.run(scenario())


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(n=3, temperature=0.0, top_p=0.5, top_k=7, min_p=0.1, seed=-5, max_tokens=None,
                   min_tokens=2, stop=["x", "yz"], stop_token_ids=[3], ignore_eos=True,
                   logprobs=0, prompt_logprobs=4, logit_bias={5: -2.5}, allowed_token_ids=[1, 2],
                   bad_words=["bad"], repetition_penalty=1.25, presence_penalty=0.5,
                   frequency_penalty=-0.5, include_stop_str_in_output=True,
                   skip_special_tokens=False, cache_salt="tenant-a"),
    SamplingParams(bad_words=["bad", "worse"], bad_words_token_ids=[[7], [8, 9]]),
    SamplingParams(structured_outputs={"regex": "[ab]+", "field": "guided_regex"}),
    SamplingParams(structured_outputs={"choice": ["yes", "no"]}),
    SamplingParams(structured_outputs={"grammar": 'root ::= "a" | "b"', "field": "structured_outputs.grammar"}),
    SamplingParams(structured_outputs={"json_object": True, "strict": False, "field": "response_format"}),
    SamplingParams(structured_outputs={"json": '{"type":"object","properties":{"b":{},"a":{}}}',
                                       "strict": False, "field": "response_format.json_schema"}),
])
def test_sampling_params_round_trip(params):
    back = params_from_proto(params_to_proto(params))
    if params.seed is not None and params.seed < 0:  # the same 64 bits the sampler uses
        assert back.seed == params.seed & (2**64 - 1)
        params = params.replace(seed=back.seed)
    assert back == params


def test_logprobs_round_trip_keeps_none_positions():
    from engine.sampling.logprobs import PositionLogprobs

    entries = [None, PositionLogprobs(5, -0.5, 1, [(5, -0.5), (9, -1.25)])]
    assert logprobs_list_from_proto(logprobs_list_to_proto(entries)) == entries
    assert logprobs_list_from_proto([]) is None


def test_public_logprobs_carry_the_decoded_token():
    from engine.sampling.logprobs import PositionLogprobs

    (msg,) = logprobs_list_to_proto([PositionLogprobs(5, -0.5, 1, [(5, -0.5), (9, -1.25)])],
                                    decode=lambda token_id: f"<{token_id}>")
    assert (msg.sampled.token, msg.sampled.rank) == ("<5>", 1)
    assert [(t.token, t.rank) for t in msg.top] == [("<5>", 1), ("<9>", 2)]


def test_sampling_params_from_a_public_client_read_floats_as_written():
    """An unset field takes the engine default; a float32 on the wire reads back as the decimal
    the client wrote; bad words without token ids stay untokenized (the router tokenizes)."""
    from services.common.pb import generate_pb2

    params = params_from_proto(generate_pb2.SamplingParams(temperature=0.1, bad_words=["x"]))
    assert params.temperature == 0.1 and params.top_p == 1.0 and params.n == 1
    assert params.bad_words == ["x"] and params.bad_words_token_ids is None
    assert params.cache_salt is None
