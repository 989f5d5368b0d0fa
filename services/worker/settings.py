"""Flags shared by the prefill and decode workers, and the EngineConfig they build.

Every flag also reads a ``PDSERVE_*`` variable (``--num-kv-blocks`` -> ``PDSERVE_NUM_KV_BLOCKS``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import TYPE_CHECKING

from engine.config import SPEC_METHODS, CacheConfig, EngineConfig, Role, SchedulerConfig, SpecConfig
from services.common.grpc_server import DEFAULT_GRACE_S, DEFAULT_HOST
from services.common.settings import add_env_argument

if TYPE_CHECKING:
    from engine.models.loader import LoadedModel

TRANSFERS = ("nixl", "grpc")


def worker_parser(role: Role, default_port: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"pdserve serve {role.value}",
                                     description=f"Serve one {role.value} worker over gRPC.")
    add = add_env_argument
    add(parser, "--host", default=DEFAULT_HOST, help="address to bind")
    add(parser, "--port", type=int, default=default_port, help="gRPC port (0: any free port)")
    add(parser, "--worker-id", default="", help="name in stats and logs (default: role-port)")
    add(parser, "--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    add(parser, "--transfer", choices=TRANSFERS, default="nixl",
        help="KV transport: nixl (one-sided writes over UCX; gRPC is served as well) or grpc only")
    add(parser, "--block-size", type=int, default=16, help="tokens per KV block")
    add(parser, "--num-kv-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)")
    add(parser, "--kv-cache-memory", type=int, default=512 * 1024 * 1024, help="KV cache bytes")
    add(parser, "--max-num-seqs", type=int, default=64, help="most running requests per step")
    add(parser, "--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    add(parser, "--max-model-len", type=int, default=None, help="context length cap")
    add(parser, "--no-prefix-caching", action="store_true", help="disable the prefix cache")
    add(parser, "--device", default="cpu", help="torch device")
    add(parser, "--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
        help="weights, activations and KV cache dtype")
    add(parser, "--num-threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    add(parser, "--cpus", default="", help="pin to these CPUs, e.g. '0-3,6' (empty: no pinning)")
    add(parser, "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level (DEBUG: one line per request with its timings)")
    add(parser, "--drain-grace-s", type=float, default=DEFAULT_GRACE_S,
        help="on SIGTERM, seconds in-flight RPCs may still run")
    if role == Role.DECODE:
        add_spec_arguments(parser)
    return parser


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding flags (decode workers and ``pdserve up``)."""
    add = add_env_argument
    add(parser, "--spec-method", choices=SPEC_METHODS, default=None,
        help="speculative decoding proposer (default: off)")
    add(parser, "--spec-k", type=int, default=4, help="most draft tokens per step")
    add(parser, "--draft-model", default=None, help="draft model path for --spec-method draft")
    add(parser, "--spec-layers", type=int, default=None,
        help="layers of the target used as the drafter for --spec-method layer-skip")
    add(parser, "--spec-max-batch", type=int, default=16,
        help="no speculation at or above this many running requests")
    add(parser, "--spec-draft-cost", type=float, default=None,
        help="one draft token's cost in target decode steps (default: estimated from weight bytes)")


def spec_config(args: argparse.Namespace) -> SpecConfig:
    return SpecConfig(method=getattr(args, "spec_method", None), k=getattr(args, "spec_k", 4),
                      draft_model=getattr(args, "draft_model", None),
                      num_layers=getattr(args, "spec_layers", None),
                      max_batch=getattr(args, "spec_max_batch", 16),
                      draft_cost=getattr(args, "spec_draft_cost", None))


def engine_config(args: argparse.Namespace, role: Role, loaded: LoadedModel) -> tuple[EngineConfig, LoadedModel]:
    """The engine configuration for ``role``; raises ConfigError naming a bad flag value."""
    if args.max_model_len is not None:
        loaded = dataclasses.replace(
            loaded, config=dataclasses.replace(loaded.config, max_model_len=args.max_model_len))
    config = EngineConfig(
        model=loaded.config,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_kv_blocks,
                          memory_budget_bytes=args.kv_cache_memory, dtype=args.dtype,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens, role=role),
        spec=spec_config(args),
        device=args.device, dtype=args.dtype, num_threads=args.num_threads)
    return config, loaded


def parse_cpus(spec: str) -> set[int]:
    """'0-3,6' -> {0, 1, 2, 3, 6}. Raises ValueError naming the bad part."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"--cpus {spec!r}: {part!r} is not a CPU number or range") from None
        if first > last or first < 0:
            raise ValueError(f"--cpus {spec!r}: bad range {part!r}")
        cpus.update(range(first, last + 1))
    return cpus


def apply_cpu_settings(args: argparse.Namespace) -> None:
    """Pin the process (``--cpus``) and size torch's thread pool (``--num-threads``)."""
    import torch

    if args.cpus:
        os.sched_setaffinity(0, parse_cpus(args.cpus))
    threads = args.num_threads or (len(os.sched_getaffinity(0)) if args.cpus else 0)
    if threads:
        torch.set_num_threads(threads)
