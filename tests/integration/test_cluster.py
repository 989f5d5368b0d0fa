"""The disaggregated path end to end: real prefill, decode and router processes on loopback,
compared token for token with the offline ``engine.LLM``.

One cluster for the module: 2 prefill + 2 decode workers started with ``--transfer nixl``
(so they serve NIXL *and* gRPC transfers; each request picks one), and two routers
(``pdserve serve router``) in front of them, one per ``--transfer``. Requests go through a
router's public gRPC Generate API; tests that need to see inside a request (first-token
logprobs, bad input, a transfer made to fail) use DisaggregatedBackend or the worker RPCs
directly. Prefill workers use 64-token chunks so longer prompts are pushed chunk by chunk
while later chunks compute. The test that kills a decode worker runs last.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
import urllib.request

import grpc
import pytest

from engine.sampling_params import SamplingParams
from services.common.pb import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.wire import finish_from_proto, params_to_proto
from services.router.backends.disaggregated import DisaggregatedBackend
from tests.integration import structured_checks, tool_checks
from tests.integration.cluster_fixtures import (
    oracle_llm,
    prefill_into_receiver,
    start_router,
    start_worker,
    stop_all,
    wait_all_blocks_free,
    wait_serving,
)

pytestmark = pytest.mark.slow

NUM_BLOCKS = 96
LEASE_MS = 8000
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Write a short poem about the sea. The waves roll in and out, the gulls cry overhead, and",
    " ".join(["In the beginning the universe was created."] * 14) + " This has made a lot of",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "1, 1, 2, 3, 5, 8, 13,",
    "La capitale de l'Italie est",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("cluster-logs")
    common = ["--num-kv-blocks", str(NUM_BLOCKS)]
    workers = ([start_worker("prefill", log_dir, *common, "--max-num-batched-tokens", "64")
                for _ in range(2)]
               + [start_worker("decode", log_dir, *common, "--reservation-lease-ms", str(LEASE_MS))
                  for _ in range(2)])
    routers = [start_router(log_dir, workers[:2], workers[2:], transfer)
               for transfer in ("grpc", "nixl")]
    try:
        wait_serving(workers + routers)
        yield workers + routers
    finally:
        stop_all(routers)
        stop_all(workers)


def router(cluster, transfer: str):
    return next(p for p in cluster if p.role == "router" and f"router-{transfer}-" in p.log_path.name)


@pytest.fixture(scope="module")
def llm(loaded_model):
    yield from oracle_llm(loaded_model, num_kv_blocks=256)


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return [llm.tokenizer.encode(p) for p in PROMPTS]


def prefills(cluster):
    return [w for w in cluster if w.role == "prefill" and w.proc.poll() is None]


def decodes(cluster):
    return [w for w in cluster if w.role == "decode" and w.proc.poll() is None]


def backend_for(cluster, transfer: str, **kwargs) -> DisaggregatedBackend:
    return DisaggregatedBackend([w.address for w in prefills(cluster)],
                                [w.address for w in decodes(cluster)], transfer,
                                poll_interval_s=0.2, **kwargs)


async def generate(channel: grpc.aio.Channel, prompt: list[int], params: SamplingParams,
                   timeout_s: float = 120.0) -> dict[int, tuple[list[int], str | None]]:
    """{sample index: (token ids, finish reason)} of one Generate call to a router."""
    call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(generate_pb2.GenerateRequest(
        prompt_token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling_params=params_to_proto(params)), timeout=timeout_s)
    samples: dict[int, tuple[list[int], str | None]] = {}
    async for chunk in call:
        tokens, _ = samples.get(chunk.index, ([], None))
        samples[chunk.index] = (tokens + list(chunk.token_ids), finish_from_proto(chunk.finish_reason))
    return samples


def through_router(cluster, transfer: str, prompts: list[list[int]], params: SamplingParams):
    async def scenario():
        async with grpc.aio.insecure_channel(router(cluster, transfer).address) as channel:
            return await asyncio.gather(*(generate(channel, p, params) for p in prompts))
    return asyncio.run(scenario())


async def collect(backend, request_id, prompt, params, timeout_s: float = 120.0):
    """{sample index: (token ids, finish reason)} for one request."""
    async def run():
        samples: dict[int, tuple[list[int], str | None]] = {}
        async for event in backend.generate(request_id, prompt, params):
            tokens, _ = samples.get(event.index, ([], None))
            samples[event.index] = (tokens + event.token_ids, event.finish_reason)
        return samples
    return await asyncio.wait_for(run(), timeout_s)


_offline_cache: dict[str, list] = {}


def offline(llm, prompts, params):
    """[[(token ids, finish reason) per sample] per prompt] from the offline engine (cached)."""
    key = repr((prompts, params))
    if key not in _offline_cache:
        _offline_cache[key] = [[(c.token_ids, c.finish_reason) for c in out.outputs]
                               for out in llm.generate(prompts, params)]
    return _offline_cache[key]


def assert_no_leaks(cluster, timeout_s: float = 2.0):
    seen = wait_all_blocks_free(prefills(cluster) + decodes(cluster), timeout_s)
    assert all(free == total for free, total in seen.values()), f"blocks in use: {seen}"


@pytest.mark.parametrize("transfer", ["grpc", "nixl"])
def test_greedy_matches_offline(cluster, llm, prompt_ids, transfer):
    expected = offline(llm, prompt_ids, GREEDY)
    results = through_router(cluster, transfer, prompt_ids, GREEDY)
    assert [[r[0]] for r in results] == expected
    assert_no_leaks(cluster)


def _http_completion(router_process, prompt: list[int], stream: bool,
                     **fields: object) -> tuple[list[int], str]:
    """(token ids, text) of one /v1/completions call to a router's OpenAI HTTP server;
    ``fields`` go into the body as they are."""
    port = router_process.args[router_process.args.index("--http-port") + 1]
    body = json.dumps({"prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0.0,
                       "stream": stream, "return_token_ids": True, **fields}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        if not stream:
            choice = json.loads(reply.read())["choices"][0]
            return choice["token_ids"], choice["text"]
        token_ids, text, done = [], "", False
        for line in reply:
            line = line.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                token_ids += choice.get("token_ids", [])
                text += choice.get("text", "")
        assert done, "the SSE stream did not end with [DONE]"
        return token_ids, text


@pytest.mark.parametrize("transfer", ["grpc", "nixl"])
def test_http_streaming_and_not_match_offline(cluster, llm, prompt_ids, transfer):
    expected = offline(llm, prompt_ids, GREEDY)
    for ids, ((want_ids, _),) in zip(prompt_ids, expected):
        plain_ids, plain_text = _http_completion(router(cluster, transfer), ids, stream=False)
        streamed_ids, streamed_text = _http_completion(router(cluster, transfer), ids, stream=True)
        assert plain_ids == want_ids and streamed_ids == want_ids
        assert streamed_text == plain_text == llm.tokenizer.decode(want_ids)
    assert_no_leaks(cluster)


@pytest.mark.parametrize("transfer", ["grpc", "nixl"])
def test_structured_outputs_and_tool_calls_over_each_transfer(cluster, llm, transfer):
    """Greedy constrained output is the offline engine's over either KV transfer, for every
    schema; sampled, streamed output and tool calls validate (tests/integration/structured_checks.py,
    tool_checks.py)."""
    port = router(cluster, transfer).args[router(cluster, transfer).args.index("--http-port") + 1]
    api = structured_checks.client(f"127.0.0.1:{port}")
    model = api.models.list().data[0].id
    structured_checks.greedy_matches_the_offline_engine(api, model, llm)
    structured_checks.every_schema_validates(api, model, llm)
    structured_checks.chat_streamed_at_temperature_1_validates(api, model)
    tool_checks.required_and_named_calls_validate(api, model)


def test_salted_requests_end_to_end_and_an_over_long_salt_is_refused(cluster, llm, prompt_ids):
    """cache_salt reaches the workers over HTTP and gRPC Generate (it changes which cached KV a
    request may share, never its tokens); a salt over 256 characters is HTTP 400 /
    INVALID_ARGUMENT naming cache_salt, and nothing leaks."""
    salted = GREEDY.replace(cache_salt="tenant-a")
    expected = offline(llm, prompt_ids[:2], salted)
    assert [[r[0]] for r in through_router(cluster, "grpc", prompt_ids[:2], salted)] == expected
    ids, _ = _http_completion(router(cluster, "nixl"), prompt_ids[1], False, cache_salt="tenant-b")
    assert ids == expected[1][0][0]

    with pytest.raises(urllib.error.HTTPError) as http_error:
        _http_completion(router(cluster, "nixl"), prompt_ids[0], False, cache_salt="s" * 257)
    assert http_error.value.code == 400
    assert json.loads(http_error.value.read())["error"]["param"] == "cache_salt"
    with pytest.raises(grpc.aio.AioRpcError) as grpc_error:
        through_router(cluster, "grpc", prompt_ids[:1], GREEDY.replace(cache_salt="s" * 257))
    assert grpc_error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt" in grpc_error.value.details()
    assert_no_leaks(cluster)


def test_seeded_sampling_and_n_match_offline(cluster, llm, prompt_ids):
    """The sampler reseeds per output position: the first token sampled on the prefill
    worker and the rest on the decode worker give the offline engine's tokens; sample i of
    n=2 is seeded seed + i there as here."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=8, n=2)
    expected = offline(llm, prompt_ids[:2], params)
    results = through_router(cluster, "nixl", prompt_ids[:2], params)
    assert [[r[0], r[1]] for r in results] == expected
    assert_no_leaks(cluster)


