"""The router's request pipeline (services/router/pipeline/frontend.py) and its HTTP error paths over a
scripted backend.

One token per character (id = index in ALPHABET) keeps stop-string positions obvious. The
fake backend records whether its iterator was closed before its last event was read, which is
how the frontend aborts a request. (Once every sample has finished the frontend closes the
iterator without waiting for it to end: a backend must treat that close as a no-op.)
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine.sampling_params import SamplingParams
from services.router.backends.backend import Backend, TokenEvent
from services.router.errors import BackendError, InvalidRequest, Overloaded, Unavailable
from services.router.http.server import build_app
from services.router.model_info import ModelInfo
from services.router.pipeline.frontend import Frontend, RouterState

ALPHABET = "abcdefghijklmnopqrstuvwxyz .!"
EOS = len(ALPHABET)  # decodes to nothing


def ids(text: str) -> list[int]:
    return [ALPHABET.index(c) for c in text]


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return ids(text)

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[t] for t in token_ids if t < len(ALPHABET))


class ScriptedBackend(Backend):
    def __init__(self, events: list[TokenEvent], error: Exception | None = None,
                 then_raise: Exception | None = None) -> None:
        self.events = events
        self.error = error  # raised before any event
        self.then_raise = then_raise  # raised after the events
        self.num_sent = 0
        self.is_closed = False

    @property
    def was_aborted(self) -> bool:
        """Closed before every scripted event was read."""
        return self.is_closed and self.num_sent < len(self.events)

    async def generate(self, request_id, prompt_token_ids, params):
        if self.error is not None:
            raise self.error
        try:
            for event in self.events:
                self.num_sent += 1
                yield event
            if self.then_raise is not None:
                raise self.then_raise
        finally:
            self.is_closed = True

    async def is_healthy(self) -> bool:
        return True


def run(events, params, prompt="ab", error=None):
    backend = ScriptedBackend(events, error)
    frontend = Frontend(CharTokenizer(), backend, ModelInfo("m", len(ALPHABET) + 1, 64))

    async def collect():
        prompt_ids = frontend.tokenize(prompt=prompt)
        async with frontend.generate(prompt_ids, frontend.check(prompt_ids, params)) as generation:
            return [delta async for delta in generation], generation

    deltas, generation = asyncio.run(collect())
    return deltas, generation, backend


def test_stop_string_mid_event_cuts_text_drops_later_tokens_and_aborts():
    events = [TokenEvent(0, ids("hel")), TokenEvent(0, ids("lo wor")),
              TokenEvent(0, ids("ld"), finish_reason="length")]
    deltas, generation, backend = run(events, SamplingParams(stop=["o w"], max_tokens=20))
    assert "".join(d.text for d in deltas) == "hell"
    assert all("o" not in d.text for d in deltas)  # held back until the match was decided
    last = deltas[-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", "o w")
    assert [t for d in deltas for t in d.token_ids] == ids("hello w")  # up to the matching token
    assert generation.usage.completion_tokens == 7 and generation.usage.prompt_tokens == 2
    assert backend.num_sent == 2 and backend.was_aborted


def test_include_stop_str_in_output():
    events = [TokenEvent(0, ids("go. now"), finish_reason="length")]
    deltas, _, _ = run(events, SamplingParams(stop=["."], include_stop_str_in_output=True))
    assert "".join(d.text for d in deltas) == "go."


def test_eos_is_counted_but_not_decoded():
    events = [TokenEvent(0, ids("hi")), TokenEvent(0, [EOS], finish_reason="stop", num_cached_tokens=16)]
    deltas, generation, backend = run(events, SamplingParams())
    assert "".join(d.text for d in deltas) == "hi"
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", None)
    assert generation.usage.completion_tokens == 3 and generation.usage.cached_tokens == 16
    assert backend.is_closed and not backend.was_aborted and generation.is_finished


def test_stop_token_id_is_the_stop_reason():
    events = [TokenEvent(0, ids("ok!"), finish_reason="stop", stop_token_id=ids("!")[0])]
    deltas, _, _ = run(events, SamplingParams(stop_token_ids=ids("!")))
    assert "".join(d.text for d in deltas) == "ok"
    assert deltas[-1].stop_reason == ids("!")[0]


def test_parallel_samples_stop_independently():
    events = [TokenEvent(0, ids("ab")), TokenEvent(1, ids("cd")),
              TokenEvent(0, ids("x")),  # sample 0 hits the stop string "x"
              TokenEvent(0, ids("yy")),  # still generated by the backend: dropped
              TokenEvent(1, ids("ef"), finish_reason="length"),
              TokenEvent(0, ids("zz"))]  # never read: the request is aborted
    deltas, generation, backend = run(events, SamplingParams(n=2, stop=["x"], max_tokens=9))
    text = {i: "".join(d.text for d in deltas if d.index == i) for i in (0, 1)}
    assert text == {0: "ab", 1: "cdef"}
    assert generation.usage.completion_tokens == 3 + 4
    assert backend.num_sent == 5 and backend.was_aborted


def test_backend_failures_become_backend_errors():
    with pytest.raises(BackendError, match="error"):
        run([TokenEvent(0, ids("a")), TokenEvent(0, [], finish_reason="error")], SamplingParams())
    with pytest.raises(BackendError, match="ended before"):
        run([TokenEvent(0, ids("a"))], SamplingParams())
    with pytest.raises(ValueError, match="too big"):  # surfaces from start(), before any event
        run([], SamplingParams(), error=ValueError("too big"))


def test_check_names_the_problem():
    frontend = Frontend(CharTokenizer(), ScriptedBackend([]), ModelInfo("m", 30, 8))
    with pytest.raises(InvalidRequest) as info:
        frontend.check(ids("abcdefgh"), SamplingParams())
    assert info.value.message == ("This model's maximum context length is 8 tokens. However, your "
                                  "request has 8 input tokens. Please reduce the length of the "
                                  "input messages.")
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "prompt")
    with pytest.raises(InvalidRequest) as info:  # OpenAI's wording, word for word
        frontend.check(ids("abc"), SamplingParams(max_tokens=6), "messages")
    assert info.value.message == ("This model's maximum context length is 8 tokens. However, you "
                                  "requested 9 tokens (3 in the messages, 6 in the completion). "
                                  "Please reduce the length of the messages or completion.")
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "messages")
    with pytest.raises(InvalidRequest) as info:
        frontend.check(ids("abc"), SamplingParams(top_p=2.0, max_tokens=1))
    assert info.value.param == "top_p"
    with pytest.raises(InvalidRequest, match=r"\[0, 30\)") as info:
        frontend.tokenize(prompt=[1, 30])
    assert info.value.param == "prompt"


def http_scenario(backend: Backend, requests: list[tuple[str, str, dict | None]], ready: bool = True):
    """Send ``(method, path, body)`` requests to the HTTP app over loopback; returns (status,
    body text) per request."""
    state = RouterState(backend)
    if ready:
        state.frontend = Frontend(CharTokenizer(), backend, ModelInfo("m", len(ALPHABET) + 1, 64))

    async def scenario():
        async with TestClient(TestServer(build_app(state), host="127.0.0.1")) as client:
            replies = []
            for method, path, body in requests:
                response = await client.request(method, path, json=body)
                replies.append((response.status, await response.text()))
            return replies

    return asyncio.run(scenario())


def sse_events(text: str) -> list:
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def test_http_full_is_429_unavailable_is_503_and_backend_failure_is_500():
    """Full (every worker at its limit) is 429 with Retry-After; no healthy worker is 503."""
    body = {"prompt": "ab", "max_tokens": 4}
    [(status, text)] = http_scenario(ScriptedBackend([], error=Overloaded("all full", 2.2)),
                                     [("POST", "/v1/completions", body)])
    assert status == 429 and json.loads(text)["error"]["message"] == "all full"
    assert json.loads(text)["error"]["code"] == "rate_limit_exceeded"
    [(status, text)] = http_scenario(ScriptedBackend([], error=Unavailable("no healthy decode worker")),
                                     [("POST", "/v1/completions", body)])
    assert status == 503 and json.loads(text)["error"]["message"] == "no healthy decode worker"
    [(status, text)] = http_scenario(ScriptedBackend([], error=BackendError("worker died")),
                                     [("POST", "/v1/completions", body)])
    assert status == 500 and json.loads(text)["error"]["type"] == "internal_server_error"


def test_http_failure_mid_stream_sends_an_error_event_then_done():
    backend = ScriptedBackend([TokenEvent(0, ids("hi"))], then_raise=BackendError("decode worker died"))
    [(status, text)] = http_scenario(backend, [("POST", "/v1/completions",
                                                {"prompt": "ab", "max_tokens": 4, "stream": True})])
    events = sse_events(text)
    assert status == 200 and events[0]["choices"][0]["text"] == "hi"
    assert "decode worker died" in events[1]["error"]["message"] and events[2:] == ["[DONE]"]


def test_http_health_follows_readiness():
    assert http_scenario(ScriptedBackend([]), [("GET", "/health", None)], ready=False)[0][0] == 503
    assert http_scenario(ScriptedBackend([]), [("GET", "/health", None)])[0][0] == 200
    [(status, text)] = http_scenario(ScriptedBackend([]), [("POST", "/v1/completions", {"prompt": "a"})],
                                     ready=False)
    assert status == 503 and "not serving" in json.loads(text)["error"]["message"]


def test_http_unknown_model_is_404_model_not_found_and_unknown_role_is_400():
    """OpenAI (and vLLM) answer an unknown model 404 ``model_not_found``: the official client
    raises ``openai.NotFoundError`` for a 404. A chat role outside OpenAI's set is bad input
    naming the message (it used to be rendered into the prompt and answered 200)."""
    backend = ScriptedBackend([TokenEvent(0, ids("ok"), finish_reason="length")])
    replies = http_scenario(backend, [
        ("POST", "/v1/completions", {"prompt": "ab", "model": "gpt-9"}),
        ("POST", "/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "a"}]}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"},
                                                       {"role": "wizard", "content": "b"}]}),
        ("POST", "/v1/completions", {"prompt": "ab", "model": "m", "max_tokens": 2}),
    ])
    for status, text in replies[:2]:
        error = json.loads(text)["error"]
        assert status == 404, text
        assert (error["code"], error["param"], error["type"]) == (
            "model_not_found", "model", "invalid_request_error")
        assert error["message"] == "model 'gpt-9' does not exist; this server serves 'm'"
    status, text = replies[2]
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "messages", text
    assert error["message"].startswith("messages[1].role must be one of system, developer, user, "
                                       "assistant, tool, function; got 'wizard'")
    assert replies[3][0] == 200  # the served model by name is fine
    assert backend.num_sent == 1  # nothing refused reached the backend


def test_grpc_unknown_model_is_not_found_and_unknown_role_is_invalid_argument():
    import grpc

    from services.common.grpc_server import start_grpc_server
    from services.common.pb import generate_pb2, generate_pb2_grpc
    from services.router.grpc.servicer import GenerateServicer, add_generate_servicer

    backend = ScriptedBackend([])
    state = RouterState(backend)
    state.frontend = Frontend(CharTokenizer(), backend, ModelInfo("m", len(ALPHABET) + 1, 64))
    wizard = generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="wizard", content="a")])

    async def scenario():
        server = await start_grpc_server([(add_generate_servicer, GenerateServicer(state))])
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = generate_pb2_grpc.GenerateServiceStub(channel)
                errors = []
                for request in (generate_pb2.GenerateRequest(prompt="ab", model="gpt-9"),
                                generate_pb2.GenerateRequest(chat=wizard)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await stub.Generate(request, timeout=5).read()
                    errors.append(info.value)
                return errors
        finally:
            await server.server.stop(None)

    not_found, bad_role = asyncio.run(scenario())
    assert not_found.code() == grpc.StatusCode.NOT_FOUND and "'gpt-9' does not exist" in not_found.details()
    assert bad_role.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages[0].role" in bad_role.details()
    assert dict(bad_role.trailing_metadata())["pdserve-invalid-param"] == "messages"
    assert backend.num_sent == 0
