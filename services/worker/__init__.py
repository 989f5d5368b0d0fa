"""What the prefill and decode workers share: flags, engine startup, GetStats, the gRPC KV endpoint.

    settings.py  flags: the worker's own and the engine's (each also a PDSERVE_* variable)
    server.py    the skeleton: load -> AsyncEngine -> gRPC server (+ health, GetStats) -> drain
    stats.py     WorkerService.GetStats
    kv_grpc.py   the gRPC KV transport's shared endpoint (its sender is in services/prefill,
                 its receiver and servicer in services/decode)
"""
