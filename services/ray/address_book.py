"""Where each replica publishes its service's address, and where the router learns them.

A replica calls ``publish(role, replica_id, {"grpc": HOST:PORT, "node": NODE_ID})`` once its
service is SERVING and ``withdraw`` when it stops; the router long-polls ``wait_change`` (it
returns when the membership's version moves past the one the caller has, or after
``timeout_s``), so nothing polls while membership is steady.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray import serve

# Every long-poll of the router holds one slot of this deployment.
MAX_ONGOING = 256


class AddressBook:
    """Membership: ``{role: {replica_id: metadata}}`` and a version that moves on every change."""

    def __init__(self) -> None:
        self.members: dict[str, dict[str, dict[str, Any]]] = {}
        self.version = 0
        self._changed = asyncio.Condition()

    async def publish(self, role: str, replica_id: str, metadata: dict[str, Any]) -> int:
        self.members.setdefault(role, {})[replica_id] = dict(metadata)
        return await self._bump()

    async def withdraw(self, role: str, replica_id: str) -> int:
        if self.members.get(role, {}).pop(replica_id, None) is None:
            return self.version
        return await self._bump()

    async def snapshot(self) -> tuple[int, dict[str, dict[str, dict[str, Any]]]]:
        return self.version, {role: dict(members) for role, members in self.members.items()}

    async def wait_change(self, version: int, timeout_s: float = 30.0
                          ) -> tuple[int, dict[str, dict[str, dict[str, Any]]]]:
        """The snapshot once ``self.version != version``, or the current one after ``timeout_s``."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.version != version),
                                       timeout_s)
            except TimeoutError:
                pass
        return await self.snapshot()

    async def _bump(self) -> int:
        async with self._changed:
            self.version += 1
            self._changed.notify_all()
        return self.version


AddressBookDeployment = serve.deployment(
    AddressBook, name="AddressBook", num_replicas=1, max_ongoing_requests=MAX_ONGOING,
    ray_actor_options={"num_cpus": 0})
