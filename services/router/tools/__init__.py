"""Tool calling on chat completions: the request's ``tools`` and ``tool_choice`` (spec.py), the
history rendered for a chat template that does not know tools (render.py), and the model's
Hermes-style ``<tool_call>`` output parsed into OpenAI ``tool_calls``, whole or as stream deltas
(hermes.py)."""
