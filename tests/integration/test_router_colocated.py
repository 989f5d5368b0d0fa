"""The router in colocated mode, as a real process: OpenAI HTTP and gRPC against the offline engine.

One router (`pdserve serve router --colocated`, small KV cache, ports chosen by the OS) serves
the whole module; requests go over loopback. Greedy and seeded outputs must equal
``engine.LLM`` on the same model token for token; every bad request gets a 400 /
INVALID_ARGUMENT that names the problem; a client that leaves mid-stream frees its blocks
(read through the router's WorkerService.GetStats).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling_params import SamplingParams
from services.common.pb import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration import structured_checks, tool_checks
from tests.integration.cluster_fixtures import oracle_llm

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 256
READY = re.compile(r"router ready http=(\S+) grpc=(\S+) model=(\S+)")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was"]
CHAT = [{"role": "user", "content": "Name three colors."}]
# Two processes (router, offline oracle) share the cores: OpenMP threads that spin against
# each other make every step many times slower, so each gets one.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass
class RouterProcess:
    http: str
    grpc: str
    model: str
    channel: grpc.Channel


def running_router(log_dir: Path, *flags: str) -> Iterator[RouterProcess]:
    """Body of a module fixture: ``pdserve serve router --colocated`` with ``flags``, once ready;
    at the end SIGTERM, and it must drain and exit 0."""
    log_path = log_dir / "router.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), **ONE_THREAD}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", "router", "--colocated",
             "--http-port", "0", "--grpc-port", "0", "--kv-cache-memory", str(48_000_000),
             "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", *flags],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not (match := READY.search(log_path.read_text())):
            assert proc.poll() is None, f"router exited:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"router not ready:\n{log_path.read_text()}"
            time.sleep(0.2)
        with grpc.insecure_channel(match[2]) as channel:
            yield RouterProcess(match[1], match[2], match[3], channel)
        proc.send_signal(signal.SIGTERM)  # drains, then exits cleanly
        assert proc.wait(timeout=30) == 0, log_path.read_text()
        assert "router stopped" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    yield from running_router(tmp_path_factory.mktemp("router"))


@pytest.fixture(scope="module")
def llm(loaded_model):
    """The offline oracle on one thread (it shares the cores with the router)."""
    yield from oracle_llm(loaded_model, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)


def offline(llm, prompt, **params):
    """The offline engine's result for one prompt (text or token ids), alone in its batch."""
    return llm.generate(prompt, SamplingParams(**params))[0]


# ---- HTTP helpers ------------------------------------------------------------------------

def _connect(address: str) -> http.client.HTTPConnection:
    host, port = address.rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=60)


def post(router, path: str, body) -> tuple[int, dict]:
    conn = _connect(router.http)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = json.loads(response.read())
    conn.close()
    return response.status, payload


def get(router, path: str) -> tuple[int, dict]:
    conn = _connect(router.http)
    conn.request("GET", path)
    response = conn.getresponse()
    payload = json.loads(response.read())
    conn.close()
    return response.status, payload


def stream(router, path: str, body: dict) -> list:
    """The SSE events of one streamed request: parsed JSON chunks, then "[DONE]"."""
    conn = _connect(router.http)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode(),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    events = []
    for line in response:
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip().decode()
            events.append(data if data == "[DONE]" else json.loads(data))
    conn.close()
    return events


def streamed_text(events, index=0, key="text") -> str:
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    if key == "text":
        return "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == index)
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                   if c["choices"][0]["index"] == index)


# ---- gRPC helpers ------------------------------------------------------------------------

def grpc_generate(router, timeout=60, **fields) -> list[generate_pb2.GenerateResponse]:
    stub = generate_pb2_grpc.GenerateServiceStub(router.channel)
    return list(stub.Generate(generate_pb2.GenerateRequest(**fields), timeout=timeout))


def stats(router) -> worker_pb2.WorkerStats:
    stub = worker_pb2_grpc.WorkerServiceStub(router.channel)
    return stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5)


