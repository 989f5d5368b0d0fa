"""The AddressBook the Ray replicas publish to: versions move on every change, a long-poll
returns at the change (not before) or at its timeout, and the router's lists are sorted."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (.[deploy] extra)")

from services.ray.address_book import AddressBook  # noqa: E402
from services.ray.router import worker_lists  # noqa: E402


def test_publish_withdraw_and_long_poll() -> None:
    async def scenario() -> None:
        book = AddressBook()
        assert await book.snapshot() == (0, {})
        waiter = asyncio.ensure_future(book.wait_change(0, timeout_s=10))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # nothing changed yet: the poll waits
        assert await book.publish("decode", "decode-b", {"grpc": "127.0.0.1:2"}) == 1
        version, members = await asyncio.wait_for(waiter, 2)
        assert version == 1 and members == {"decode": {"decode-b": {"grpc": "127.0.0.1:2"}}}
        await book.publish("decode", "decode-a", {"grpc": "127.0.0.1:1"})
        await book.publish("prefill", "prefill-a", {"grpc": "127.0.0.1:3"})
        assert worker_lists((await book.snapshot())[1]) == (
            ["127.0.0.1:3"], ["127.0.0.1:1", "127.0.0.1:2"])
        assert await book.withdraw("decode", "decode-b") == 4
        assert await book.withdraw("decode", "decode-b") == 4  # unknown: no change
        started = asyncio.get_running_loop().time()
        version, _ = await book.wait_change(4, timeout_s=0.2)  # no change: returns at timeout
        assert version == 4 and asyncio.get_running_loop().time() - started >= 0.19

    asyncio.run(scenario())
