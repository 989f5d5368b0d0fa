"""Async scheduling (engine/scheduler/chained.py, engine/runner/deferred.py, EngineCore.step):
a decode step chained behind the one in flight gives exactly the synchronous engine's tokens,
holds the blocks of requests that end under it until it is booked, and is not chained where the
host must see the tokens first.

A tiny random-weight model with a word-level tokenizer, so each case runs in well under a
second on a CPU (the chained path runs there too: ``async_scheduling='on'``); where CUDA is
present the same cases run again with decode graphs and deferred device-to-host copies (marked
``gpu``; skipped with the reason elsewhere)."""

from __future__ import annotations

import dataclasses

import pytest
import tokenizers
import torch

from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.config import ConfigError, EngineConfig, Role
from engine.core import EngineCore, uses_async_scheduling
from engine.models.loader import LoadedModel
from engine.models.tokenizer import Tokenizer
from engine.request import Request
from engine.runner.deferred import DeferredSteps
from engine.sampling.metadata import SamplingMetadata, samples_blind
from engine.sampling.sampler import Sampler
from tests.unit.test_cuda_graphs import CONFIG, random_weights

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MAX_STEPS = 400


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=[GPU, pytest.mark.gpu])])
def device(request):
    """The torch ops on a CPU (the compiled ones take head_dim >= 16), Triton's on CUDA."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PDSERVE_ATTENTION_BACKEND", "torch" if request.param == "cpu" else "triton")
        yield request.param


def tiny_model(eos_token_ids: tuple[int, ...] = ()) -> LoadedModel:
    vocab = {f"t{i}": i for i in range(CONFIG.vocab_size)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    config = dataclasses.replace(CONFIG, eos_token_ids=eos_token_ids)
    return LoadedModel(config, random_weights(config), Tokenizer(backend, eos_token_ids=eos_token_ids))


def make_core(loaded: LoadedModel, device: str, mode: str, **args) -> EngineCore:
    args = {"cpu_offload_gb": 0, **args}
    engine_args = EngineArgs(device=device, dtype="float32", block_size=4, num_kv_blocks=args.pop("blocks", 96),
                             max_num_seqs=8, max_num_batched_tokens=32, async_scheduling=mode, **args)
    return EngineCore(engine_args.build(loaded.config, Role.COLOCATED), loaded)


def prompt(i: int, length: int) -> list[int]:
    return [(7 * i + 3 * j + 1) % CONFIG.vocab_size for j in range(length)]


def drive(core: EngineCore, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
          actions: dict[int, list[tuple[str, str]]] | None = None) -> dict[str, tuple[list[int], str | None]]:
    """Step ``core`` to the end: ``arrivals[k]`` are added before step k, ``actions[k]`` are
    ('abort' | 'finish', id) applied before step k. Returns each sample's tokens and finish
    reason; the block pool is checked after every step and must be whole at the end."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    actions = actions or {}
    for k in range(MAX_STEPS):
        for request_id, ids, params in arrivals.get(k, ()):
            for sample_id in core.add_request(request_id, ids, params):
                tokens[sample_id], reasons[sample_id] = [], None
        for action, request_id in actions.get(k, ()):
            outs = core.abort_request(request_id) if action == "abort" else [core.finish_request(request_id)]
            for out in outs:
                if out is not None:
                    reasons[out.request_id] = out.finish_reason
        if k > max(arrivals) and not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        core.check_integrity()
    assert not core.has_unfinished_requests()
    assert core.block_pool.num_free_blocks == core.runner.num_blocks  # nothing leaked or still held
    return {i: (tokens[i], reasons[i]) for i in tokens}


