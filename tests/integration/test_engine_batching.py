"""The engine with the real model (SmolLM2-135M, fp32, CPU): batching, seeded sampling,
preemption, stop strings, n > 1, logprobs and validation at the edge.

The oracle for batching is the engine itself running one request at a time: a request's
tokens must not depend on what else is in the batch, on chunked prefill, on prefix hits or on
being preempted and recomputed.
"""

from __future__ import annotations

import itertools
import math

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
TEXT = (
    "The history of the lighthouse begins in the ancient world, where fires were lit on hills "
    "to guide ships home. Later, towers of stone carried lamps of oil, and keepers climbed "
    "their stairs every night to trim the wicks and polish the glass. In the nineteenth "
    "century, lenses made of many rings of prisms let a small flame be seen from far out at "
    "sea, and each light was given its own pattern of flashes so that sailors could tell one "
    "coast from another. Today most lights are automatic, but the old towers still stand, "
    "and visitors climb them on summer afternoons to look out over the water."
)
_ids = itertools.count()


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def seeded(seed: int, max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=seed,
                          max_tokens=max_tokens, **kwargs)


@pytest.fixture(scope="module")
def llm(loaded_model):
    # A 64-token budget: prompts arriving together are chunked.
    return LLM(loaded_model, block_size=BLOCK_SIZE, num_kv_blocks=192, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def small_llm(loaded_model):
    # 4 blocks of 16 tokens: every request here fits alone, hardly two at a time.
    return LLM(loaded_model, block_size=BLOCK_SIZE, num_kv_blocks=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def workload(loaded_model) -> list[tuple[list[int], SamplingParams]]:
    """16 greedy requests: prompts of 3..33 tokens from different places of TEXT, 4..20 tokens."""
    tokens = loaded_model.tokenizer.encode(TEXT)
    assert len(tokens) >= 15 * 5 + 33
    return [(tokens[5 * i:5 * i + 3 + 2 * i], greedy(4 + (7 * i) % 17)) for i in range(16)]


def check_idle(core) -> None:
    """Nothing left in the engine; every block free; pool and tables consistent."""
    assert not core.has_unfinished_requests()
    core.check_integrity()
    pool = core.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)


def run_alone(core, prompt: list[int], params: SamplingParams) -> list[int] | list[list[int]]:
    """Tokens of one request run with nothing else in the engine (a list per sample if n > 1)."""
    assert not core.has_unfinished_requests()
    sample_ids = core.add_request(f"alone-{next(_ids)}", prompt, params)
    tokens = {sample_id: [] for sample_id in sample_ids}
    while core.has_unfinished_requests():
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
    check_idle(core)
    return tokens[sample_ids[0]] if len(sample_ids) == 1 else [tokens[s] for s in sample_ids]


def run_staggered(core, requests: list[tuple[list[int], SamplingParams]],
                  arrivals: list[int]) -> tuple[list[list[int]], dict]:
    """Add request i just before step ``arrivals[i]``; step until all finish. Returns each
    request's tokens and stats: the most requests running at once, the Request objects."""
    assert not core.has_unfinished_requests()
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    sample_index: dict[str, int] = {}
    tokens: list[list[int]] = [[] for _ in requests]
    stats = {"max_running": 0, "requests": {}}
    step = 0
    while order or core.has_unfinished_requests():
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            (sample_id,) = core.add_request(f"batch-{next(_ids)}", *requests[i])
            sample_index[sample_id] = i
            stats["requests"][i] = core.scheduler.requests[sample_id]
        for output in core.step():
            tokens[sample_index[output.request_id]] += output.new_token_ids
        stats["max_running"] = max(stats["max_running"], len(core.scheduler.running))
        step += 1
    check_idle(core)
    return tokens, stats


@pytest.fixture(scope="module")
def alone(llm, workload) -> list[list[int]]:
    return [run_alone(llm.engine, prompt, params) for prompt, params in workload]


def test_greedy_batch_with_staggered_arrivals_equals_each_request_alone(llm, workload, alone):
    arrivals = [3 * i // 2 for i in range(16)]  # 0, 1, 3, 4, 6, ...: some join mid-prefill
    tokens, stats = run_staggered(llm.engine, workload, arrivals)
    assert stats["max_running"] >= 8
    for i, (ours, reference) in enumerate(zip(tokens, alone)):
        assert ours == reference, f"request {i} (prompt {len(workload[i][0])} tokens) diverges"
    assert all(len(t) == p.max_tokens or t[-1] in llm.model_config.eos_token_ids
               for t, (_, p) in zip(tokens, workload))


@pytest.fixture(scope="module")
def seeded_requests(loaded_model) -> list[tuple[list[int], SamplingParams]]:
    encode = loaded_model.tokenizer.encode
    return [
        (encode("Once upon a time, in a small village by the sea,"), seeded(7)),
        (encode("My favourite recipe for soup starts with"), seeded(2024, min_p=0.02)),
        (encode("The three best things about winter are"), seeded(99, repetition_penalty=1.2)),
        (encode("def parse(line):"), seeded(5, max_tokens=10, presence_penalty=0.5)),
    ]


@pytest.fixture(scope="module")
def seeded_alone(llm, seeded_requests) -> list[list[int]]:
    return [run_alone(llm.engine, prompt, params) for prompt, params in seeded_requests]


def test_seeded_sampling_is_reproducible_alone_and_depends_on_the_seed(llm, seeded_requests,
                                                                       seeded_alone):
    again = [run_alone(llm.engine, prompt, params) for prompt, params in seeded_requests[:2]]
    assert again == seeded_alone[:2]
    assert all(len(t) == p.max_tokens for t, (_, p) in zip(seeded_alone, seeded_requests))
    prompt, params = seeded_requests[0]
    assert run_alone(llm.engine, prompt, params.replace(seed=params.seed + 1)) != seeded_alone[0]


def test_seeded_sampling_is_the_same_in_a_mixed_batch(llm, workload, alone, seeded_requests,
                                                      seeded_alone):
    mixed = workload[:12] + seeded_requests  # the seeded ones arrive mid-batch
    arrivals = [i // 2 for i in range(12)] + [1, 3, 5, 7]
    tokens, _ = run_staggered(llm.engine, mixed, arrivals)
    assert tokens[12:] == seeded_alone
    assert tokens[:12] == alone[:12]


def test_seeded_sampling_is_the_same_after_a_preemption(small_llm, loaded_model,
                                                        seeded_requests, seeded_alone):
    # An older greedy request holds 3 of the 4 blocks (46 prompt tokens) and the seeded one
    # (<= 13 prompt tokens) the 4th. The older one needs a block for its 49th token, at step
    # 3: the seeded one, the newest, is preempted, and recomputed once the older one is done.
    older = (loaded_model.tokenizer.encode(TEXT)[:46], greedy(8, ignore_eos=True))
    for request, reference in zip(seeded_requests, seeded_alone):
        assert len(request[0]) <= 13
        tokens, stats = run_staggered(small_llm.engine, [older, request], [0, 0])
        assert [stats["requests"][i].num_preemptions for i in (0, 1)] == [0, 1]
        assert tokens[1] == reference
        assert len(tokens[0]) == 8


def test_every_request_completes_correctly_through_preemption(small_llm, workload, alone):
    core = small_llm.engine
    preemptions_before = core.scheduler.num_preemptions
    tokens, stats = run_staggered(core, workload, [0] * 8 + [2] * 8)
    assert core.scheduler.num_preemptions - preemptions_before >= 4
    assert sum(r.num_preemptions > 0 for r in stats["requests"].values()) >= 4
    for i, (ours, reference) in enumerate(zip(tokens, alone)):
        assert ours == reference, f"request {i} diverges"
    check_idle(core)  # every block free again


@pytest.fixture(scope="module")
def stop_case(llm):
    """A greedy continuation and the text each of its tokens adds."""
    prompt = llm.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    params = greedy(24, ignore_eos=True)
    deltas = [d for d in llm.stream([prompt], params)]
    assert all(len(d.token_ids) == 1 for d in deltas)
    token_texts = [d.text for d in deltas]
    return prompt, params, [d.token_ids[0] for d in deltas], token_texts


def _split_stop(token_texts: list[str], num_tokens: int) -> tuple[str, int]:
    """A stop string that starts inside one token and ends inside the (num_tokens - 1)th next,
    occurring first there. Returns it and the index of the token that completes it."""
    text = "".join(token_texts)
    ends = list(itertools.accumulate(len(t) for t in token_texts))
    for i in range(2, len(token_texts) - num_tokens):
        first, last = token_texts[i], token_texts[i + num_tokens - 1]
        middle = token_texts[i + 1:i + num_tokens - 1]
        if len(first) < 2 or len(last) < 2 or not all(middle):
            continue
        stop = first[-2:] + "".join(middle) + last[:2]
        start = ends[i] - 2
        if text.find(stop) == start:
            return stop, i + num_tokens - 1
    raise AssertionError(f"no stop string across {num_tokens} tokens in {token_texts}")


@pytest.mark.parametrize("num_tokens", [2, 3])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens_stops_and_never_streams(llm, stop_case, num_tokens,
                                                                 include):
    prompt, params, reference_ids, token_texts = stop_case
    stop, last_index = _split_stop(token_texts, num_tokens)
    full_text = "".join(token_texts)
    cut = full_text.index(stop) + (len(stop) if include else 0)

    stream_params = params.replace(stop=[stop], include_stop_str_in_output=include)
    deltas = list(llm.stream([prompt], stream_params))
    streamed = "".join(d.text for d in deltas)
    assert streamed == full_text[:cut]
    if not include:
        assert stop not in streamed
    assert [t for d in deltas for t in d.token_ids] == reference_ids[:last_index + 1]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    assert all(d.finish_reason is None for d in deltas[:-1])

    (result,) = llm.generate([prompt], stream_params)
    assert result.text == streamed and result.token_ids == reference_ids[:last_index + 1]
    assert result.outputs[0].finish_reason == "stop"
    check_idle(llm.engine)


def test_the_text_held_back_for_a_stop_string_is_released_at_the_end(llm, stop_case):
    prompt, params, reference_ids, token_texts = stop_case
    # A stop string that never matches but whose first character keeps text held back.
    last_char = token_texts[-1][-1]
    deltas = list(llm.stream([prompt], params.replace(stop=[last_char + "\u2603"])))
    assert "".join(d.text for d in deltas) == "".join(token_texts)
    assert [t for d in deltas for t in d.token_ids] == reference_ids
    assert deltas[-1].finish_reason == "length"


def test_parallel_samples_share_the_prompt_blocks_and_equal_seeded_single_runs(llm,
                                                                              loaded_model):
    core = llm.engine
    prompt = loaded_model.tokenizer.encode(
        "Write one sentence about a cat who lives in an old lighthouse on a rocky island, "
        "far from the coast, and who likes")
    assert BLOCK_SIZE < len(prompt) < 2 * BLOCK_SIZE  # one full block and a partial one
    params = SamplingParams(n=3, temperature=1.0, seed=31, max_tokens=10)
    request_id = f"fork-{next(_ids)}"
    sample_ids = core.add_request(request_id, prompt, params)
    assert sample_ids == [f"{request_id}/{i}" for i in range(3)]
    outputs = []
    while not outputs:
        outputs = core.step()
    # The step that completed sample 0's prompt also gave samples 1 and 2 their first token,
    # from the same blocks: two blocks in use, each held by all three.
    assert sorted(o.request_id for o in outputs) == sorted(sample_ids)
    tables = [core.get_block_ids(s) for s in sample_ids]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 2
    assert [core.block_pool.blocks[b].ref_cnt for b in tables[0]] == [3, 3]
    assert core.block_pool.num_blocks - core.block_pool.num_free_blocks == 2
    tokens = {o.request_id: list(o.new_token_ids) for o in outputs}
    while core.has_unfinished_requests():
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
    check_idle(core)
    assert sample_ids == [f"{request_id}/{i}" for i in range(3)]  # still the caller's
    samples = [tokens[s] for s in sample_ids]
    # Sample i is the same request with n=1 and seed 31 + i; different seeds differ.
    singles = [run_alone(core, prompt, params.replace(n=1, seed=31 + i)) for i in range(3)]
    assert samples == singles
    assert len({tuple(s) for s in samples}) == 3

    (result,) = llm.generate([prompt], params)
    assert [c.token_ids for c in result.outputs] == samples
    assert [c.index for c in result.outputs] == [0, 1, 2]

    # One token each: the samples fork and finish in the step their parent finishes.
    (result,) = llm.generate([prompt], params.replace(max_tokens=1))
    assert [c.token_ids for c in result.outputs] == [s[:1] for s in samples]
    assert [c.finish_reason for c in result.outputs] == ["length"] * 3
    check_idle(core)


def test_logprobs_and_prompt_logprobs(llm, loaded_model):
    prompt = loaded_model.tokenizer.encode(
        "Paris is the capital of France, Rome is the capital of Italy, and the capital")
    assert len(prompt) > BLOCK_SIZE  # a second run has a full cached block to hit
    params = greedy(6, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    (result,) = llm.generate([prompt], params)
    completion = result.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        assert entry.token_id == token_id and entry.rank == 1
        assert len(entry.top) == 5 and entry.top[0][0] == token_id
        assert entry.logprob == entry.top[0][1] <= 0.0  # the greedy token is the top-1
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
        assert sum(math.exp(lp) for _, lp in entry.top) <= 1.0 + 1e-5

    prompt_logprobs = result.prompt_logprobs
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position, entry in enumerate(prompt_logprobs[1:], start=1):
        assert entry.token_id == prompt[position] and len(entry.top) == 3
        assert entry.rank >= 1 and entry.logprob <= 0.0
        top_ids = [t for t, _ in entry.top]
        if entry.rank <= 3:
            assert top_ids[entry.rank - 1] == entry.token_id
            assert entry.top[entry.rank - 1][1] == pytest.approx(entry.logprob, abs=1e-5)
        else:
            assert entry.token_id not in top_ids and entry.logprob <= entry.top[-1][1]

    # The same prompt is now in the prefix cache: prompt logprobs are still all there, equal.
    (again,) = llm.generate([prompt], params)
    assert again.token_ids == completion.token_ids
    assert [None if e is None else (e.token_id, e.rank) for e in again.prompt_logprobs] == [
        None if e is None else (e.token_id, e.rank) for e in prompt_logprobs]
    for ours, first in zip(again.prompt_logprobs[1:], prompt_logprobs[1:]):
        assert ours.logprob == pytest.approx(first.logprob, abs=1e-4)

    # The logprob of output token 0 is the prompt logprob of that token one request later.
    (extended,) = llm.generate([prompt + completion.token_ids[:1]], greedy(1, prompt_logprobs=5))
    last = extended.prompt_logprobs[-1]
    first_output = completion.logprobs[0]
    assert last.token_id == first_output.token_id and last.rank == 1
    assert last.logprob == pytest.approx(first_output.logprob, abs=1e-4)
    assert [t for t, _ in last.top] == [t for t, _ in first_output.top]
    check_idle(llm.engine)


@pytest.mark.parametrize("prompt, params, names", [
    ([1, 2, 3], SamplingParams(max_tokens=-1), ["max_tokens"]),
    ([1, 2, 3], SamplingParams(max_tokens=0), ["max_tokens"]),
    ([1, 2, 3], SamplingParams(top_p=0.0), ["top_p"]),
    ([1, 2, 3], SamplingParams(top_p=1.5), ["top_p"]),
    ([1] * 8000, SamplingParams(max_tokens=500), ["max_tokens", "context"]),
    ([1, 49152, 3], SamplingParams(), ["vocab"]),
    ([1, -1], SamplingParams(), ["vocab"]),
    ([1, 2, 3], SamplingParams(n=17), ["n "]),
    ([], SamplingParams(), ["prompt"]),
])
def test_bad_requests_are_rejected_naming_the_parameter(llm, prompt, params, names):
    core = llm.engine
    with pytest.raises(ValueError) as error:
        core.add_request(f"bad-{next(_ids)}", prompt, params)
    for name in names:
        assert name in str(error.value), str(error.value)
    # Through the offline API, beside a good prompt: nothing is left behind either.
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], prompt], params)
    check_idle(core)


def test_empty_text_prompt_is_rejected(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("", greedy(4))
    check_idle(llm.engine)