def test_first_token_can_finish_the_request_and_carries_logprobs(cluster, llm, prompt_ids):
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2, prompt_logprobs=1)
    expected = llm.generate([prompt_ids[0]], one)[0]

    async def scenario():
        backend = backend_for(cluster, "grpc")
        await backend.start()
        try:
            return [e async for e in backend.generate("one", prompt_ids[0], one)]
        finally:
            await backend.close()

    events = asyncio.run(scenario())
    assert len(events) == 1 and events[0].finish_reason == "length"
    assert events[0].token_ids == expected.token_ids
    (got,), (want,) = events[0].logprobs, expected.outputs[0].logprobs
    assert (got.token_id, got.rank) == (want.token_id, want.rank)
    assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
    assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert len(events[0].prompt_logprobs) == len(prompt_ids[0])
    assert events[0].prompt_logprobs[0] is None
    assert_no_leaks(cluster)


def test_sixteen_concurrent_requests_on_two_by_two(cluster, llm, prompt_ids):
    prompts = [prompt_ids[i % 3] + [1000 + i] for i in range(16)]  # short, all different
    expected = offline(llm, prompts, GREEDY)
    started = time.monotonic()
    results = through_router(cluster, "nixl", prompts, GREEDY)
    print(f"16 requests x 8 tokens through 2 prefill + 2 decode: "
          f"{time.monotonic() - started:.1f} s")
    assert [[r[0]] for r in results] == expected
    assert_no_leaks(cluster)


