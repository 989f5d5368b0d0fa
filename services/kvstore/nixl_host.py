"""The kvstore's NIXL side: one agent per compat region, the target of workers' READs.

Workers READ store slots straight into their own registered blocks (one-sided: the store's
CPU does no copy). Agents are created without NIXL's progress thread (it polls UCX without
pause, a core per idle agent, see engine/kv_transfer/nixl.py); the server instead calls
:meth:`NixlHost.progress` every few milliseconds while a NIXL read lease is live, and not at all
when none is, so an idle store uses no CPU.
"""

from __future__ import annotations

from engine.kv_transfer.base import KVHandshake, KVTransferError
from services.kvstore.region import BlockRegion


class NixlHost:
    """NIXL agents of the store, keyed by compat hash. Construction raises KVTransferError
    (naming why) when NIXL cannot create a UCX agent here."""

    def __init__(self) -> None:
        from engine.kv_transfer.nixl import NixlAgent, import_nixl

        import_nixl()
        self._agent_cls = NixlAgent
        self._agents: dict[str, NixlAgent] = {}

    def handshake(self, region: BlockRegion) -> KVHandshake:
        """The store's handshake for ``region`` (registering the region on first call)."""
        agent = self._agents.get(region.compat.hash)
        if agent is None:
            agent = self._agent_cls(region.compat.model_name, "kvstore")
            agent.register(region.tensor)
            self._agents[region.compat.hash] = agent
        return agent.handshake_info()

    def agent_name(self, compat_hash: str) -> str:
        agent = self._agents.get(compat_hash)
        if agent is None:
            raise KVTransferError(f"no NIXL agent for compat {compat_hash[:16]}; Handshake first")
        return agent.name

    def progress(self) -> None:
        """Let UCX make progress on reads that need the target (e.g. the tcp transport)."""
        for agent in self._agents.values():
            agent.agent.get_new_notifs()

    def close(self) -> None:
        for agent in self._agents.values():
            agent.close()
        self._agents.clear()
