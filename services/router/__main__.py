"""``pdserve serve router``: the OpenAI HTTP + gRPC frontend in front of a backend.

    pdserve serve router --colocated [--model PATH] [--http-port 8000] [--grpc-port 50051] [engine flags]
    pdserve serve router --prefill HOST:PORT[,...] --decode HOST:PORT[,...] [--transfer nixl|grpc]

The engine flags (``--num-kv-blocks``, ``--spec-method``, ...: services/common/engine_flags.py)
build the in-process engine of ``--colocated``; in front of workers only ``--model`` and
``--max-model-len`` are read (the tokenizer, and the context length requests are checked against).
Every flag can also come from its ``PDSERVE_*`` environment variable (``--http-port`` ->
``PDSERVE_HTTP_PORT``). Port 0 binds a free port; the ``router ready`` log line names it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.common.auth import add_api_key_arguments, api_keys_from
from services.common.engine_flags import add_engine_arguments, engine_args_from
from services.common.internal_auth import add_internal_auth_arguments, install_from_args
from services.common.settings import add_env_argument
from services.common.wire import TRANSFERS
from services.index.schema import IndexMetaMismatch
from services.index.settings import add_redis_url_argument
from services.router.app import RouterConfig, build_backend, run_router
from services.router.limit_flags import add_limit_arguments, limits_from
from services.router.metrics import SLO_TPOT_S, SLO_TTFT_S


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve serve router", description=__doc__.split("\n")[0])
    add_env_argument(parser, "--host", default="127.0.0.1", help="address both servers bind")
    add_env_argument(parser, "--http-port", type=int, default=8000, help="OpenAI HTTP port (0: any free)")
    add_env_argument(parser, "--grpc-port", type=int, default=50051, help="gRPC port (0: any free)")
    add_env_argument(parser, "--colocated", action="store_true",
                     help="run one engine in this process instead of prefill/decode workers")
    add_env_argument(parser, "--prefill", type=_addresses, default=[],
                     help="prefill worker addresses, comma-separated HOST:PORT")
    add_env_argument(parser, "--decode", type=_addresses, default=[],
                     help="decode worker addresses, comma-separated HOST:PORT")
    add_env_argument(parser, "--transfer", choices=TRANSFERS, default="nixl",
                     help="how prefill workers send KV to decode workers")
    add_env_argument(parser, "--drain-grace-s", type=float, default=10.0,
                     help="seconds in-flight requests get to finish after SIGTERM")
    add_redis_url_argument(parser, "Redis of the prefix index the workers publish to "
                                   "(services/index; empty: none)")
    add_env_argument(parser, "--local-prefill-max-tokens", type=int, default=64,
                     help="with --redis-url: prefill on the decode worker itself when the part of "
                          "the prompt it has not cached is at most this many tokens (0: never)")
    add_env_argument(parser, "--index-budget-ms", type=float, default=5.0,
                     help="with --redis-url: time an index lookup may take (to connect, and for "
                          "the reply) before the request is routed by load only")
    add_env_argument(parser, "--max-migrations", type=int, default=3,
                     help="times a request moves to another worker when its worker dies or "
                          "drains mid-stream (0: never; the request fails)")
    add_env_argument(parser, "--kv-full-wait-s", type=float, default=60.0,
                     help="when every decode worker lacks free KV blocks for a request, wait up to "
                          "this long for running requests to free some (retrying with backoff) "
                          "before answering 429 (0: refuse at once)")
    add_env_argument(parser, "--debug-route", action="store_true",
                     help="debug mode: tell each client how its request was routed and where its "
                          "TTFT went (HTTP headers / gRPC trailing metadata pdserve-route: "
                          "path/reason, pdserve-ttft-breakdown: stage=seconds,...)")
    add_env_argument(parser, "--slo-ttft-s", type=float, default=SLO_TTFT_S,
                     help="goodput's TTFT target in seconds (pdserve_requests_slo_met_total)")
    add_env_argument(parser, "--slo-tpot-s", type=float, default=SLO_TPOT_S,
                     help="goodput's time-per-output-token target in seconds")
    add_api_key_arguments(parser)
    add_internal_auth_arguments(parser)
    add_limit_arguments(parser)
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    for flag, target in (("--slo-ttft-s", args.slo_ttft_s), ("--slo-tpot-s", args.slo_tpot_s)):
        if not target > 0:
            parser.error(f"{flag} must be a positive number of seconds, got {target}")
    try:
        args.api_keys = api_keys_from(args)
    except ValueError as error:
        parser.error(f"API keys: {error}")
    args.limits, args.admission = limits_from(args, parser)
    install_from_args(args, parser)  # the router's channels to its workers
    if args.local_prefill_max_tokens < 0:
        parser.error(f"--local-prefill-max-tokens must be >= 0, got {args.local_prefill_max_tokens}")
    if not args.index_budget_ms > 0:
        parser.error(f"--index-budget-ms must be a positive number, got {args.index_budget_ms}")
    if args.kv_full_wait_s < 0:
        parser.error(f"--kv-full-wait-s must be >= 0, got {args.kv_full_wait_s}")
    if args.max_migrations < 0:
        parser.error(f"--max-migrations must be >= 0, got {args.max_migrations}")
    if args.colocated and (args.prefill or args.decode):
        parser.error("--colocated runs its own engine; drop --prefill / --decode")
    if not args.colocated and not (args.prefill and args.decode):
        parser.error("give --colocated, or both --prefill and --decode worker addresses")
    if args.max_model_len is not None and args.max_model_len < 2:
        parser.error(f"--max-model-len must be >= 2, got {args.max_model_len}")
    return args


def _addresses(value: str) -> list[str]:
    addresses = [a.strip() for a in value.split(",") if a.strip()]
    bad = [a for a in addresses if not a.rpartition(":")[2].isdigit()]
    if bad:
        raise argparse.ArgumentTypeError(f"addresses must be HOST:PORT, got {bad}")
    return addresses


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = RouterConfig(host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                          model=args.model, max_model_len=args.max_model_len,
                          drain_grace_s=args.drain_grace_s, debug_route=args.debug_route,
                          api_keys=args.api_keys, metrics_auth=args.metrics_auth,
                          slo_ttft_s=args.slo_ttft_s, slo_tpot_s=args.slo_tpot_s,
                          limits=args.limits, admission=args.admission)
    backend = build_backend(args.colocated, args.model, engine_args_from(args), args.prefill,
                            args.decode, args.transfer, redis_url=args.redis_url,
                            local_prefill_max_tokens=args.local_prefill_max_tokens,
                            index_budget_s=args.index_budget_ms / 1000,
                            max_migrations=args.max_migrations, kv_full_wait_s=args.kv_full_wait_s)
    try:
        asyncio.run(run_router(config, backend))
    except (OSError, ValueError, IndexMetaMismatch) as error:  # a port in use, a bad model, ...
        logging.getLogger("pdserve.router").error("%s", error)
        sys.exit(1)


if __name__ == "__main__":
    main()
