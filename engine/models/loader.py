"""One entry point for models: a ``.gguf`` file or an HF directory -> config, weights, tokenizer.

``load_tokenizer`` stays torch-free (the router calls it): torch is imported only by
``load_model``, through the gguf/hf loaders.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import ModelConfig
from engine.models.default_model import default_model_path
from engine.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from kernels.quant import QuantRows


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the runner. ``weights`` are fp32, in HF naming and layout
    (see ``expected_weight_shapes``; from a GGUF file each is dequantized when first read:
    gguf_loader.LazyWeights); ``blocks`` the same matrices as a GGUF file stores them,
    for those it stores in a format the quantized kernels read (empty for an HF directory)."""

    config: ModelConfig
    weights: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    blocks: dict[str, QuantRows] = field(default_factory=dict)


def load_model(path: str | None = None) -> LoadedModel:
    """Load ``path`` (a ``.gguf`` file or an HF directory; None: the default model).

    Missing paths raise FileNotFoundError; unsupported or malformed models raise ValueError,
    each naming the path.
    """
    resolved = _resolve(path)
    blocks: dict[str, QuantRows] = {}
    weights: Mapping[str, torch.Tensor]
    with _naming(resolved):
        if resolved.is_dir():
            from engine.models.hf_loader import load_hf

            config, weights, tokenizer = load_hf(resolved)
        else:
            from engine.models.gguf_loader import load_gguf_with_blocks

            config, weights, tokenizer, blocks = load_gguf_with_blocks(resolved)
        check_weights(config, weights, resolved)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, blocks=blocks)


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The tokenizer of ``path`` alone (same rules as ``load_model``); never imports torch."""
    resolved = _resolve(path)
    with _naming(resolved):
        return Tokenizer.from_hf_dir(resolved) if resolved.is_dir() else Tokenizer.from_gguf(resolved)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight a model of ``config`` has (HF naming, ``[out, in]`` matrices)."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (q_size, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_size, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_size, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, q_size),
            f"{layer}.mlp.gate_proj.weight": (inner, hidden),
            f"{layer}.mlp.up_proj.weight": (inner, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inner),
        }
        if config.attention_bias:
            shapes |= {f"{layer}.self_attn.q_proj.bias": (q_size,),
                       f"{layer}.self_attn.k_proj.bias": (kv_size,),
                       f"{layer}.self_attn.v_proj.bias": (kv_size,)}
    return shapes


def check_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor], path: Path | str) -> None:
    """ValueError naming the missing, unexpected and mis-shaped weights, if there are any
    (shapes read without dequantizing a ``LazyWeights``)."""
    expected = expected_weight_shapes(config)
    shape_of = getattr(weights, "shape", None) or (lambda name: tuple(weights[name].shape))
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    misshaped = [f"{name}: {shape_of(name)} != {shape}"
                 for name, shape in expected.items() if name in weights and tuple(shape_of(name)) != shape]
    if missing or unexpected or misshaped:
        raise ValueError(f"{path}: weights do not match the config: missing {missing[:5]} "
                         f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)}), "
                         f"mis-shaped {misshaped[:5]}")


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Prefix ``path`` to a ValueError's message unless it names the path already."""
    try:
        yield
    except ValueError as error:
        if str(path) in str(error):
            raise
        raise ValueError(f"{path}: {error}") from error


def _resolve(path: str | None) -> Path:
    resolved = Path(default_model_path() if path is None else path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(f"model path {str(resolved)!r} does not exist")
    if resolved.is_file() and resolved.suffix != ".gguf":
        raise ValueError(f"model path {str(resolved)!r} is neither a .gguf file nor an HF model directory")
    return resolved