def workload(stop_token: int | None) -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    """Greedy requests of 1..21-token prompts and 2..30 new tokens (some end on a stop or EOS
    token), two of them arriving mid-run, beside a seeded sampled one, one asking for logprobs
    and one with n=2: those need their tokens on the host, so the chain stops around them."""
    greedy = [SamplingParams(temperature=0, max_tokens=2 + (5 * i) % 29,
                             stop_token_ids=[stop_token] if i % 3 == 0 and stop_token is not None else [])
              for i in range(8)]
    first = [(f"g{i}", prompt(i, 1 + (3 * i) % 21), greedy[i]) for i in range(6)]
    later = [(f"g{i}", prompt(i, 1 + (3 * i) % 21), greedy[i]) for i in (6, 7)]
    others = [("seeded", prompt(20, 6), SamplingParams(temperature=0.9, seed=5, max_tokens=9)),
              ("logprobs", prompt(21, 5), SamplingParams(temperature=0, max_tokens=7, logprobs=2)),
              ("n2", prompt(22, 9), SamplingParams(temperature=0.7, seed=1, n=2, max_tokens=6))]
    return {0: first, 12: later, 30: others}


def reference_stream(device: str) -> list[int]:
    loaded = tiny_model()
    core = make_core(loaded, device, "off")
    out = drive(core, {0: [("r", prompt(0, 5), SamplingParams(temperature=0, max_tokens=12))]})
    return out["r"][0]


def test_chained_steps_give_the_synchronous_tokens(device):
    plain = drive(make_core(tiny_model(), device, "off"), workload(None))
    stop_token, eos = plain["g3"][0][2], plain["g5"][0][3]  # tokens the greedy streams produce
    loaded = tiny_model(eos_token_ids=(eos,))
    off = drive(make_core(loaded, device, "off"), workload(stop_token))
    core = make_core(loaded, device, "on")
    on = drive(core, workload(stop_token))
    assert on == off
    assert core.num_chained_steps >= 10  # the greedy stretches did run chained
    assert core.num_chained_admissions > 0  # and arrivals joined chained steps
    reasons = {reason for _, reason in off.values()}
    assert {"stop", "length"} <= reasons


def test_seeded_sampling_chains_and_draws_the_synchronous_tokens(device):
    loaded = tiny_model()
    arrivals = {0: [(f"s{i}", prompt(i, 3 + i), SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=i,
                                                               max_tokens=8 + 3 * i, ignore_eos=True))
                    for i in range(5)]}
    off = drive(make_core(loaded, device, "off"), arrivals)
    core = make_core(loaded, device, "on")
    assert drive(core, arrivals) == off
    assert core.num_chained_steps >= 10
    assert core.stats().num_chained_steps == core.num_chained_steps  # pdserve_engine_chained_steps_total


def test_what_is_sampled_blind():
    def blind(num_output: int = 3, eos: tuple[int, ...] = (2,), **kwargs) -> bool:
        return samples_blind(SamplingParams(**kwargs), num_output, eos)

    assert blind(temperature=0) and blind(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=3)
    assert not blind(temperature=0, logprobs=1) and not blind(temperature=0.7, presence_penalty=0.5)
    assert not blind(logit_bias={4: 1.0}) and not blind(allowed_token_ids=[1, 2])
    assert not blind(bad_words_token_ids=[[5]])
    # min_tokens bans EOS and the stop tokens until then: the rule reads the number only
    assert not blind(num_output=1, min_tokens=2) and blind(num_output=2, min_tokens=2)
    assert blind(num_output=1, min_tokens=2, ignore_eos=True) and blind(num_output=1, eos=(), min_tokens=2)
    assert not blind(num_output=1, min_tokens=2, ignore_eos=True, stop_token_ids=[7])


def test_the_blind_draw_is_the_samplers_and_marks_rows_without_a_maximum(device):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)).to(device)
    logits[2] = float("nan")
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=11),
              SamplingParams(temperature=0.5, seed=12), SamplingParams(temperature=1.2, top_k=7, seed=13)]

    def metadata():
        return SamplingMetadata.from_requests(params, [range(4)] * 4, [[1]] * 4, None, 50, device)

    blind = Sampler().sample_blind(logits, metadata()).tolist()
    assert blind[2] == -1
    fine = [0, 1, 3]
    expected = Sampler()(logits[fine], SamplingMetadata.from_requests(
        [params[i] for i in fine], [range(4)] * 3, [[1]] * 3, None, 50, device)).sampled_token_ids.tolist()
    assert [blind[i] for i in fine] == expected


