"""``pdserve serve ray``: run the Ray Serve application on a Ray cluster (or a local one).

    pdserve serve ray --config app.yaml [--address auto] [--http-host 127.0.0.1] [--http-port 8000]

``app.yaml`` holds PdserveServingArgs (services/ray/args.py), e.g.::

    transfer: grpc
    prefill: {num_replicas: 1}
    decode: {num_replicas: 2, ray_actor_options: {num_cpus: 4}}
    router: {autoscaling_config: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 64}}

Running it again with only ``num_replicas`` changed scales that deployment in place.

Internal gRPC between the replicas' services carries ``PDSERVE_INTERNAL_TOKEN`` (this process's,
or a random one made here) and, when set, mutual TLS from ``PDSERVE_TLS_CERT/KEY/CA`` (paths that
must exist on every node): they reach every replica through the job's ``runtime_env`` env vars,
never argv. Ray pickles its own actor arguments and handles; pdserve hands Ray no bytes from the
network (requests are proxied over HTTP, KV moves worker to worker).

Prints ``ready http=HOST:PORT`` once every replica is SERVING; SIGINT / SIGTERM shut the
application down (each service drains) and leave Ray.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.flags import add_flags, setting
from services.common.wire import TRANSFERS


@dataclass(frozen=True)
class RayFlags:
    """``pdserve serve ray``'s flags (services/common/flags.py)."""

    config: str = setting("", "YAML file of PdserveServingArgs")
    transfer: str = setting("", "KV transport, when the config file does not name one",
                            choices=TRANSFERS)
    address: str = setting("", "Ray cluster address (empty: start a local one)")
    http_host: str = setting("127.0.0.1", "address Serve's HTTP proxy binds")
    http_port: int = setting(8000, "Serve's HTTP port")
    app_name: str = setting("pdserve", "Serve application name")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve serve ray", description=__doc__.split("\n\n")[0])
    add_flags(parser, RayFlags)
    return parser


def internal_auth_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What every replica's services need: the internal token (the caller's, else a new random
    one) and the ``PDSERVE_TLS_*`` paths when set."""
    env = {k: v for k, v in environ.items() if k.startswith("PDSERVE_TLS_") and v}
    env["PDSERVE_INTERNAL_TOKEN"] = environ.get("PDSERVE_INTERNAL_TOKEN") or secrets.token_urlsafe(32)
    return env


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    import yaml

    from services.ray.args import PdserveServingArgs

    try:
        raw = (yaml.safe_load(Path(args.config).read_text()) if args.config else None) or {}
        if args.transfer and isinstance(raw, dict) and "transfer" not in raw:
            raw["transfer"] = args.transfer
        serving_args = PdserveServingArgs.from_dict(raw)
    except (OSError, ValueError, yaml.YAMLError) as error:  # checked before Ray starts
        parser.error(f"--config {args.config!r}: {error}")
    import ray
    from ray import serve

    from services.ray.builder import build_pdserve_app

    ray.init(address=args.address or None, include_dashboard=False,
             runtime_env={"env_vars": internal_auth_env(os.environ)})
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.http_host, "port": args.http_port})
        serve.run(build_pdserve_app(serving_args), name=args.app_name, route_prefix="/")
        print(f"ready http={args.http_host}:{args.http_port}", flush=True)
        stop.wait()
    finally:
        serve.delete(args.app_name)
        serve.shutdown()  # type: ignore[no-untyped-call]  # ray leaves serve.shutdown unannotated
        ray.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