@pytest.mark.parametrize("when", ["during_prefill", "during_decode"])
def test_cancelling_a_stream_frees_blocks_on_both_workers(cluster, prompt_ids, when):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def scenario():
        async with grpc.aio.insecure_channel(router(cluster, "nixl").address) as channel:
            call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(
                generate_pb2.GenerateRequest(prompt_token_ids=generate_pb2.TokenIds(ids=prompt_ids[3]),
                                             sampling_params=params_to_proto(params)), timeout=60)
            if when == "during_decode":
                for _ in range(3):
                    await call.read()
            else:
                await asyncio.sleep(0.3)  # the Prefill call is running (long prompt, chunked)
            call.cancel()

    asyncio.run(scenario())
    assert_no_leaks(cluster, timeout_s=2.0)


def test_transfer_failure_frees_blocks_and_reports(cluster, prompt_ids):
    """The decode side drops the reservation mid-prefill: later gRPC pushes are refused, the
    Prefill call fails with the cause, and neither worker keeps a block."""
    prefill, decode = prefills(cluster)[0], decodes(cluster)[0]
    prompt = prompt_ids[3] * 2  # ~300 tokens: five 64-token chunks
    request = worker_pb2.PrefillRequest(
        request_id="doomed", prompt_token_ids=prompt,
        sampling_params=params_to_proto(SamplingParams(temperature=0.0, max_tokens=4)),
        decode=worker_pb2.DecodeTarget(address=decode.address),
        transfer_method=worker_pb2.KV_TRANSFER_METHOD_GRPC)

    async def scenario():
        async with grpc.aio.insecure_channel(prefill.address) as p, \
                grpc.aio.insecure_channel(decode.address) as d:
            call = worker_pb2_grpc.PrefillServiceStub(p).Prefill(request, timeout=60)
            first = await call.read()
            assert first.WhichOneof("event") == "reservation"
            released = await worker_pb2_grpc.DecodeServiceStub(d).ReleaseBlocks(
                worker_pb2.ReleaseBlocksRequest(reservation_id=first.reservation.reservation_id),
                timeout=5)
            assert released.num_blocks_freed == len(first.reservation.block_ids)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await call.read() is not grpc.aio.EOF:
                    pass
            return err.value

    error = asyncio.run(scenario())
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert "KV transfer to decode worker" in error.details()
    assert "no live reservation 'doomed'" in error.details()
    assert_no_leaks(cluster)


