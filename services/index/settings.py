"""The index's flags, shared by the workers, the router and ``pdserve up`` (each with its
``PDSERVE_*`` twin): ``--redis-url`` (empty: no index) and, for publishers, the heartbeat."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.common.flags import add_flags, setting
from services.common.settings import add_env_argument

DEFAULT_HEARTBEAT_S = 2.0
LEASE_HEARTBEATS = 3  # the lease outlives two missed heartbeats


def add_redis_url_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    add_env_argument(parser, "--redis-url", default="", help=help_text)


@dataclass(frozen=True)
class PublisherFlags:
    """A publisher's flags (workers and the kvstore)."""

    redis_url: str = setting("", "publish the blocks this process holds to the prefix index in "
                             "this Redis, e.g. redis://127.0.0.1:6379/0 (empty: no index)")
    index_heartbeat_s: float = setting(DEFAULT_HEARTBEAT_S, "seconds between index lease "
                                       f"renewals; the lease lasts {LEASE_HEARTBEATS} heartbeats")


def add_publisher_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, PublisherFlags)