def test_the_synchronous_engine_chains_nothing(device):
    core = make_core(tiny_model(), device, "off")
    drive(core, {0: [("a", prompt(1, 3), SamplingParams(temperature=0, max_tokens=20))]})
    assert core.num_chained_steps == 0


def test_aborted_and_stopped_requests_give_their_blocks_back_after_the_chained_step(device):
    loaded = tiny_model()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    arrivals = {0: [(name, prompt(i, 6), params) for i, name in enumerate("abc")]}
    sync = drive(make_core(loaded, device, "off"), arrivals)

    core = make_core(loaded, device, "on")
    for request_id, ids, p in arrivals[0]:
        core.add_request(request_id, ids, p)
    tokens = {name: [] for name in "abc"}
    while core._in_flight is None:  # the prompt step, then the first decode step chains
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    free_before = core.block_pool.num_free_blocks
    held = core.kv_manager.get_block_ids("a") + core.kv_manager.get_block_ids("b")
    core.abort_request("a")
    assert core.finish_request("b").finish_reason == "stop"  # a stop string matched, say
    # the chained step still writes their KV: their blocks stay out of the free pool
    assert core.block_pool.num_free_blocks == free_before
    core.check_integrity()
    outs = core.step()
    assert {o.request_id for o in outs} == {"c"}  # the tokens computed for a and b are dropped
    tokens["c"] += outs[0].new_token_ids
    assert core.block_pool.num_free_blocks >= free_before + len(set(held))
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
        core.check_integrity()
    assert tokens["c"] == sync["c"][0]
    assert core.block_pool.num_free_blocks == core.runner.num_blocks