def test_incompatible_decode_peer_is_a_clear_error(cluster, prompt_ids):
    """A KVTransferService whose cache differs (model name, block size): FAILED_PRECONDITION
    naming the fields, before any block is reserved or computed."""
    import torch

    prefill = prefills(cluster)[0]
    error = prefill_into_receiver(prefill.address, "mismatch", prompt_ids[0], "another-model",
                                  torch.zeros(4, 30, 2, 32, 3, 64))
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "model_name: receiver='another-model' sender='SmolLM2" in error.details()
    assert "block_size: receiver=32 sender=16" in error.details()
    assert_no_leaks(cluster)


def test_unclaimed_or_abandoned_reservations_are_released_after_their_lease(cluster, prompt_ids):
    """'never-claimed' gets no Decode call; 'bad-claim' gets one with a bad first token, which
    fails while (as far as the decode worker knows) KV may still arrive. The lease frees both."""
    decode, prompt = decodes(cluster)[0], prompt_ids[3]

    def reserve(request_id):
        return worker_pb2.ReserveBlocksRequest(request_id=request_id, prompt_token_ids=prompt,
                                               sampling_params=params_to_proto(GREEDY))

    def decode_request(request_id, first_token):
        return worker_pb2.DecodeRequest(request_id=request_id, reservation_id=request_id,
                                        first_token_id=first_token)

    with grpc.insecure_channel(decode.address) as channel:
        stub = worker_pb2_grpc.DecodeServiceStub(channel)
        replies = [stub.ReserveBlocks(reserve(r), timeout=5) for r in ("never-claimed", "bad-claim")]
        assert [r.reservation.lease_ms for r in replies] == [LEASE_MS, LEASE_MS]
        stats = decode.stats()
        # Both tables start with the prompt's blocks cached by earlier tests (shared, held
        # once each); the rest of each is its own.
        held = {b for r in replies for b in r.reservation.block_ids}
        assert stats.num_free_blocks == stats.num_total_blocks - len(held)
        with pytest.raises(grpc.RpcError) as err:
            stub.ReserveBlocks(reserve("never-claimed"), timeout=5)
        assert err.value.code() is grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Decode(decode_request("bad-claim", 10**6), timeout=5))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "first_token_id must be in [0, 49152), got 1000000" in err.value.details()
        time.sleep(LEASE_MS / 1000)
        assert_no_leaks(cluster, timeout_s=2.0)
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Decode(decode_request("never-claimed", 1), timeout=5))
        assert err.value.code() is grpc.StatusCode.NOT_FOUND


def test_a_release_that_overtakes_its_reserve_call_refuses_that_call_only(cluster, prompt_ids):
    """A prefill worker's ReserveBlocks call was cancelled unanswered and its ReleaseBlocks
    (naming that call's attempt) is served first, as gRPC may order them: the late
    ReserveBlocks reserves nothing; a retry of the same request (another attempt) reserves."""
    decode, prompt = decodes(cluster)[0], prompt_ids[2]

    def reserve(attempt_id):
        return worker_pb2.ReserveBlocksRequest(request_id="overtaken", prompt_token_ids=prompt,
                                               sampling_params=params_to_proto(GREEDY),
                                               attempt_id=attempt_id)

    def release(attempt_id):
        return worker_pb2.ReleaseBlocksRequest(reservation_id="overtaken", attempt_id=attempt_id)

    with grpc.insecure_channel(decode.address) as channel:
        stub = worker_pb2_grpc.DecodeServiceStub(channel)
        assert stub.ReleaseBlocks(release("attempt-1"), timeout=5).num_blocks_freed == 0
        with pytest.raises(grpc.RpcError) as err:
            stub.ReserveBlocks(reserve("attempt-1"), timeout=5)
        assert err.value.code() is grpc.StatusCode.CANCELLED
        assert "'overtaken' (attempt 'attempt-1') was released before it was served" in err.value.details()
        assert_no_leaks(cluster)
        reply = stub.ReserveBlocks(reserve("attempt-2"), timeout=5)
        stats = decode.stats()
        assert stats.num_free_blocks < stats.num_total_blocks
        freed = stub.ReleaseBlocks(release("attempt-2"), timeout=5).num_blocks_freed
        assert freed == len(reply.reservation.block_ids) > 0
    assert_no_leaks(cluster)


