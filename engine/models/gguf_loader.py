"""A GGUF file (llama.cpp's format) as a ModelConfig, HF-named fp32 weights and a Tokenizer.

Weights come out exactly as HF transformers' own GGUF loader produces them: HF names, HF layout
(``[out_features, in_features]``), and Q/K rows in HF's rotate-half order (see
``unpermute_rope_rows``). Each is dequantized when first read (``LazyWeights``): a worker serving
the file's own blocks (the quantized kernels) never reads its matrices in fp32, and dequantizing
all of them was ~1 s of CPU per process start (SmolLM2-135M Q4_1, this 2-core VM).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.config import ModelConfig, RopeScaling
from engine.models.gguf_file import GGUFFile, GGUFTensor, read_gguf
from engine.models.tokenizer import Tokenizer
from kernels.quant import QuantRows

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)

# GGUF general.architecture -> HF architecture. Mistral files are written as 'llama'.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_PERMUTED_QK = {"llama"}  # llama.cpp reorders Q/K rows for these; qwen2 is written as is

_BLOCK_FORMATS = {GGMLQuantizationType.Q8_0: "q8_0", GGMLQuantizationType.Q4_0: "q4_0",
                  GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q5_0: "q5_0",
                  GGMLQuantizationType.Q5_1: "q5_1", GGMLQuantizationType.Q4_K: "q4_k",
                  GGMLQuantizationType.Q6_K: "q6_k"}
_FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class LazyWeights(Mapping[str, torch.Tensor]):
    """name -> tensor, each made by its function when first read, then kept; ``shape`` without
    making it. Iterating ``items()`` or ``values()`` makes them all."""

    def __init__(self, makers: dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]]) -> None:
        self._makers = makers
        self._made: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._made.get(name)
        if tensor is None:
            shape, make = self._makers[name]
            tensor = self._made[name] = make()
            assert tuple(tensor.shape) == shape, (name, tuple(tensor.shape), shape)
        return tensor

    def __contains__(self, name: object) -> bool:  # Mapping's would make the tensor
        return name in self._makers

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._makers[name][0]

    def made(self) -> set[str]:
        """The names read so far (dequantized and kept)."""
        return set(self._made)


def load_gguf(path: str | Path) -> tuple[ModelConfig, Mapping[str, torch.Tensor], Tokenizer]:
    """Read ``path`` once and return its config, fp32 weights in HF naming, and tokenizer."""
    config, weights, tokenizer, _ = load_gguf_with_blocks(path)
    return config, weights, tokenizer


def load_gguf_with_blocks(path: str | Path) -> tuple[ModelConfig, LazyWeights, Tokenizer,
                                                        dict[str, QuantRows]]:
    """``load_gguf`` plus the file's own blocks of its matrices (``gguf_blocks``)."""
    gguf_file = read_gguf(path)
    tokenizer = Tokenizer.from_gguf_metadata(gguf_file.metadata)
    tensor_names = [tensor.name for tensor in gguf_file.tensors]
    config = gguf_model_config(gguf_file.metadata, tensor_names, tokenizer,
                               name=Path(path).name.removesuffix(".gguf"))
    return config, gguf_weights(gguf_file, config), tokenizer, gguf_blocks(gguf_file, config)


def gguf_blocks(gguf_file: GGUFFile, config: ModelConfig) -> dict[str, QuantRows]:
    """The matrices stored in a block format the quantized kernels read (Q8_0, Q4_0/1, Q5_0/1, Q4_K,
    Q6_K), HF named, rows in HF order (Q/K rows reordered as whole rows of blocks, which are along
    the inputs); the bytes stay views of the mapped file where no reordering is needed."""
    arch = gguf_file.metadata["general.architecture"]
    blocks: dict[str, QuantRows] = {}
    for tensor in gguf_file.tensors:
        fmt = _BLOCK_FORMATS.get(tensor.ggml_type)
        if fmt is None or len(tensor.shape) != 2:
            continue
        name = hf_weight_name(tensor.name)
        data = tensor.data
        if arch in _PERMUTED_QK and name.endswith("q_proj.weight"):
            data = unpermute_rope_rows(data, config.num_heads)
        elif arch in _PERMUTED_QK and name.endswith("k_proj.weight"):
            data = unpermute_rope_rows(data, config.num_kv_heads)
        blocks[name] = QuantRows(fmt, data, tensor.shape[1])
    return blocks


