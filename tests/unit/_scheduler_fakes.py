"""A model stand-in for scheduler tests: a Scheduler over a real KVCacheManager and BlockPool,
driven one step at a time by a fake runner that stores one token id per KV slot.

Before writing a step's tokens, the fake runner reads back every computed position of each
scheduled request, so a wrong block table, a missed copy-on-write, a bad prefix hit or a block
handed to two owners shows up as a request "attending" to someone else's token.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.config import ModelConfig, Role, SchedulerConfig
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler.output import RequestOutput, SchedulerOutput
from engine.scheduler.scheduler import Scheduler

VOCAB_SIZE = 1000


def make_scheduler(*, num_blocks: int = 32, block_size: int = 4, max_num_batched_tokens: int = 64,
                   max_num_seqs: int = 16, role: Role = Role.COLOCATED,
                   long_prefill_token_threshold: int = 0, enable_prefix_caching: bool = True,
                   max_model_len: int = 128) -> Scheduler:
    model_config = ModelConfig("fake", vocab_size=VOCAB_SIZE, hidden_size=8, intermediate_size=16,
                               num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                               max_model_len=max_model_len)
    pool = BlockPool(num_blocks, enable_prefix_caching, enable_events=False)
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, role,
                                     long_prefill_token_threshold),
                     model_config, KVCacheManager(pool, block_size), block_size,
                     enable_prefix_caching)


def make_request(request_id: str, prompt: list[int] | int, max_tokens: int | None = 8,
                 eos_token_ids: tuple[int, ...] = (), index: int = 0,
                 parent_id: str | None = None, **params) -> Request:
    """``prompt`` is the token ids, or a length (tokens 1..n)."""
    if isinstance(prompt, int):
        prompt = list(range(1, prompt + 1))
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids, parent_id=parent_id, index=index)


def counting_token(request: Request) -> int:
    """The default fake model: output token k of sample i is 100 + 10 * i + k."""
    return 100 + 10 * request.index + request.num_output_tokens


class FakeRunner:
    """Executes a step like ModelRunner does, on a KV store of token ids instead of tensors."""

    def __init__(self, scheduler: Scheduler,
                 next_token: Callable[[Request], int] = counting_token) -> None:
        self.scheduler = scheduler
        self.next_token = next_token
        self.block_size = scheduler.block_size
        self.slots: list[int | None] = [None] * (scheduler.kv_manager.block_pool.num_blocks
                                                 * self.block_size)

    def step(self) -> tuple[SchedulerOutput, list[RequestOutput]]:
        sched = self.scheduler.schedule()
        for src, dst in sched.copy_ops:
            bs = self.block_size
            self.slots[dst * bs:(dst + 1) * bs] = self.slots[src * bs:(src + 1) * bs]
        sampled: dict[str, list[int]] = {}
        prompt_logprobs: dict[str, list] = {}
        for request in sched.scheduled:
            num_new = sched.num_scheduled_tokens[request.request_id]
            start = request.num_computed_tokens
            token_ids = request.all_token_ids + request.spec_token_ids
            self._read_and_write(request, token_ids, start, num_new)
            if (request.sampling_params.prompt_logprobs is not None
                    and start < request.num_prompt_tokens):
                # Like the runner: row p predicts prompt token p + 1; "logprobs" are positions.
                end = min(start + num_new, request.num_prompt_tokens - 1)
                entries = list(range(start + 1, end + 1))
                prompt_logprobs[request.request_id] = [None, *entries] if start == 0 else entries
            if start + num_new >= request.num_tokens:
                for r in [request, *sched.fork_children.get(request.request_id, ())]:
                    sampled[r.request_id] = [self.next_token(r)]
        outputs = self.scheduler.update(sched, sampled, prompt_logprobs=prompt_logprobs)
        return sched, outputs

    def _read_and_write(self, request: Request, token_ids: list[int], start: int,
                        num_new: int) -> None:
        block_ids = self.scheduler.kv_manager.get_block_ids(request.request_id)
        bs = self.block_size
        if len(block_ids) * bs < start + num_new:
            raise AssertionError(
                f"{request}: table {block_ids} cannot hold {start + num_new} tokens")
        slot = lambda pos: block_ids[pos // bs] * bs + pos % bs  # noqa: E731
        seen = [self.slots[slot(pos)] for pos in range(start)]
        if seen != token_ids[:start]:
            raise AssertionError(f"{request} reads KV of tokens {seen}, its tokens are "
                                 f"{token_ids[:start]} (table {block_ids})")
        for pos in range(start, start + num_new):
            self.slots[slot(pos)] = token_ids[pos]


def run_until_idle(runner: FakeRunner, max_steps: int = 1000) -> list[RequestOutput]:
    """Step until no request is left; returns every output. Fails on a livelock."""
    outputs = []
    for _ in range(max_steps):
        if not runner.scheduler.has_unfinished_requests():
            return outputs
        outputs += runner.step()[1]
    scheduler = runner.scheduler
    raise AssertionError(f"still unfinished after {max_steps} steps: "
                         f"waiting={list(scheduler.waiting)} running={scheduler.running}")


def check_scheduler(scheduler: Scheduler) -> None:
    """Every cross-structure invariant the scheduler promises between steps."""
    manager = scheduler.kv_manager
    pool = manager.block_pool
    manager.check_integrity()
    num_in_use = sum(1 for b in pool.blocks if b.ref_cnt > 0)
    num_cached = sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
    num_free = sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is None)
    assert num_free + num_cached + num_in_use == pool.num_blocks
    assert num_free + num_cached == pool.num_free_blocks

    pending = list(scheduler.forks)
    everywhere = [r.request_id for r in [*scheduler.running, *scheduler.waiting, *pending]]
    assert len(set(everywhere)) == len(everywhere), f"a request is in two queues: {everywhere}"
    assert set(everywhere) == set(scheduler.requests), (everywhere, list(scheduler.requests))
    assert not set(scheduler.held) & set(scheduler.requests)
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    for request in scheduler.requests.values():
        assert 0 <= request.num_computed_tokens <= request.num_tokens, request
        assert not request.is_finished, request
    for request in scheduler.running:
        num_slots = len(manager.get_block_ids(request.request_id)) * scheduler.block_size
        assert num_slots >= request.num_computed_tokens, (request, num_slots)
    for request in [*scheduler.waiting, *pending]:  # only reserved, loading or landed KV is held
        if (request.status not in (RequestStatus.WAITING_FOR_REMOTE_KV, RequestStatus.WAITING_FOR_HOST_KV)
                and request.num_computed_tokens == 0):
            assert manager.get_block_ids(request.request_id) == [], request
    owners = set(manager._requests)
    assert owners <= set(scheduler.requests) | set(scheduler.held), owners
