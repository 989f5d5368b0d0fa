"""The HF parity workload shared by the fp32 and the q4 parity tests: eight prompts (one of
~1,000 tokens) and HF transformers' greedy continuation of each.

``tests/conftest.py`` builds both once per session (fixtures ``parity_prompts`` and
``hf_greedy``): HF's greedy decoding of 8 x 64 tokens is the slow part of both modules' setup.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

import torch

from engine import SamplingParams

NUM_NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS)


def parity_prompts(tokenizer: Any) -> list[list[int]]:
    """Token ids of the 8 prompts: chat, code, plain text, and a ~1,000-token long context."""
    chat = lambda text: tokenizer.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    long_context = inspect.getsource(textwrap)[:4200]
    return [
        chat("What is the capital of France?"),
        chat("Write a haiku about the sea."),
        chat("Explain in two sentences why the sky is blue."),
        tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
        tokenizer.encode("#include <stdio.h>\n\nint main(void) {\n"),
        tokenizer.encode("The three primary colours are"),
        chat("Summarise this code:\n" + long_context[:600]),
        tokenizer.encode(long_context + "\n\n# The function above"),
    ]


def hf_greedy_tokens(hf_model: Any, prompts: list[list[int]]) -> list[list[int]]:
    """HF's greedy continuation (at most NUM_NEW_TOKENS, stopping at its EOS ids) of each prompt."""
    eos = hf_model.generation_config.eos_token_id
    outputs = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                                    eos_token_id=list(eos if isinstance(eos, list) else [eos]))
        outputs.append(out[0, len(ids):].tolist())
    return outputs
