"""The tiers below the device KV pool: the worker's host pool and the node's kvstore under it.

``protocol.py`` is what the engine and the scheduler see (``HostTierProtocol``, with the null
``NoHostTier`` when the host tier is off); ``build.py`` wires the real one: ``HostTier``
(``host_tier.py``) offloads on device eviction (``host_offload.py``) into a ``HostBlockPool``
(``host_pool.py``) and reloads on a prefix hit, its copies on a ``Copier`` (``copier.py``), each
load weighed by a ``LoadCostModel`` (``load_cost.py``); a ``LowerTierStager`` (``lower_stage.py``)
continues a host hit from a ``LowerTier`` (``lower_tier.py``, the kvstore client's contract).
"""