def gguf_model_config(metadata: dict[str, Any], tensor_names: list[str], tokenizer: Tokenizer,
                      name: str = "model") -> ModelConfig:
    """A ModelConfig from the ``{arch}.*`` metadata keys; eos ids come from the tokenizer."""
    arch = metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHITECTURES)}")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("this GGUF bakes Llama 3.1-style RoPE scaling into a rope_freqs tensor, which is not "
                         "supported; load the model from its HF directory instead")

    def key(suffix: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{suffix}", default)
        if value is None:
            raise ValueError(f"GGUF metadata has no {arch}.{suffix}")
        return value

    hidden_size, num_heads = key("embedding_length"), key("attention.head_count")
    return ModelConfig(
        architecture=_ARCHITECTURES[arch],
        vocab_size=key("vocab_size", len(metadata["tokenizer.ggml.tokens"])),
        hidden_size=hidden_size,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=num_heads,
        num_kv_heads=key("attention.head_count_kv", num_heads),
        head_dim=key("attention.key_length", hidden_size // num_heads),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(metadata, arch),
        max_model_len=key("context_length"),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tokenizer.eos_token_ids,
        name=name,
    )


def gguf_weights(gguf_file: GGUFFile, config: ModelConfig) -> LazyWeights:
    """Every tensor of ``gguf_file`` as fp32, renamed and laid out as HF's state_dict, each
    dequantized when first read."""
    arch = gguf_file.metadata["general.architecture"]
    makers: dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]] = {}
    for tensor in gguf_file.tensors:
        if tensor.ggml_type not in _FLOAT_TYPES:
            try:  # one row now: an unsupported type fails the load, not the tensor's first use
                dequantize(tensor.data[:1], tensor.ggml_type)
            except NotImplementedError as error:
                raise ValueError(f"GGUF tensor {tensor.name} has type {tensor.ggml_type.name}, which "
                                 f"cannot be dequantized: {error}") from error
        name = hf_weight_name(tensor.name)
        num_heads = (config.num_heads if name.endswith(("q_proj.weight", "q_proj.bias")) else
                     config.num_kv_heads if name.endswith(("k_proj.weight", "k_proj.bias")) else None)
        unpermute_heads = num_heads if arch in _PERMUTED_QK else None
        makers[name] = (tuple(int(d) for d in tensor.shape),
                        functools.partial(_dequantized, tensor, unpermute_heads))
    return LazyWeights(makers)


def _dequantized(tensor: GGUFTensor, unpermute_heads: int | None) -> torch.Tensor:
    values = np.ascontiguousarray(dequantize(tensor.data, tensor.ggml_type), dtype=np.float32).reshape(tensor.shape)
    if unpermute_heads is not None:
        values = unpermute_rope_rows(values, unpermute_heads)
    if not values.flags.writeable:  # F32 tensors are views of the read-only file map: own the memory
        values = values.copy()
    return torch.from_numpy(values)


def hf_weight_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")


def unpermute_rope_rows(weight: ArrayT, num_heads: int) -> ArrayT:
    """Undo llama.cpp's Q/K row order, giving HF's (numpy array or torch tensor in, same out).

    weight: [num_heads * head_dim, ...]. Within each head HF puts the two halves of every rotary
    pair half a head apart (rotate_half: row j pairs with row j + head_dim/2); llama.cpp's
    converter interleaves them for its adjacent-pair RoPE::

        gguf row 2j   = HF row j
        gguf row 2j+1 = HF row j + head_dim/2

    The result is a new contiguous array (reshaping the swapped view copies).
    """
    head_dim = weight.shape[0] // num_heads
    rest = tuple(weight.shape[1:])
    swapped = weight.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2)
    result: ArrayT = swapped.reshape(tuple(weight.shape))
    return result


def _rope_scaling(metadata: dict[str, Any], arch: str) -> RopeScaling:
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(metadata[f"{arch}.rope.scaling.factor"]))
    raise ValueError(f"GGUF RoPE scaling {kind!r} is not supported (only 'none' and 'linear')")
