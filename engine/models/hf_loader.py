"""An HF-format model directory (config.json + *.safetensors) as a ModelConfig and fp32 weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine.config import ModelConfig, RopeScaling
from engine.models.tokenizer import Tokenizer, read_json_object

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def load_hf(model_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read ``model_dir``'s config.json, tokenizer files and safetensors weights."""
    model_dir = Path(model_dir)
    config_json = _read_config(model_dir)
    tokenizer = Tokenizer.from_hf_dir(model_dir)
    config = hf_model_config(config_json, tokenizer, model_dir)
    return config, load_hf_weights(model_dir, config), tokenizer


def hf_model_config(config: dict[str, Any], tokenizer: Tokenizer, model_dir: Path) -> ModelConfig:
    """A ModelConfig from a parsed config.json; eos ids come from the tokenizer.

    Both config spellings are read: transformers 5's ``rope_parameters`` and the older top-level
    ``rope_theta`` + ``rope_scaling``. A sliding attention window (Mistral) caps ``max_model_len``,
    since within the window sliding and full attention agree.
    """
    architecture = _architecture(config, model_dir)
    if config.get("mlp_bias") or (architecture != "Qwen2ForCausalLM" and config.get("attention_bias")):
        raise ValueError(f"{model_dir / 'config.json'}: attention_bias / mlp_bias on {architecture} "
                         "(bias on o_proj or the MLP) is not supported")
    hidden_size, num_heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    max_model_len = _int(config, "max_position_embeddings")
    if _uses_sliding_window(config, architecture):
        max_model_len = min(max_model_len, int(config["sliding_window"]))
    return ModelConfig(
        architecture=architecture,
        vocab_size=_int(config, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_int(config, "intermediate_size"),
        num_layers=_int(config, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=_rope_scaling(rope, model_dir),
        max_model_len=max_model_len,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=architecture == "Qwen2ForCausalLM",
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tokenizer.eos_token_ids,
        name=model_dir.resolve().name,
    )


def load_hf_weights(model_dir: str | Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All safetensors shards of ``model_dir`` as fp32, HF names; no ``lm_head.weight`` when tied."""
    model_dir = Path(model_dir)
    weights: dict[str, torch.Tensor] = {}
    for shard in _safetensors_files(model_dir):
        for name, tensor in load_file(str(shard)).items():
            if name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved
                continue
            weights[name] = tensor.to(torch.float32)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(path) for path in files if not path.is_file()]
        if missing:
            raise ValueError(f"{index} names shards that are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights (pytorch_model.bin is not supported; "
                         "re-save the model with save_pretrained(..., safe_serialization=True))")
    return files


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} is not an HF model directory: it has no config.json")
    return read_json_object(path)


def _architecture(config: dict[str, Any], model_dir: Path) -> str:
    model_type = str(config.get("model_type"))
    names = config.get("architectures") or [_MODEL_TYPES.get(model_type, model_type)]
    supported = [str(name) for name in names if name in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ValueError(f"{model_dir / 'config.json'}: architecture {names} is not supported; "
                         f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    return supported[0]


def _int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"config.json needs an integer {key!r}, got {value!r}")
    return value


def _uses_sliding_window(config: dict[str, Any], architecture: str) -> bool:
    if not config.get("sliding_window"):
        return False
    if architecture == "Qwen2ForCausalLM":  # Qwen2 applies it only when asked to
        return bool(config.get("use_sliding_window")) or "sliding_attention" in (config.get("layer_types") or [])
    return True


def _rope_scaling(rope: dict[str, Any], model_dir: Path) -> RopeScaling:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling(kind="llama3", factor=float(rope["factor"]),
                           low_freq_factor=float(rope["low_freq_factor"]),
                           high_freq_factor=float(rope["high_freq_factor"]),
                           original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    raise ValueError(f"{model_dir / 'config.json'}: RoPE scaling {kind!r} is not supported "
                     "(only default, 'linear' and 'llama3')")
