"""Scheduler properties under random add / step / abort / finish sequences (and, per role,
reserve_remote / finish_remote_kv / release_held), over a real KVCacheManager and BlockPool
with the token-id KV store of ``FakeRunner``.

Checked after every rule: pool and table integrity, each running request's table covers its
computed tokens, computed <= tokens, no request in two queues, len(running) <= max_num_seqs.
Checked after every step: the token budget and the prefill chunk cap hold, decodes are never
starved by prefill chunks, preemption takes the newest running requests and queues them first,
and every request reads back its own tokens from the KV slots (FakeRunner). At the end every
request finishes (no livelock), each one's streamed tokens equal its tokens, and every block is
free.
"""

from __future__ import annotations

import zlib

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.config import Role
from engine.request import Request, RequestStatus
from tests.unit._scheduler_fakes import FakeRunner, check_scheduler, make_request, make_scheduler

EOS = 0
MAX_MODEL_LEN = 32


def fake_token(request: Request) -> int:
    """A deterministic "model": tokens 0..5 (0 is EOS) from the sample id and position."""
    return zlib.crc32(f"{request.request_id}:{request.num_output_tokens}".encode()) % 6


prompts = st.lists(st.integers(1, 3), min_size=1, max_size=12)  # few symbols: prefix hits
max_tokens = st.one_of(st.integers(1, 10), st.none())


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([2, 4]), num_blocks=st.integers(3, 16),
                budget=st.integers(1, 12), max_num_seqs=st.integers(1, 4),
                threshold=st.sampled_from([0, 0, 1, 3, 5]), caching=st.booleans(),
                role=st.sampled_from([Role.COLOCATED, Role.COLOCATED, Role.PREFILL, Role.DECODE]))
    def setup(self, block_size, num_blocks, budget, max_num_seqs, threshold, caching, role):
        self.scheduler = make_scheduler(
            num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs, role=role, long_prefill_token_threshold=threshold,
            enable_prefix_caching=caching, max_model_len=MAX_MODEL_LEN)
        self.runner = FakeRunner(self.scheduler, fake_token)
        self.role = role
        self.ids = 0
        self.streamed: dict[str, list[int]] = {}  # sample id -> tokens from its outputs
        self.finished: dict[str, Request] = {}
        self.all_requests: dict[str, Request] = {}
        self.remote_first_tokens: dict[str, int] = {}

    # ---- rules -----------------------------------------------------------------------

    def _fits(self, request: Request) -> bool:
        limit = request.sampling_params.max_tokens
        max_len = min(request.num_prompt_tokens + (limit or MAX_MODEL_LEN), MAX_MODEL_LEN)
        num_blocks = self.scheduler.kv_manager.block_pool.num_blocks
        return -(-max_len // self.scheduler.block_size) <= num_blocks

    @rule(prompt=prompts, limit=max_tokens, n=st.integers(1, 3), min_tokens=st.integers(0, 2),
          want_prompt_logprobs=st.booleans())
    def add(self, prompt, limit, n, min_tokens, want_prompt_logprobs):
        self.ids += 1
        request_id = f"r{self.ids}"
        extra = {"prompt_logprobs": 0} if want_prompt_logprobs else {}
        min_tokens = min(min_tokens, limit or min_tokens)
        samples = [make_request(request_id if n == 1 else f"{request_id}/{i}", prompt, limit,
                                eos_token_ids=(EOS,), index=i,
                                parent_id=None if n == 1 else request_id,
                                min_tokens=min_tokens, **extra)
                   for i in range(n)]
        if not self._fits(samples[0]):
            try:
                self.scheduler.add_request(samples[0])
            except ValueError as exc:
                assert "max_tokens" in str(exc)
                return
            raise AssertionError(f"{samples[0]} can never fit but was accepted")
        self.scheduler.add_request(samples[0])
        for sample in samples[1:]:
            self.scheduler.add_request(sample, fork_from=samples[0].request_id)
        for sample in samples:
            self.all_requests[sample.request_id] = sample
            self.streamed[sample.request_id] = []

    @rule()
    def step(self):
        scheduler = self.scheduler
        running_before = list(scheduler.running)
        waiting_before = [r.request_id for r in scheduler.waiting]
        decoding_before = [r for r in running_before if r.num_tokens - r.num_computed_tokens == 1]
        sched, outputs = self.runner.step()
        budget = scheduler.config.max_num_batched_tokens
        assert sched.total_num_scheduled_tokens <= budget
        threshold = scheduler.config.long_prefill_token_threshold
        for request_id, num_new in sched.num_scheduled_tokens.items():
            # 0 only for a sample forked this step; > 1 only for a prefill chunk.
            assert num_new >= 1 or self.all_requests[request_id].parent_id is not None
            if threshold and num_new > 1:
                assert num_new <= threshold, (request_id, num_new, threshold)

        # Preemption: the newest running requests, newest first, and they queue first.
        preempted = sched.preempted_ids
        if preempted:
            assert [r.request_id for r in reversed(running_before)][:len(preempted)] == preempted
            waiting_ids = [r.request_id for r in scheduler.waiting]
            for request_id in preempted:
                request = self.all_requests[request_id]
                assert request.status == RequestStatus.PREEMPTED
                assert request.num_computed_tokens == 0
                assert scheduler.kv_manager.get_block_ids(request_id) == []
                assert all(waiting_ids.index(request_id) < waiting_ids.index(w)
                           for w in waiting_before if w in waiting_ids)
            assert not (set(preempted) & set(sched.num_scheduled_tokens))
        # Decodes first: with room in the budget, no running decode waits behind a prefill.
        elif len(decoding_before) <= budget:
            missed = [r.request_id for r in decoding_before
                      if r.request_id not in sched.num_scheduled_tokens]
            assert not missed, f"decodes {missed} not scheduled: {sched.num_scheduled_tokens}"

        for output in outputs:
            self.streamed[output.request_id] += output.new_token_ids
            if output.finished:
                self.finished[output.request_id] = self.all_requests[output.request_id]

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        output = self.scheduler.abort_request(request_id)
        assert output.finished and output.finish_reason == "abort"
        assert self.scheduler.kv_manager.get_block_ids(request_id) == []
        self.finished[request_id] = self.all_requests[request_id]

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def finish(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        output = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
        assert output.finished and output.finish_reason == "stop"
        if request_id not in self.scheduler.held:
            assert self.scheduler.kv_manager.get_block_ids(request_id) == []
        self.finished[request_id] = self.all_requests[request_id]

    @precondition(lambda self: self.role == Role.PREFILL and self.scheduler.held)
    @rule(data=st.data())
    def release(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.held)))
        self.scheduler.release_held(request_id)
        assert self.scheduler.kv_manager.get_block_ids(request_id) == []

    @precondition(lambda self: self.role == Role.DECODE)
    @rule(prompt=prompts, limit=st.integers(1, 8))
    def reserve(self, prompt, limit):
        self.ids += 1
        request = make_request(f"d{self.ids}", prompt, limit, eos_token_ids=(EOS,))
        if not self._fits(request):
            return
        free_before = self.scheduler.kv_manager.num_free_blocks
        block_ids = self.scheduler.reserve_remote(request)
        if block_ids is None:
            assert self.scheduler.kv_manager.num_free_blocks == free_before
            assert request.request_id not in self.scheduler.requests
            return
        assert len(block_ids) == -(-len(prompt) // self.scheduler.block_size)
        bs = self.scheduler.block_size
        for pos, token in enumerate(prompt):  # the prefill worker writes the prompt's KV
            self.runner.slots[block_ids[pos // bs] * bs + pos % bs] = token
        self.all_requests[request.request_id] = request
        self.streamed[request.request_id] = []

    def _remote(self) -> list[str]:
        return sorted(r.request_id for r in self.scheduler.waiting
                      if r.status == RequestStatus.WAITING_FOR_REMOTE_KV)

    @precondition(lambda self: self.role == Role.DECODE and self._remote())
    @rule(data=st.data(), first_token=st.integers(0, 5))
    def land(self, data, first_token):
        request_id = data.draw(st.sampled_from(self._remote()))
        self.remote_first_tokens[request_id] = first_token
        output = self.scheduler.finish_remote_kv(request_id, first_token)
        if output is not None:
            assert output.finished and self.scheduler.kv_manager.get_block_ids(request_id) == []
            self.finished[request_id] = self.all_requests[request_id]

    # ---- invariants ------------------------------------------------------------------

    @invariant()
    def consistent(self):
        if hasattr(self, "scheduler"):
            check_scheduler(self.scheduler)

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        scheduler = self.scheduler
        for request_id in self._remote():
            self.remote_first_tokens[request_id] = 1
            output = scheduler.finish_remote_kv(request_id, 1)
            if output is not None:
                self.finished[request_id] = self.all_requests[request_id]
        for _ in range(2000):
            for request_id in list(scheduler.held):
                scheduler.release_held(request_id)
            if not scheduler.has_unfinished_requests():
                break
            self.step()
            check_scheduler(scheduler)
        else:
            raise AssertionError(f"livelock: waiting={list(scheduler.waiting)} "
                                 f"running={scheduler.running} pending={scheduler.forks}")
        for request_id in list(scheduler.held):
            scheduler.release_held(request_id)

        pool = scheduler.kv_manager.block_pool
        assert all(b.ref_cnt == 0 for b in pool.blocks) and pool.num_free_blocks == pool.num_blocks
        check_scheduler(scheduler)
        assert self.finished.keys() == self.all_requests.keys()
        for request_id, request in self.all_requests.items():
            tokens = request.output_token_ids
            if request_id in self.remote_first_tokens:  # sampled by the prefill worker
                assert tokens[:1] == [self.remote_first_tokens[request_id]]
                tokens = tokens[1:]
            assert self.streamed[request_id] == tokens, request
            params = request.sampling_params
            if params.max_tokens is not None:
                assert request.num_output_tokens <= params.max_tokens, request
            assert request.num_tokens <= MAX_MODEL_LEN
            first_stop = max(params.min_tokens - 1, 0)  # EOS counts from output min_tokens on
            if EOS in request.output_token_ids[first_stop:]:
                first_eos = request.output_token_ids.index(EOS, first_stop)
                assert first_eos == request.num_output_tokens - 1, request
            if self.role == Role.PREFILL:
                assert request.num_output_tokens <= 1


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
