"""Frozen configuration objects, one per concern, validated once at construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.kv_cache.quant_format import QUANT_KV_DTYPES


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what to change."""


class Role(str, enum.Enum):  # noqa: UP042 - StrEnum would change str(Role.X) in logs and flags
    """What a worker's engine does with a request (see DESIGN.md, 'The request path')."""

    COLOCATED = "colocated"  # prefill and decode in one engine
    PREFILL = "prefill"  # compute the prompt's KV and the first token, then stop
    DECODE = "decode"  # start from KV that arrived from a prefill worker


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as in HF configs. ``kind`` is 'none', 'linear' or 'llama3'."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_model_len: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")


DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    Layout (one tensor for the whole cache)::

        kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
                   ^ one block is one contiguous region across all layers, so a block is a
                     single descriptor for KV transfer (NIXL) and CPU offload.
        key cache of layer l   = kv_cache[:, l, 0]   # [num_blocks, block_size, num_kv_heads, head_dim]
        value cache of layer l = kv_cache[:, l, 1]   (strided views; kernels take strides)

    slot = block_id * block_size + offset_in_block.
    ``num_blocks`` wins over ``memory_budget_bytes`` when both are given.
    ``dtype`` is what the cache stores: a float dtype, or a quantized one (int8, float8_e4m3fn)
    whose rows are ``head_dim`` 1-byte codes followed by their fp32 scale
    (``engine/kv_cache/quant_format.py``).
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_budget_bytes: int = 512 * 1024 * 1024
    # On CUDA: size the cache from this fraction of the GPU's memory, less the weights and the
    # profiled activation peak (``engine/runner/memory.py``); None uses memory_budget_bytes.
    gpu_memory_utilization: float | None = None
    dtype: str = "float32"
    enable_prefix_caching: bool = True
    enable_kv_events: bool = False  # queue BlockStored/BlockRemoved for a publisher to drain
    # Host (CPU) tier bytes: None sizes it from the device pool and free memory
    # (``storage.host_pool_num_blocks``), 0 turns the tier off.
    cpu_offload_bytes: int | None = None
    # Copy blocks between the device cache and the host tier on the engine thread, inline (the
    # baseline that loadtests/bench_offload.py measures), instead of on a background copier.
    kv_offload_sync: bool = False

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"CacheConfig.block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"CacheConfig.num_blocks must be >= 1, got {self.num_blocks}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"CacheConfig.gpu_memory_utilization must be in (0, 1], "
                              f"got {self.gpu_memory_utilization}")
        if self.cpu_offload_bytes is not None and self.cpu_offload_bytes < 0:
            raise ConfigError(f"CacheConfig.cpu_offload_bytes must be >= 0 (0 turns the host tier off), "
                              f"got {self.cpu_offload_bytes}")
        if self.dtype not in DTYPES + QUANT_KV_DTYPES:
            raise ConfigError(f"CacheConfig.dtype must be {'|'.join(DTYPES + QUANT_KV_DTYPES)}, "
                              f"got {self.dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits. ``max_num_batched_tokens`` is the per-step token budget."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    role: Role = Role.COLOCATED
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk may use the whole budget

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"SchedulerConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"SchedulerConfig.max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class DeviceDefaults:
    """The settings whose default depends on the device (``device_defaults``)."""

    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int


# A large GPU takes vLLM's scheduler limits and bf16; a CPU (2 cores in CI) small steps in fp32.
CUDA_DEFAULTS = DeviceDefaults(dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=8192)
CPU_DEFAULTS = DeviceDefaults(dtype="float32", max_num_seqs=SchedulerConfig.max_num_seqs,
                              max_num_batched_tokens=SchedulerConfig.max_num_batched_tokens)


def is_cuda_device(device: str) -> bool:
    """'cuda' or 'cuda:N' (torch-free: the router reads the defaults too)."""
    return device == "cuda" or device.startswith("cuda:")


def device_defaults(device: str) -> DeviceDefaults:
    return CUDA_DEFAULTS if is_cuda_device(device) else CPU_DEFAULTS


WEIGHT_FORMATS = ("auto", "fp32", "q8_0", "q4")  # engine/models/quant_weights.py says what each means
SPEC_METHODS = ("ngram", "layer-skip", "draft")
ASYNC_SCHEDULING = ("auto", "on", "off")  # engine/core.py: auto is on where the step runs on CUDA


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding. ``method`` None turns it off.

    ngram: prompt lookup; layer-skip: the target's first ``num_layers`` layers + final norm +
    LM head draft (sharing the target's KV for those layers); draft: a separate model at
    ``draft_model`` with the same tokenizer. ``max_batch``: at or above this many running
    requests nobody speculates (see docs/benchmark-log.md for how it was measured).
    ``draft_cost``: what one draft token costs, in target decode steps; None estimates it from
    weight bytes (0 for n-gram). Adaptive k stops drafting where drafts cost more than they save.
    """

    method: str | None = None
    k: int = 4
    draft_model: str | None = None
    num_layers: int | None = None
    max_batch: int = 16
    ngram_min: int = 1
    ngram_max: int = 4
    draft_cost: float | None = None

    def __post_init__(self) -> None:
        if self.method is None:
            return
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"spec method must be one of {'|'.join(SPEC_METHODS)}, got {self.method!r}")
        if not 1 <= self.k <= 16:
            raise ConfigError(f"spec k must be in 1..16, got {self.k}")
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("spec method 'draft' needs a draft model path (--draft-model)")
        if self.num_layers is not None and self.num_layers < 1:
            raise ConfigError(f"spec num_layers must be >= 1, got {self.num_layers}")
        if self.max_batch < 1:
            raise ConfigError(f"spec max_batch must be >= 1, got {self.max_batch}")
        if self.draft_cost is not None and not 0.0 <= self.draft_cost < float("inf"):
            raise ConfigError(f"spec draft_cost must be finite and >= 0, got {self.draft_cost}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an EngineCore needs; built once by LLM / the services."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    device: str = "cpu"
    dtype: str = "float32"  # compute dtype of the weights and activations
    seed: int = 0
    num_threads: int = 0  # CPU compute threads (0: OMP_NUM_THREADS if set, else every usable CPU)
    # CPU: 'PATH:SLOT' of a file whose engines split their threads by who is busy (core_share.py)
    core_share: str = ""
    # matmul weights: the GGUF's own blocks where a kernel reads them in float32 (auto: as llama.cpp
    # serves a GGUF on a CPU; dense weights in any other dtype, so bf16 on CUDA), dense fp32, or all
    # Q8_0 / 4-bit (engine/models/quant_weights.py)
    weight_format: str = "auto"
    # CUDA: decode steps replay captured graphs (engine/runner/cuda_graphs.py) unless this is set
    enforce_eager: bool = False
    # decode steps scheduled one ahead of their tokens, so the host's work overlaps the device's
    # (engine/scheduler/chained.py); auto: on CUDA without speculation
    async_scheduling: str = "auto"

    def __post_init__(self) -> None:
        if self.async_scheduling not in ASYNC_SCHEDULING:
            raise ConfigError(f"async_scheduling must be {'|'.join(ASYNC_SCHEDULING)}, "
                              f"got {self.async_scheduling!r}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ConfigError(f"weight_format must be {'|'.join(WEIGHT_FORMATS)}, got {self.weight_format!r}")
        if self.weight_format in ("q8_0", "q4") and self.dtype != "float32":
            raise ConfigError(f"weight_format {self.weight_format} needs dtype float32, got {self.dtype}")