def wait_until_idle(router, timeout_s=2.0) -> worker_pb2.WorkerStats:
    deadline = time.monotonic() + timeout_s
    while True:
        current = stats(router)
        idle = (current.num_running_requests == 0 and current.num_waiting_requests == 0
                and current.num_free_blocks == current.num_total_blocks)
        if idle or time.monotonic() > deadline:
            return current
        time.sleep(0.05)


# ---- tests -------------------------------------------------------------------------------

def test_health_and_models(router):
    assert get(router, "/health") == (200, {"status": "ok"})
    status, models = get(router, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [router.model]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_http_completions_match_offline_engine(router, llm):
    for prompt in [*PROMPTS[:2], llm.tokenizer.encode(PROMPTS[2])]:
        expected = offline(llm, prompt, temperature=0, max_tokens=12)
        status, body = post(router, "/v1/completions", {
            "model": router.model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "return_token_ids": True})
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["token_ids"] == expected.token_ids
        assert choice["text"] == expected.text
        assert choice["prompt_token_ids"] == expected.prompt_token_ids
        assert choice["finish_reason"] == expected.outputs[0].finish_reason
        assert body["usage"] == {
            "prompt_tokens": len(expected.prompt_token_ids),
            "completion_tokens": len(expected.token_ids),
            "total_tokens": len(expected.prompt_token_ids) + len(expected.token_ids),
            "prompt_tokens_details": {"cached_tokens": 0}}


def test_http_stream_equals_non_stream(router):
    for path, key, body in [
        ("/v1/completions", "text", {"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0}),
        ("/v1/chat/completions", "content", {"messages": CHAT, "max_tokens": 10, "temperature": 0}),
    ]:
        status, whole = post(router, path, body)
        assert status == 200, whole
        events = stream(router, path, {**body, "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]"
        usage_chunk = events[-2]
        assert usage_chunk["choices"] == []
        # Identical prompts: the streamed request may find blocks the first one cached.
        for usage in (usage_chunk["usage"], whole["usage"]):
            usage.pop("prompt_tokens_details")
        assert usage_chunk["usage"] == whole["usage"]
        assert all(e["usage"] is None for e in events[:-2])
        choice = whole["choices"][0]
        text = choice["text"] if key == "text" else choice["message"]["content"]
        assert streamed_text(events, key=key) == text and text
        finishes = [e["choices"][0]["finish_reason"] for e in events[:-2]]
        assert finishes[-1] == choice["finish_reason"] and not any(finishes[:-1])
        if key == "content":
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert events[0]["object"] == "chat.completion.chunk"


def test_chat_matches_offline_and_reports_cached_prompt_tokens(router, llm):
    prompt_ids = llm.tokenizer.encode_chat(CHAT)
    expected = offline(llm, prompt_ids, temperature=0, max_tokens=8)
    bodies = []
    for _ in range(2):  # the second request finds the prompt's full blocks cached
        status, body = post(router, "/v1/chat/completions", {
            "messages": CHAT, "max_completion_tokens": 8, "temperature": 0, "return_token_ids": True})
        assert status == 200, body
        bodies.append(body)
    for body in bodies:
        assert body["choices"][0]["token_ids"] == expected.token_ids
        assert body["choices"][0]["message"] == {"role": "assistant", "content": expected.text}
        assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    cached = bodies[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached <= len(prompt_ids) and cached % 16 == 0


def test_grpc_stream_matches_offline_engine(router, llm):
    for prompt in PROMPTS[:2]:
        expected = offline(llm, prompt, temperature=0, max_tokens=12)
        params = generate_pb2.SamplingParams(temperature=0, max_tokens=12)
        for fields in ({"prompt": prompt},
                       {"prompt_token_ids": generate_pb2.TokenIds(ids=expected.prompt_token_ids)}):
            responses = grpc_generate(router, request_id="mine", sampling_params=params, **fields)
            assert [t for r in responses for t in r.token_ids] == expected.token_ids
            assert "".join(r.text for r in responses) == expected.text
            assert {r.request_id for r in responses} == {"mine"}
            assert [r.HasField("usage") for r in responses] == [False] * (len(responses) - 1) + [True]
            usage = responses[-1].usage
            assert (usage.prompt_tokens, usage.completion_tokens) == (
                len(expected.prompt_token_ids), len(expected.token_ids))
            assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH


def test_grpc_logprobs_and_prompt_logprobs(router):
    responses = grpc_generate(router, prompt=PROMPTS[0], sampling_params=generate_pb2.SamplingParams(
        temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1))
    first = responses[0]
    # One entry per prompt token; position 0 (nothing predicts it) is empty.
    assert len(first.prompt_logprobs) == responses[-1].usage.prompt_tokens
    assert not first.prompt_logprobs[0].HasField("sampled")
    assert all(len(e.top) == 1 for e in first.prompt_logprobs[1:])
    assert not any(r.prompt_logprobs for r in responses[1:])
    entries = [e for r in responses for e in r.logprobs]
    assert [e.sampled.token_id for e in entries] == [t for r in responses for t in r.token_ids]
    assert all(e.sampled.rank == 1 and len(e.top) == 2 and e.top[0].token_id == e.sampled.token_id
               for e in entries)  # greedy picks rank 1


def _stop_spanning_tokens(llm, token_ids: list[int]) -> tuple[str, int]:
    """A stop string that starts inside token 2's text and ends inside token 4's, and where
    the text is cut."""
    ends = [len(llm.tokenizer.decode(token_ids[:i])) for i in range(1, len(token_ids) + 1)]
    text = llm.tokenizer.decode(token_ids)
    start, end = ends[1] - 1, ends[3] - 1
    assert start < end and text.find(text[start:end]) == start
    return text[start:end], start


def test_stop_string_is_never_streamed(router, llm):
    full = offline(llm, PROMPTS[0], temperature=0, max_tokens=16)
    stop, cut = _stop_spanning_tokens(llm, full.token_ids)
    expected = offline(llm, PROMPTS[0], temperature=0, max_tokens=16, stop=[stop])
    assert expected.text == full.text[:cut]

    events = stream(router, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0,
                                                "stop": [stop, "never matches"], "return_token_ids": True})
    chunks = [e["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == expected.text
    assert not any(stop in c["text"] for c in chunks)
    assert (chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == ("stop", stop)
    # Tokens stop at the one that completed the stop string, as the offline engine's do.
    assert [t for c in chunks for t in c["token_ids"]] == expected.token_ids

    responses = grpc_generate(router, prompt=PROMPTS[0], sampling_params=generate_pb2.SamplingParams(
        temperature=0, max_tokens=16, stop=[stop]))
    assert "".join(r.text for r in responses) == expected.text
    assert responses[-1].stop_str == stop and responses[-1].finish_reason == generate_pb2.FINISH_REASON_STOP
    assert responses[-1].usage.completion_tokens == len(expected.token_ids)
    assert wait_until_idle(router).num_running_requests == 0  # the rest was aborted


def test_parallel_samples_with_seed_match_offline(router, llm):
    expected = offline(llm, PROMPTS[1], n=2, seed=1234, temperature=1.0, max_tokens=8)
    body = {"prompt": PROMPTS[1], "n": 2, "seed": 1234, "temperature": 1.0, "max_tokens": 8,
            "return_token_ids": True}
    status, first = post(router, "/v1/completions", body)
    assert status == 200, first
    choices = sorted(first["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == [o.token_ids for o in expected.outputs]
    assert [c["text"] for c in choices] == [o.text for o in expected.outputs]
    assert first["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in expected.outputs)
    assert post(router, "/v1/completions", body)[1]["choices"] == first["choices"]  # reproducible

    events = stream(router, "/v1/completions", body)
    assert [streamed_text(events, i) for i in (0, 1)] == [o.text for o in expected.outputs]


def test_logprobs(router, llm):
    expected = offline(llm, PROMPTS[0], temperature=0, max_tokens=4)
    status, body = post(router, "/v1/completions", {
        "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 1.0, "logprobs": 2, "top_k": 1})
    assert status == 200, body
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [llm.tokenizer.decode([t]) for t in expected.token_ids]
    # top_k=1 leaves one possible token (so sampling is greedy): the runner-up of the processed
    # distribution is -inf, sent as -9999.0.
    for top, token, value in zip(logprobs["top_logprobs"], logprobs["tokens"], logprobs["token_logprobs"]):
        assert value == 0.0 and top[token] == 0.0 and -9999.0 in top.values()

    status, body = post(router, "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 3})
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 3 for c in content)
    assert all(c["token"] == c["top_logprobs"][0]["token"] for c in content)  # greedy = rank 1


BAD_HTTP = [
    ("/v1/completions", b"{not json", None, "not valid JSON"),
    ("/v1/completions", {"max_tokens": 4}, "prompt", "prompt is required"),
    ("/v1/completions", {"prompt": ""}, "prompt", "prompt is empty"),
    ("/v1/completions", {"prompt": []}, "prompt", "prompt is empty"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "temperature", "must be finite"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', "temperature", "must be finite"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature", "must be >= 0"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens", "must be >= 1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, "prompt", "However, you requested"),
    ("/v1/completions", {"prompt": [1] * MAX_MODEL_LEN, "max_tokens": 1}, "prompt", "maximum context length is"),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, "prompt", "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature", "must be a number"),
    ("/v1/completions", {"prompt": "hi", "n": "2"}, "n", "must be an integer"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**6]}, "stop_token_ids", "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs", "must be in [0, 20]"),
    ("/v1/chat/completions", {"messages": []}, "messages", "non-empty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages", "only text parts"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages",
     "messages[0].role must be one of"),
]


def test_bad_http_requests_get_400_and_the_server_keeps_serving(router):
    for path, body, param, words in BAD_HTTP:
        status, reply = post(router, path, body)
        assert status == 400, (body, reply)
        error = reply["error"]
        assert words in error["message"], (body, error)
        assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
    status, reply = post(router, "/v1/completions", {"prompt": "hi", "model": "gpt-9"})
    assert status == 404, reply  # as OpenAI and vLLM answer: the openai client's NotFoundError
    assert reply["error"]["code"] == "model_not_found" and reply["error"]["param"] == "model"
    assert "does not exist" in reply["error"]["message"]
    status, reply = get(router, "/v1/nothing")
    assert status == 404 and "error" in reply
    status, reply = post(router, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2


def test_bad_grpc_requests_get_invalid_argument(router):
    cases = [
        ({}, "prompt, prompt_token_ids or chat"),
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "hi", "sampling_params": generate_pb2.SamplingParams(temperature=float("nan"))},
         "temperature must be finite"),
        ({"prompt": "hi", "sampling_params": generate_pb2.SamplingParams(max_tokens=4_000_000_000)},
         "However, you requested"),
        ({"prompt_token_ids": generate_pb2.TokenIds(ids=[1, 10**6])}, "vocabulary"),
        ({"prompt_token_ids": generate_pb2.TokenIds(ids=[1] * MAX_MODEL_LEN)}, "maximum context length is"),
        ({"chat": generate_pb2.ChatMessages()}, "messages"),
    ]
    for fields, words in cases:
        with pytest.raises(grpc.RpcError) as info:
            grpc_generate(router, **fields)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert words in info.value.details(), (fields, info.value.details())
    with pytest.raises(grpc.RpcError) as info:
        grpc_generate(router, prompt="hi", model="gpt-9")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND  # as generate.proto documents
    responses = grpc_generate(router, prompt="hi", sampling_params=generate_pb2.SamplingParams(max_tokens=2))
    assert responses[-1].usage.completion_tokens == 2


def test_client_disconnect_mid_stream_frees_blocks(router):
    body = {"prompt": PROMPTS[2], "max_tokens": 200, "ignore_eos": True, "stream": True}
    conn = _connect(router.http)
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(6):  # a few chunks (each "data:" line and its blank line)
        response.readline()
    during = stats(router)
    assert during.num_running_requests == 1 and during.num_free_blocks < during.num_total_blocks
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    after = wait_until_idle(router)
    assert (after.num_running_requests, after.num_free_blocks) == (0, after.num_total_blocks)

    stub = generate_pb2_grpc.GenerateServiceStub(router.channel)
    call = stub.Generate(generate_pb2.GenerateRequest(prompt=PROMPTS[2], sampling_params=generate_pb2.SamplingParams(
        max_tokens=200, ignore_eos=True)), timeout=60)
    next(call), next(call)
    assert stats(router).num_running_requests == 1
    call.cancel()
    after = wait_until_idle(router)
    assert (after.num_running_requests, after.num_free_blocks) == (0, after.num_total_blocks)

    with pytest.raises(grpc.RpcError) as info:  # a deadline that expires mid-stream aborts too
        grpc_generate(router, timeout=0.5, prompt=PROMPTS[2],
                      sampling_params=generate_pb2.SamplingParams(max_tokens=200, ignore_eos=True))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    after = wait_until_idle(router)
    assert (after.num_running_requests, after.num_free_blocks) == (0, after.num_total_blocks)


def test_pdserve_generate_cli(router, llm):
    expected = offline(llm, PROMPTS[0], temperature=0, max_tokens=6)
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", PROMPTS[0], "--stream", "--max-tokens", "6",
         "--temperature", "0", "--address", router.grpc],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.text + "\n"
    assert "completion 6 tokens" in result.stderr


def test_metrics_endpoint_exports_frontend_and_engine_names(router):
    status, reply = post(router, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert status == 200
    conn = _connect(router.http)
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/plain")
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert {"dynamo_frontend_requests_total", "dynamo_frontend_time_to_first_token_seconds_count",
            "vllm:num_requests_running", "vllm:generation_tokens_total"} <= names
    running = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:num_requests_running"]
    assert running[0].labels["role"] == "colocated" and running[0].value == 0


# ---- structured outputs (tests/integration/structured_checks.py; the 1P1D cluster runs them too) --

def test_structured_greedy_output_matches_the_offline_engine(router, llm):
    structured_checks.greedy_matches_the_offline_engine(structured_checks.client(router.http), router.model, llm)


def test_every_schema_validates_and_greedy_equals_the_offline_engine(router, llm):
    structured_checks.every_schema_validates(structured_checks.client(router.http), router.model, llm)


@pytest.fixture(scope="module")
def router_ngram(tmp_path_factory):
    """A second colocated router, speculating with n-grams (the other one does not)."""
    yield from running_router(tmp_path_factory.mktemp("router-ngram"), "--spec-method", "ngram", "--spec-k", "3")


def test_every_schema_under_ngram_speculation_equals_the_offline_engine(router_ngram, llm):
    """Speculation on, colocated: every reply valid, greedy token for token the offline engine's
    without speculation (the disaggregated side: test_bad_input_matrix, test_cluster)."""
    structured_checks.every_schema_validates(structured_checks.client(router_ngram.http), router_ngram.model, llm)


def test_structured_outputs_validate_streamed_and_sampled(router):
    api = structured_checks.client(router.http)
    structured_checks.sampled_and_streamed_output_validates(api, router.model)
    structured_checks.json_object_regex_and_choice(api, router.model)
    structured_checks.grpc_regex(router.channel)
    assert wait_until_idle(router).num_free_blocks == stats(router).num_total_blocks


def test_bad_constraints_get_400_naming_the_field(router):
    structured_checks.bad_constraints_get_400_and_the_server_keeps_serving(
        structured_checks.client(router.http), router.model)
    assert wait_until_idle(router).num_free_blocks == stats(router).num_total_blocks


# ---- tool calling (tests/integration/tool_checks.py; the 1P1D cluster runs them too) --------------

def test_tool_calls_validate_and_a_result_round_trips(router):
    api = structured_checks.client(router.http)
    tool_checks.required_and_named_calls_validate(api, router.model)
    tool_checks.auto_round_trips_a_tool_result(api, router.model)
    tool_checks.bad_tools_get_400_and_the_server_keeps_serving(api, router.model)
    assert wait_until_idle(router).num_free_blocks == stats(router).num_total_blocks
