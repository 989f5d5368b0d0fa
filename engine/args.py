"""EngineArgs: every engine setting a user can give, flat, each with its default stated once.

    args = EngineArgs(num_kv_blocks=256, spec_method="ngram")
    core = EngineCore(args.build(loaded.config, Role.DECODE), loaded)

``LLM(**kwargs)`` takes these fields as keywords, and every service derives its command-line
flags and their ``PDSERVE_*`` twins from them (services/common/engine_flags.py): a field added
here is a keyword, a flag and an environment variable everywhere at once, and the launcher
forwards it to every process that runs an engine.

A field's metadata holds its help text (``help``) and, where the flag needs more than the
field's type, ``choices``, or ``flag`` for a switch that is on by default
(``enable_prefix_caching`` -> ``--no-prefix-caching``). Defaults are read from the config
dataclasses of engine/config.py, so each is written once. Torch-free: the router imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from engine.config import (
    ASYNC_SCHEDULING,
    DTYPES,
    SPEC_METHODS,
    WEIGHT_FORMATS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    Role,
    SchedulerConfig,
    SpecConfig,
    device_defaults,
    is_cuda_device,
)
from engine.kv_cache.quant_format import KV_CACHE_DTYPES, cache_dtype_for


def _setting(default: Any, help_text: str, **flag_options: Any) -> Any:
    return field(default=default, metadata={"help": help_text, **flag_options})


@dataclass(frozen=True)
class EngineArgs:
    """Engine settings as a user gives them; ``build`` turns them into an EngineConfig.

    Units: ``kv_cache_memory`` in bytes, ``cpu_offload_gb`` in GiB (2**30 bytes), lengths in tokens.
    ``num_kv_blocks`` wins over ``kv_cache_memory``; ``max_model_len`` None keeps the model's context length.
    Defaults that follow the device (``dtype`` 'auto', None for the scheduler limits and the KV
    cache memory) are resolved by ``build`` from ``engine.config.device_defaults``."""

    block_size: int = _setting(CacheConfig.block_size, "tokens per KV block (a power of two)")
    num_kv_blocks: int | None = _setting(CacheConfig.num_blocks,
                                         "KV blocks (wins over --kv-cache-memory)")
    kv_cache_memory: int | None = _setting(None, "KV cache bytes, when --num-kv-blocks is not given "
                                           "(default: on CUDA what --gpu-memory-utilization leaves, "
                                           f"on a CPU {CacheConfig.memory_budget_bytes >> 20} MiB)")
    gpu_memory_utilization: float = _setting(0.9, "CUDA: the fraction of the GPU's memory for the "
                                             "weights, activations and the KV cache")
    enable_prefix_caching: bool = _setting(CacheConfig.enable_prefix_caching,
                                           "disable the prefix cache", flag="--no-prefix-caching")
    cpu_offload_gb: float | None = _setting(None, "host (CPU) tier GiB for blocks evicted from the KV "
                                            "cache (default: twice the KV cache, at most a quarter of "
                                            "free memory; 0: off)")
    max_num_seqs: int | None = _setting(None, "most running requests per step (default: "
                                        f"{device_defaults('cuda').max_num_seqs} on CUDA, "
                                        f"{device_defaults('cpu').max_num_seqs} on a CPU)")
    max_num_batched_tokens: int | None = _setting(None, "token budget of one engine step (default: "
                                                  f"{device_defaults('cuda').max_num_batched_tokens} on "
                                                  f"CUDA, {device_defaults('cpu').max_num_batched_tokens}"
                                                  " on a CPU)")
    max_model_len: int | None = _setting(None, "context length cap in tokens (default: the model's)")
    device: str = _setting(EngineConfig.device, "torch device")
    dtype: str = _setting("auto", "weights, activations and KV cache dtype (auto: "
                          f"{device_defaults('cuda').dtype} on CUDA, {device_defaults('cpu').dtype} "
                          "on a CPU)", choices=("auto", *DTYPES))
    kv_cache_dtype: str = _setting("auto", "KV cache storage: the model's dtype (auto), fp32, "
                                   "bf16 (half fp32's bytes), or 8-bit codes with a per-token, "
                                   "per-head fp32 scale (int8, fp8 = float8_e4m3fn)",
                                   choices=KV_CACHE_DTYPES)
    weight_format: str = _setting(EngineConfig.weight_format, "matmul weights: fp32 (dense, in "
                                  "--dtype), the GGUF's own blocks where a kernel reads them (auto: "
                                  "float32 activations, as on a CPU), or all Q8_0 / 4-bit",
                                  choices=WEIGHT_FORMATS)
    enforce_eager: bool = _setting(False, "CUDA: run decode steps eagerly instead of replaying "
                                   "captured CUDA graphs")
    async_scheduling: str = _setting(EngineConfig.async_scheduling, "schedule each decode step "
                                     "before the last one's tokens reach the host, so scheduling and "
                                     "output overlap the device's work (auto: on CUDA, without "
                                     "speculation)", choices=ASYNC_SCHEDULING)
    num_threads: int = _setting(EngineConfig.num_threads,
                                "CPU compute threads (0: OMP_NUM_THREADS where set, else every "
                                "CPU this process may run on)")
    spec_method: str | None = _setting(SpecConfig.method, "speculative decoding proposer "
                                       "(default: off)", choices=SPEC_METHODS)
    spec_k: int = _setting(SpecConfig.k, "most draft tokens per step")
    draft_model: str | None = _setting(SpecConfig.draft_model,
                                       "draft model path for --spec-method draft")
    spec_layers: int | None = _setting(SpecConfig.num_layers, "layers of the target used as the "
                                       "drafter for --spec-method layer-skip")
    spec_max_batch: int = _setting(SpecConfig.max_batch,
                                   "no speculation at or above this many running requests")
    spec_draft_cost: float | None = _setting(SpecConfig.draft_cost, "one draft token's cost in "
                                             "target decode steps (default: from weight bytes)")

    def build(self, model_config: ModelConfig, role: Role) -> EngineConfig:
        """The validated configuration of an engine in ``role`` serving ``model_config``, with
        its ``max_model_len`` replaced by ours when we set one (EngineCore serves ``config.model``).

        A prefill engine stops after the first token, so it never speculates: the spec fields
        are validated for every role but applied for COLOCATED and DECODE only.
        Raises ConfigError naming the bad value."""
        if self.cpu_offload_gb is not None and not 0 <= self.cpu_offload_gb < float("inf"):
            raise ConfigError(f"cpu_offload_gb must be a finite number >= 0 (0 turns the host tier "
                              f"off), got {self.cpu_offload_gb}")
        cpu_offload_bytes = None if self.cpu_offload_gb is None else int(self.cpu_offload_gb * 2**30)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be {'|'.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.max_model_len is not None:
            model_config = replace(model_config, max_model_len=self.max_model_len)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        defaults = device_defaults(self.device)
        dtype = defaults.dtype if self.dtype == "auto" else self.dtype
        on_gpu_budget = is_cuda_device(self.device) and self.kv_cache_memory is None
        spec = SpecConfig(method=self.spec_method, k=self.spec_k, draft_model=self.draft_model,
                          num_layers=self.spec_layers, max_batch=self.spec_max_batch,
                          draft_cost=self.spec_draft_cost)
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(block_size=self.block_size, num_blocks=self.num_kv_blocks,
                              memory_budget_bytes=(CacheConfig.memory_budget_bytes
                                                   if self.kv_cache_memory is None else self.kv_cache_memory),
                              gpu_memory_utilization=self.gpu_memory_utilization if on_gpu_budget else None,
                              dtype=cache_dtype_for(self.kv_cache_dtype, dtype),
                              enable_prefix_caching=self.enable_prefix_caching,
                              cpu_offload_bytes=cpu_offload_bytes),
            scheduler=SchedulerConfig(
                max_num_seqs=defaults.max_num_seqs if self.max_num_seqs is None else self.max_num_seqs,
                max_num_batched_tokens=(defaults.max_num_batched_tokens if self.max_num_batched_tokens is None
                                        else self.max_num_batched_tokens),
                role=role),
            spec=SpecConfig() if role == Role.PREFILL else spec,
            device=self.device, dtype=dtype, num_threads=self.num_threads,
            weight_format=self.weight_format, enforce_eager=self.enforce_eager,
            async_scheduling=self.async_scheduling)
