"""What the router must know about the served model without loading it (torch-free).

The router validates requests before any worker sees them, so it needs the vocabulary size
and the context length; it reads them from the model's metadata (GGUF header or config.json)
instead of building the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.models.default_model import default_model_path
from engine.models.gguf_file import read_gguf


@dataclass(frozen=True)
class ModelInfo:
    """``name`` is what clients put in the ``model`` field; limits are in tokens."""

    name: str
    vocab_size: int
    max_model_len: int


def read_model_info(path: str | None = None, max_model_len: int | None = None) -> ModelInfo:
    """Read ``path`` (a ``.gguf`` file or an HF directory; None: the default model).

    ``max_model_len`` overrides the model's context length, as the engine's flag does. The
    name follows the engine's loaders: the file name without ``.gguf``, or the directory name.
    """
    resolved = Path(default_model_path() if path is None else path).expanduser().resolve()
    if not resolved.exists():
        raise FileNotFoundError(f"model path {str(resolved)!r} does not exist")
    if resolved.is_dir():
        info = _hf_info(resolved)
    else:
        info = _gguf_info(resolved)
    if max_model_len is not None:
        info = ModelInfo(info.name, info.vocab_size, max_model_len)
    return info


def _gguf_info(path: Path) -> ModelInfo:
    metadata = read_gguf(path, with_tensors=False).metadata
    arch = metadata.get("general.architecture")
    vocab_size = metadata.get(f"{arch}.vocab_size", len(metadata.get("tokenizer.ggml.tokens") or []))
    context_length = metadata.get(f"{arch}.context_length")
    if not vocab_size or not context_length:
        raise ValueError(f"{path}: GGUF metadata lacks {arch}.context_length or a vocabulary")
    return ModelInfo(path.name.removesuffix(".gguf"), int(vocab_size), int(context_length))


def _hf_info(model_dir: Path) -> ModelInfo:
    config_file = model_dir / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_file}: cannot read the model config: {error}") from error
    max_model_len = config.get("max_position_embeddings")
    if _uses_sliding_window(config) and isinstance(max_model_len, int):
        max_model_len = min(max_model_len, int(config["sliding_window"]))  # as the HF loader caps it
    if not isinstance(config.get("vocab_size"), int) or not isinstance(max_model_len, int):
        raise ValueError(f"{config_file} needs integer vocab_size and max_position_embeddings")
    return ModelInfo(model_dir.name, config["vocab_size"], max_model_len)


def _uses_sliding_window(config: dict[str, Any]) -> bool:
    """Mirrors engine.models.hf_loader (which imports torch): Qwen2 slides only when asked."""
    if not config.get("sliding_window"):
        return False
    if "Qwen2ForCausalLM" in (config.get("architectures") or []) or config.get("model_type") == "qwen2":
        return bool(config.get("use_sliding_window")) or "sliding_attention" in (config.get("layer_types") or [])
    return True
