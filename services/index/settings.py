"""The index's flags, shared by the workers, the router and ``pdserve up`` (each with its
``PDSERVE_*`` twin): ``--redis-url`` (empty: no index) and, for publishers, the heartbeat."""

from __future__ import annotations

import argparse

from services.common.settings import add_env_argument

DEFAULT_HEARTBEAT_S = 2.0
LEASE_HEARTBEATS = 3  # the lease outlives two missed heartbeats


def add_redis_url_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    add_env_argument(parser, "--redis-url", default="", help=help_text)


def add_publisher_arguments(parser: argparse.ArgumentParser) -> None:
    add_redis_url_argument(parser, "publish this worker's prefix cache to the prefix index in this "
                                   "Redis, e.g. redis://127.0.0.1:6379/0 (empty: no index)")
    add_env_argument(parser, "--index-heartbeat-s", type=float, default=DEFAULT_HEARTBEAT_S,
                     help=f"seconds between index lease renewals; the lease lasts "
                          f"{LEASE_HEARTBEATS} heartbeats")