def test_a_request_queued_mid_chain_joins_the_next_chained_step(device):
    core = make_core(tiny_model(), device, "on")
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    core.add_request("long", prompt(1, 4), long)
    while core._in_flight is None:
        core.step()
    core.add_request("late", prompt(2, 4), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    core.step()  # books the chained step and chains the next, with the late prompt after the fed row
    assert core._in_flight is not None and core.num_chained_admissions == 1
    assert [r.request_id for r in core._in_flight.sched.scheduled] == ["long", "late"]
    # a request whose first token needs the host (prompt logprobs) waits for a synchronous step
    core.add_request("logprobs", prompt(3, 4), SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    core.step()
    assert core._in_flight is None
    core.step()
    assert "logprobs" not in [r.request_id for r in core.scheduler.waiting]


def test_a_pool_too_small_for_the_chained_step_falls_back_to_the_synchronous_schedule(device):
    loaded = tiny_model()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    arrivals = {0: [(f"r{i}", prompt(i, 7), params) for i in range(4)]}
    # 16 blocks of 4 tokens: the four requests need up to 31 tokens each, so some are
    # preempted (by the synchronous schedules only) and recomputed
    off_core = make_core(loaded, device, "off", blocks=16)
    off = drive(off_core, arrivals)
    on_core = make_core(loaded, device, "on", blocks=16)
    on = drive(on_core, arrivals)
    assert on == off
    assert on_core.scheduler.num_preemptions > 0 and on_core.num_chained_steps > 0


def test_chains_beside_the_host_tier_give_the_synchronous_tokens(device):
    # a device pool of 20 blocks under requests cycling through six 12-token prefixes, arriving
    # while others decode: cached prefixes are evicted to the host tier and loaded back while
    # steps chain
    loaded = tiny_model()
    prefixes = [prompt(30 + p, 12) for p in range(6)]
    arrivals = {k: [(f"r{k}", prefixes[k // 3 % 6] + prompt(k, 2 + k % 4),
                     SamplingParams(temperature=0, max_tokens=6 + k % 5, ignore_eos=True))]
                for k in range(0, 54, 3)}
    def tiered(mode: str) -> EngineCore:
        core = make_core(loaded, device, mode, blocks=20, cpu_offload_gb=0.001)
        # this model's prefill is so fast that the cost model would always recompute: load
        core.host_tier.cost.should_load = lambda num_blocks: num_blocks > 0
        return core

    off = drive(tiered("off"), arrivals)
    core = tiered("on")
    assert drive(core, arrivals) == off
    device_tier, host_tier = core.stats().tiers
    assert core.num_chained_steps > 0 and device_tier.num_evicted_blocks > 0
    assert host_tier.num_hit_blocks > 0 and host_tier.num_loaded_bytes > 0, host_tier


def disaggregate(prefill: EngineCore, decode: EngineCore, request_id: str, ids: list[int],
                 params: SamplingParams) -> int:
    """A prefill engine computes the prompt and its first token; its blocks are copied into the
    decode engine's reservation, as a KV transfer would; returns the first token."""
    prefill.add_request(request_id, ids, params)
    first = None
    while first is None:
        for out in prefill.step():
            if out.request_id == request_id and out.new_token_ids:
                first = out.new_token_ids[0]
    src = prefill.get_block_ids(request_id)
    reservation = decode.reserve_remote(request_id, ids, params)
    assert reservation is not None
    skip = reservation.num_cached_blocks  # the decode engine's own prefix hit
    decode.kv_cache[reservation.block_ids[skip:]] = prefill.kv_cache[src[skip:len(reservation.block_ids)]].to(
        decode.kv_cache.device)
    prefill.release_held(request_id)
    assert decode.finish_remote_kv(request_id, first) is None
    return first


def test_a_decode_worker_admits_landed_requests_into_its_chain(device):
    loaded = tiny_model()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    arrivals = {k: (f"d{k}", prompt(k, 3 + k % 7)) for k in range(0, 40, 3)}
    results = {}
    for mode in ("off", "on"):
        prefill = EngineCore(EngineArgs(device=device, dtype="float32", block_size=4, num_kv_blocks=96,
                                        cpu_offload_gb=0).build(loaded.config, Role.PREFILL), loaded)
        decode = EngineCore(EngineArgs(device=device, dtype="float32", block_size=4, num_kv_blocks=96,
                                       max_num_seqs=8, cpu_offload_gb=0, async_scheduling=mode
                                       ).build(loaded.config, Role.DECODE), loaded)
        tokens: dict[str, list[int]] = {}
        for k in range(MAX_STEPS):
            if k in arrivals:
                request_id, ids = arrivals[k]
                tokens[request_id] = [disaggregate(prefill, decode, request_id, ids, params)]
            if k > max(arrivals) and not decode.has_unfinished_requests():
                break
            for out in decode.step():
                tokens[out.request_id] += out.new_token_ids
            decode.check_integrity()
        assert decode.block_pool.num_free_blocks == decode.runner.num_blocks
        results[mode] = (tokens, decode)
    assert results["on"][0] == results["off"][0]
    assert all(len(t) == 12 for t in results["on"][0].values())
    assert results["on"][1].num_chained_admissions > 0  # arrivals joined chained steps


def test_a_deferred_prompt_step_still_feeds_the_host_tiers_prefill_rate(device):
    core = make_core(tiny_model(), device, "on", cpu_offload_gb=0.001)
    before = core.host_tier.cost.prefill_tok_s
    drive(core, {0: [("p", prompt(1, 30), SamplingParams(temperature=0, max_tokens=2))]})
    assert core.host_tier.cost.prefill_tok_s != before  # its tokens came back deferred


def test_llm_stop_strings_and_streams_match(device):
    loaded = tiny_model()
    stream = reference_stream(device)
    stop = f"t{stream[5]}"
    params = [SamplingParams(temperature=0, max_tokens=16, stop=[stop]),
              SamplingParams(temperature=0, max_tokens=16, stop=[stop], include_stop_str_in_output=True),
              SamplingParams(temperature=0, max_tokens=11)]
    prompts = [prompt(0, 5), prompt(3, 8), prompt(4, 2)]
    results = {}
    for mode in ("off", "on"):
        llm = LLM(loaded, device=device, dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=8,
                  cpu_offload_gb=0, async_scheduling=mode)
        results[mode] = [(o.token_ids, o.text, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]
        assert llm.engine.block_pool.num_free_blocks == llm.engine.runner.num_blocks
    assert results["on"] == results["off"]
    assert results["off"][0][2] == "stop"


def test_deferred_tokens_feed_the_next_step_and_name_a_row_without_a_maximum(device):
    requests = [Request(f"r{i}", [1], SamplingParams(temperature=0)) for i in range(3)]
    steps = DeferredSteps(4, torch.device(device))
    deferred = steps.start(requests, torch.tensor([5, -1, 7], device=device))
    assert deferred.chain_input(requests).tolist() == [5, 0, 7]  # -1 reads as a valid id
    assert deferred.chain_input([requests[0], requests[2]]).tolist() == [5, 7]
    with pytest.raises(ValueError, match="request r1: the model's logits have no finite maximum"):
        deferred.output()
    fine = steps.start(requests[:2], torch.tensor([3, 4], device=device))
    assert fine.output().sampled == {"r0": [3], "r1": [4]}


def test_auto_is_on_for_cuda_decode_engines_without_speculation():
    def config(device: str, mode: str = "auto", role: Role = Role.COLOCATED, spec: str | None = None) -> EngineConfig:
        args = EngineArgs(device=device, async_scheduling=mode, spec_method=spec)
        return args.build(CONFIG, role)

    assert uses_async_scheduling(config("cuda")) and uses_async_scheduling(config("cuda", role=Role.DECODE))
    assert not uses_async_scheduling(config("cpu"))
    assert uses_async_scheduling(config("cpu", "on")) and not uses_async_scheduling(config("cuda", "off"))
    assert not uses_async_scheduling(config("cuda", role=Role.PREFILL))
    assert not uses_async_scheduling(config("cuda", "on", spec="ngram"))
    with pytest.raises(ConfigError, match="async_scheduling must be auto|on|off, got 'yes'"):
        config("cuda", "yes")


@pytest.mark.parametrize("mode", ["off", "on"])
def test_the_step_timer_times_every_booked_step_on_a_device_and_nothing_elsewhere(device, mode):
    """engine/step_timer.py: on CUDA each step's device time, read when it is booked (never a
    wait); on a CPU, and while not enabled, no events at all."""
    core = make_core(tiny_model(), device, mode)
    drive(core, workload(None))  # not enabled (offline): nothing recorded
    assert (core.step_timer.num_timed, core.step_timer.seconds) == (0, 0.0)
    core.step_timer.enabled = True
    steps_before = core.num_steps
    drive(core, workload(None))
    steps = core.num_steps - steps_before
    if device == "cuda":
        assert core.step_timer.num_timed == steps and core.step_timer.seconds > 0
        assert len(core.step_timer._free) <= 2  # the pairs are reused: at most two steps in flight
    else:
        assert (core.step_timer.num_timed, core.step_timer.seconds) == (0, 0.0) and steps > 0


def test_a_step_timer_that_cannot_read_its_events_turns_itself_off():
    from engine.step_timer import StepTimer

    class Broken:
        def query(self) -> bool:
            raise RuntimeError("CUDA error: not ready")

    timer = StepTimer(torch.device("cpu"))
    timer.enabled = True
    timer.book((Broken(), Broken()))  # type: ignore[arg-type]
    assert not timer.enabled and timer.num_timed == 0 and timer.start() is None
