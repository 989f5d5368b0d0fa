"""A fixed offline workload for a paired before/after timing: batch-1 and batch-16 greedy decode."""
import torch

from engine import LLM, SamplingParams
from engine.models.default_model import default_model_path
from engine.models.loader import load_model

torch.set_num_threads(2)
llm = LLM(load_model(default_model_path()))
words = "the quick brown fox jumps over the lazy dog and keeps running through the field".split()
prompts = [" ".join(words[i % 7:] + words[:i % 7]) * (1 + i % 3) for i in range(16)]
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:1], params)
llm.generate(prompts, params)