def test_every_process_froze_its_start_heap_out_of_garbage_collection(cluster):
    """engine/heap.py: a full collection would walk the model, tokenizer and modules of each
    worker and router (~100 ms on 2 vCPUs) in the middle of serving."""
    for process in cluster:
        lines = [line for line in process.log_path.read_text(errors="replace").splitlines()
                 if "objects frozen out of garbage collection" in line]
        assert len(lines) == 1, f"{process.log_path.name}: {lines}"
        assert int(lines[0].split(": ")[-1].split()[0]) > 10_000, lines[0]


def _fill_decode_workers(cluster) -> list[tuple[object, str]]:
    """Reserve all but 6 KV blocks of every decode worker; (worker, reservation id) each."""
    fillers = []
    for i, decode in enumerate(decodes(cluster)):
        with grpc.insecure_channel(decode.address) as channel:
            reply = worker_pb2_grpc.DecodeServiceStub(channel).ReserveBlocks(
                worker_pb2.ReserveBlocksRequest(request_id=f"filler-{i}", prompt_token_ids=[1] * 1440,
                                                sampling_params=params_to_proto(GREEDY)), timeout=5)
        fillers.append((decode, reply.reservation.reservation_id))
    return fillers


def _release(fillers: list[tuple[object, str]]) -> None:
    for decode, reservation_id in fillers:
        with grpc.insecure_channel(decode.address) as channel:
            worker_pb2_grpc.DecodeServiceStub(channel).ReleaseBlocks(
                worker_pb2.ReleaseBlocksRequest(reservation_id=reservation_id), timeout=5)


def test_full_decode_workers_mean_overloaded_and_nothing_leaks(cluster, prompt_ids):
    """Both decode workers answer RESOURCE_EXHAUSTED for lack of KV blocks: with no wait the
    backend tries each, then raises Overloaded at once; with a short wait it retries until the
    wait is spent, then raises the same. The prefill worker computed nothing and holds nothing."""
    from services.router.errors import Overloaded

    fillers = _fill_decode_workers(cluster)

    async def scenario():
        for wait_s in (0.0, 0.6):
            backend = backend_for(cluster, "nixl", kv_full_wait_s=wait_s)
            await backend.start()
            started = time.monotonic()
            try:
                with pytest.raises(Overloaded, match="every decode worker is full: .* has 6 free KV "
                                                     "blocks; a .*-token prompt needs 8"):
                    await collect(backend, f"too-big-{wait_s}", prompt_ids[3], GREEDY)
            finally:
                await backend.close()
            waited = time.monotonic() - started
            if wait_s == 0:
                assert backend.num_kv_full_waits == 0
            else:
                assert backend.num_kv_full_waits >= 2 and waited >= 0.3, (backend.num_kv_full_waits, waited)

    try:
        asyncio.run(scenario())
    finally:
        _release(fillers)
    assert_no_leaks(cluster)


def test_a_request_waits_for_decode_kv_blocks_to_free_up(cluster, llm, prompt_ids):
    """Every decode worker is out of KV blocks when the request arrives; they free up 1 s later
    (running requests finishing): the request waits instead of failing, then streams the
    offline greedy tokens, and nothing leaks."""
    fillers = _fill_decode_workers(cluster)

    async def scenario():
        backend = backend_for(cluster, "nixl")
        await backend.start()
        try:
            request = asyncio.ensure_future(collect(backend, "waits", prompt_ids[3], GREEDY))
            await asyncio.sleep(1.0)
            assert not request.done() and backend.num_kv_full_waits >= 1
            await asyncio.to_thread(_release, fillers)
            return await request
        finally:
            await backend.close()

    try:
        samples = asyncio.run(scenario())
    except BaseException:
        _release(fillers)
        raise
    assert [samples[0]] == offline(llm, [prompt_ids[3]], GREEDY)[0]
    assert_no_leaks(cluster)


BLOCK_SIZE = 16
BLOCK_BYTES = 30 * 2 * BLOCK_SIZE * 3 * 64 * 4  # SmolLM2-135M fp32: layers x K/V x tokens x heads x dim


