"""Helpers for the loader and tokenizer tests: tiny models written as GGUF files and HF directories."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, TokenType
from gguf.quants import quantize

from kernels.quant import quantize_q4_k, quantize_q6_k

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
                   " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|im_start|>assistant\n' }}{% endif %}")

# One of every supported storage type, so each dequantization path runs (rows are 64 or 128 wide,
# a multiple of the 32-element quantization blocks). q_proj stays F32 so its un-permutation is exact.
TINY_GGUF_TYPES = {
    "token_embd": T.Q8_0, "output": T.Q4_1, "output_norm": T.F32,
    "attn_norm": T.F32, "ffn_norm": T.F32,
    "attn_q": T.F32, "attn_k": T.F16, "attn_v": T.Q4_0, "attn_output": T.Q4_1,
    "ffn_gate": T.Q8_0, "ffn_up": T.F16, "ffn_down": T.Q4_0,
}
_HF_LEAF = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes Q/K in: each head's rotary halves interleaved."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges): the 256 byte symbols, three merged tokens, three control tokens."""
    symbols = {}
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    for byte in range(256):
        symbols[byte] = chr(byte) if byte in printable else chr(next(extra))
    tokens = [symbols[b] for b in range(256)] + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [TokenType.NORMAL] * 259 + [TokenType.CONTROL] * 3
    return tokens, [int(t) for t in types], ["Ġ t", "h e", "Ġt he"]


def write_tiny_gguf(path: Path, arch: str = "llama", *, tied: bool = False, num_layers: int = 2,
                    hidden: int = 64, inner: int = 128, num_heads: int = 4, num_kv_heads: int = 2,
                    add_bos: bool = False, extra_tensors: tuple[str, ...] = (),
                    seed: int = 0, types: dict[str, T] | None = None) -> dict[str, torch.Tensor]:
    """Write a random Llama-family GGUF as llama.cpp would (Q/K permuted for 'llama', biases for
    'qwen2') and return the HF-layout weights it was made from (before quantization). ``types``
    overrides TINY_GGUF_TYPES per kind (the K-quants need rows a multiple of 256 wide)."""
    storage = {**TINY_GGUF_TYPES, **(types or {})}
    tokens, token_types, merges = tiny_vocab()
    rng = np.random.default_rng(seed)
    head_dim = hidden // num_heads
    shapes = {"token_embd": (len(tokens), hidden), "output_norm": (hidden,)}
    if not tied:
        shapes["output"] = (len(tokens), hidden)
    layer_shapes = {"attn_norm": (hidden,), "ffn_norm": (hidden,), "attn_q": (num_heads * head_dim, hidden),
                    "attn_k": (num_kv_heads * head_dim, hidden), "attn_v": (num_kv_heads * head_dim, hidden),
                    "attn_output": (hidden, num_heads * head_dim), "ffn_gate": (inner, hidden),
                    "ffn_up": (inner, hidden), "ffn_down": (hidden, inner)}
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(num_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inner)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML_TEMPLATE)

    hf_weights: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, hf_name: str, kind: str, shape: tuple[int, ...], permute_heads: int = 0) -> None:
        values = rng.standard_normal(shape).astype(np.float32) * 0.5
        hf_weights[hf_name] = torch.from_numpy(values.copy())
        if permute_heads:
            values = llama_cpp_permute(values, permute_heads)
        qtype = storage.get(kind, T.F32)
        if qtype in (T.Q4_K, T.Q6_K):  # gguf-py cannot quantize to the K-quants
            stored = (quantize_q4_k if qtype == T.Q4_K else quantize_q6_k)(torch.from_numpy(values)).data
        else:
            stored = values if qtype == T.F32 else quantize(values, qtype)
        writer.add_tensor(gguf_name, stored, raw_shape=stored.shape, raw_dtype=qtype)

    add("token_embd.weight", "model.embed_tokens.weight", "token_embd", shapes["token_embd"])
    add("output_norm.weight", "model.norm.weight", "output_norm", shapes["output_norm"])
    if not tied:
        add("output.weight", "lm_head.weight", "output", shapes["output"])
    for i in range(num_layers):
        for kind, shape in layer_shapes.items():
            heads = {"attn_q": num_heads, "attn_k": num_kv_heads}.get(kind, 0) if arch == "llama" else 0
            add(f"blk.{i}.{kind}.weight", f"model.layers.{i}.{_HF_LEAF[kind]}.weight", kind, shape, heads)
        if arch == "qwen2":
            for kind in ("attn_q", "attn_k", "attn_v"):
                add(f"blk.{i}.{kind}.bias", f"model.layers.{i}.{_HF_LEAF[kind]}.bias", "bias", layer_shapes[kind][:1])
    for name in extra_tensors:  # tensors a Llama has no place for, for error tests
        writer.add_tensor(name, np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf_weights


def save_tiny_hf_model(model_dir: Path, architecture: str, tokenizer_dir: Path | None = None,
                       **config_overrides) -> torch.nn.Module:
    """A random 2-layer model of ``architecture`` saved with save_pretrained (safetensors) into
    ``model_dir``, plus the tokenizer files of ``tokenizer_dir``. Returns the model."""
    import transformers

    config_class = {"LlamaForCausalLM": transformers.LlamaConfig, "MistralForCausalLM": transformers.MistralConfig,
                    "Qwen2ForCausalLM": transformers.Qwen2Config}[architecture]
    settings = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=49152, max_position_embeddings=4096)
    settings.update(config_overrides)
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config_class(**settings)).eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    if tokenizer_dir is not None:
        for file in Path(tokenizer_dir).iterdir():
            shutil.copy(file, model_dir / file.name)
    return model
