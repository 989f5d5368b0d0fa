"""What the prefill and decode workers share: flags, engine startup, GetStats, KV transfer setup.

    settings.py  flags: the worker's own and the engine's (each also a PDSERVE_* variable)
    server.py    the skeleton: load -> AsyncEngine -> gRPC server (+ health, GetStats) -> drain
    stats.py     WorkerService.GetStats
    kv.py        which KV connectors run, and KVPusher (a KVSender on its own thread)
"""
