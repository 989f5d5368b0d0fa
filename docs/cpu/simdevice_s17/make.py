"""A 1-layer, 512-token byte-level BPE model: its CPU forward is ~free, so a simulated device's
time (sitecustomize FAKE_DEV) is what a step costs."""
import glob
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

d = Path("/tmp/simdevice-model")
d.mkdir(exist_ok=True)
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train(sorted(glob.glob("docs/*.md")), trainer)
tok.save(str(d / "tokenizer.json"))
(d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
cfg = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=100000.0,
                  max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.02)
torch.manual_seed(0)
LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
print(tok.get_vocab_size())
