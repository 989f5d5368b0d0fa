"""A request resumed from output tokens another engine produced (a migration after a worker died)
continues exactly: greedy and seeded sampled tokens equal the unbroken run's from the resume
point on, with penalties and max_tokens counted over the whole output; bad resumes are
ValueErrors that leave nothing behind. Real model (SmolLM2-135M, fp32, CPU)."""

from __future__ import annotations

import pytest

from engine.args import EngineArgs
from engine.config import Role
from engine.core import EngineCore
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = [(7 * i + 3) % 4000 + 100 for i in range(21)]
_ids = iter(range(10**6))


@pytest.fixture(scope="module")
def core(loaded_model) -> EngineCore:
    config = EngineArgs(block_size=8, num_kv_blocks=32, max_num_batched_tokens=64).build(
        loaded_model.config, Role.COLOCATED)
    return EngineCore(config, loaded_model)


def run(core: EngineCore, params: SamplingParams, resumed: list[int] = ()) -> list[int]:
    """Output tokens of one request run alone (the resumed ones not repeated); checks idle after."""
    core.add_request(f"r{next(_ids)}", PROMPT, params, resumed_output_token_ids=resumed)
    tokens: list[int] = []
    for _ in range(100):
        if not core.has_unfinished_requests():
            break
        for output in core.step():
            tokens += output.new_token_ids
    assert not core.has_unfinished_requests()
    core.check_integrity()
    assert core.block_pool.num_free_blocks == core.block_pool.num_blocks
    return tokens


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=12),
    SamplingParams(temperature=0.9, top_k=50, seed=1234, max_tokens=12),
    SamplingParams(temperature=0.9, seed=7, max_tokens=12, frequency_penalty=1.5,
                   presence_penalty=0.5, repetition_penalty=1.3, min_tokens=11),
], ids=["greedy", "seeded", "seeded-penalties"])
def test_resume_continues_the_unbroken_stream(core, params):
    whole = run(core, params)
    assert len(whole) == 12
    for k in (1, 11):
        assert run(core, params, whole[:k]) == whole[k:], k


def test_bad_resumes_are_value_errors(core):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="out of vocabulary"):
        core.add_request("bad1", PROMPT, params, resumed_output_token_ids=[10**9])
    with pytest.raises(ValueError, match="nothing to generate under max_tokens 4"):
        core.add_request("bad2", PROMPT, params, resumed_output_token_ids=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="n=1 and no prompt_logprobs"):
        core.add_request("bad3", PROMPT, SamplingParams(temperature=0.0, max_tokens=4, n=2),
                         resumed_output_token_ids=[1])
    assert not core.has_unfinished_requests()
    assert run(core, params)  # still serving