@pytest.mark.parametrize("transfer", ["grpc", "nixl"])
def test_delta_transfer_sends_only_the_blocks_the_decode_worker_lacks(cluster, llm, transfer):
    """A second prompt sharing a long prefix with the first, on the same pair of workers: the
    decode worker reuses the prefix blocks it cached, the prefill worker sends only the rest,
    and the bytes moved are exactly (prompt blocks - cached blocks) x block bytes."""
    prefill, decode = prefills(cluster)[0], decodes(cluster)[0]
    shared = llm.tokenizer.encode(f"[{transfer}] " + " ".join(
        f"Step {i}: stir the pot and taste the soup." for i in range(9)))
    assert len(shared) >= 6 * BLOCK_SIZE
    first, second = shared + llm.tokenizer.encode(" Then"), shared + llm.tokenizer.encode(" Finally, serve it.")
    expected = offline(llm, [first, second], GREEDY)

    async def run_one(prompt):
        backend = DisaggregatedBackend([prefill.address], [decode.address], transfer, poll_interval_s=0.2)
        await backend.start()
        try:
            return await collect(backend, f"delta-{transfer}-{len(prompt)}", prompt, GREEDY)
        finally:
            await backend.close()

    got, counted = [], []
    for prompt in (first, second):
        before = prefill.stats().kv_transfer, decode.stats().kv_transfer
        got.append([asyncio.run(run_one(prompt))[0]])
        after = prefill.stats().kv_transfer, decode.stats().kv_transfer
        counted.append(tuple(getattr(a, f) - getattr(b, f) for a, b in zip(after, before)
                             for f in ("num_blocks_sent", "num_bytes_sent", "num_blocks_skipped_cached")))
    assert got == expected
    num_blocks = [-(-len(p) // BLOCK_SIZE) for p in (first, second)]
    # The shared full blocks, cached by the decode worker from the first request.
    num_cached = min(len(shared) // BLOCK_SIZE, (len(second) - 1) // BLOCK_SIZE)
    # (prefill: sent, bytes, skipped; decode: -, -, skipped) for each request
    assert counted[0] == (num_blocks[0], num_blocks[0] * BLOCK_BYTES, 0, 0, 0, 0)
    assert counted[1] == (num_blocks[1] - num_cached, (num_blocks[1] - num_cached) * BLOCK_BYTES,
                          num_cached, 0, 0, num_cached)
    assert_no_leaks(cluster)


def test_bad_input_is_a_value_error(cluster):
    async def scenario():
        backend = backend_for(cluster, "nixl")
        await backend.start()
        try:
            with pytest.raises(ValueError, match="out of vocabulary"):
                await collect(backend, "bad", [1, 10**6], GREEDY)
        finally:
            await backend.close()

    asyncio.run(scenario())
    assert_no_leaks(cluster)


def test_killing_a_decode_worker_mid_stream_migrates_its_request(cluster, llm, prompt_ids):
    """Runs last: it leaves the cluster with one decode worker. The killed worker's stream goes
    on, unbroken, on the other decode worker (services/router/backends/migration.py): the client gets
    exactly the offline greedy tokens, and later requests succeed."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = offline(llm, prompt_ids[:2], GREEDY)
    (whole,) = offline(llm, [prompt_ids[2]], params)

    async def scenario():
        async with grpc.aio.insecure_channel(router(cluster, "nixl").address) as channel:
            call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(
                generate_pb2.GenerateRequest(prompt_token_ids=generate_pb2.TokenIds(ids=prompt_ids[2]),
                                             sampling_params=params_to_proto(params)), timeout=60)
            streamed = []
            for _ in range(3):
                streamed += (await call.read()).token_ids
            busy = [w for w in decodes(cluster) if w.stats().num_running_requests > 0]
            assert len(busy) == 1
            busy[0].stop(signal.SIGKILL)
            finish = None
            while (chunk := await call.read()) is not grpc.aio.EOF:
                streamed += chunk.token_ids
                finish = finish_from_proto(chunk.finish_reason)
            after = [await generate(channel, ids, GREEDY) for ids in prompt_ids[:2]]
            return (streamed, finish), after, busy[0]

    migrated, after, killed = asyncio.run(scenario())
    assert [migrated] == whole
    assert [[r[0]] for r in after] == expected
    assert killed.proc.returncode == -signal.SIGKILL
    assert "migrating" in router(cluster, "nixl").log_path.read_text()
    assert_no_leaks(cluster)
