"""``pdserve generate``: one request to a router over gRPC streaming.

    pdserve generate "The capital of France is" --stream --max-tokens 32
    pdserve generate "Say hi" --chat --temperature 0.7 --seed 1 --address 127.0.0.1:50051
    pdserve generate "Phone:" --regex '[0-9]{3}-[0-9]{4}'    # or --json-schema '{...}', --json-object,
                                                             # --choice yes --choice no, --grammar
    PDSERVE_API_KEY=sk-... pdserve generate "Hello"   # a router with API keys (or --api-key)

Prints the completion (as it arrives with ``--stream``); the token counts go to stderr, and with
``--timings`` the request's route and TTFT breakdown by stage (a router started with
``--debug-route`` answers them in trailing metadata). Exits 1 with the server's status and
message when the request fails.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from services.common.channels import public_channel
from services.common.pb import generate_pb2, generate_pb2_grpc
from services.common.settings import add_env_argument
from services.router.pipeline.debug_route import ROUTE_HEADER, TTFT_HEADER, describe, parse_breakdown


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve generate", description=__doc__.split("\n")[0])
    parser.add_argument("prompt", help="the prompt text (a user message with --chat)")
    add_env_argument(parser, "--address", default="127.0.0.1:50051", help="router gRPC HOST:PORT")
    add_env_argument(parser, "--stream", action="store_true", help="print text as it arrives")
    add_env_argument(parser, "--chat", action="store_true",
                     help="send the prompt as a user message through the chat template")
    add_env_argument(parser, "--max-tokens", type=int, default=None,
                     help="most tokens to generate (default: until the context is full)")
    add_env_argument(parser, "--temperature", type=float, default=None, help="0 is greedy (default 1)")
    add_env_argument(parser, "--seed", type=int, default=None, help="request-local sampling seed")
    add_env_argument(parser, "--timeout", type=float, default=300.0, help="deadline in seconds")
    add_env_argument(parser, "--timings", action="store_true",
                     help="print the route and TTFT breakdown by stage to stderr (the router "
                          "must run with --debug-route)")
    constraint = parser.add_mutually_exclusive_group()  # structured outputs: one constraint at most
    constraint.add_argument("--json-schema", help="the output is JSON matching this schema (its JSON text)")
    constraint.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    constraint.add_argument("--regex", help="the output matches this regular expression")
    constraint.add_argument("--choice", action="append", help="the output is one of these (repeat the flag)")
    constraint.add_argument("--grammar", help="the output matches this EBNF grammar (GBNF: root ::= ...)")
    add_env_argument(parser, "--api-key", default="",
                     help="the router's API key, sent as 'authorization: Bearer KEY' (a "
                          "comma-separated list: the first; prefer the env, argv shows in ps)")
    return parser.parse_args(argv)


def build_request(args: argparse.Namespace) -> generate_pb2.GenerateRequest:
    params = generate_pb2.SamplingParams()
    if args.max_tokens is not None:
        params.max_tokens = args.max_tokens
    if args.temperature is not None:
        params.temperature = args.temperature
    if args.seed is not None:
        params.seed = args.seed
    if args.json_schema or args.json_object or args.regex or args.choice or args.grammar:
        params.structured_outputs.CopyFrom(generate_pb2.StructuredOutputs(
            json=args.json_schema, json_object=args.json_object or None, regex=args.regex, grammar=args.grammar,
            choice=generate_pb2.Choices(choices=args.choice) if args.choice else None))
    if args.chat:
        chat = generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content=args.prompt)])
        return generate_pb2.GenerateRequest(chat=chat, sampling_params=params)
    return generate_pb2.GenerateRequest(prompt=args.prompt, sampling_params=params)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.max_tokens is not None and args.max_tokens < 1:
        sys.exit(f"error: --max-tokens must be >= 1, got {args.max_tokens}")
    if args.seed is not None and args.seed < 0:
        sys.exit(f"error: --seed must be >= 0, got {args.seed}")
    text: list[str] = []
    usage, finish = None, ""
    with public_channel(args.address, api_key=args.api_key.split(",")[0].strip()) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        try:
            call = stub.Generate(build_request(args), timeout=args.timeout)
            for response in call:
                if args.stream:
                    print(response.text, end="", flush=True)
                text.append(response.text)
                if response.finish_reason:
                    finish = generate_pb2.FinishReason.Name(response.finish_reason)
                if response.HasField("usage"):
                    usage = response.usage
        except grpc.RpcError as error:
            sys.exit(f"\nerror: {error.code().name}: {error.details()}")
    print("" if args.stream else "".join(text))
    if usage is not None:
        print(f"[{finish.removeprefix('FINISH_REASON_').lower()}; prompt {usage.prompt_tokens} "
              f"tokens, completion {usage.completion_tokens} tokens]", file=sys.stderr)
    if args.timings:
        print(timings_text(dict(call.trailing_metadata() or ())), file=sys.stderr)


def timings_text(trailers: dict[str, str]) -> str:
    """What ``--timings`` prints for a call's trailing metadata."""
    if TTFT_HEADER not in trailers:
        return (f"no TTFT breakdown in the reply ({TTFT_HEADER}): start the router with "
                "--debug-route to get one")
    return describe(parse_breakdown(trailers[TTFT_HEADER]), trailers.get(ROUTE_HEADER))


if __name__ == "__main__":
    main()
