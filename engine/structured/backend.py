"""The grammar engine: xgrammar, bound to this model's vocabulary.

Why xgrammar and not llguidance (both maintained, both used by vLLM and SGLang). Measured on
the default model's tokenizer (SmolLM2, 49,152 tokens, byte-level BPE), the project's shared
2-core dev box, xgrammar 0.2.8 vs llguidance 1.9.1, one thread each:

    =============================  ==============  ===============
    what                           xgrammar        llguidance
    =============================  ==============  ===============
    tokenizer info, built once     66 ms           276 ms
    compile: JSON schemas (4)      0.7 - 28 ms     0.9 - 1.4 ms
    compile: json_object / regex   7.3 / 0.8 ms    0.5 / 1.3 ms
    compile: EBNF grammar          0.1 ms          1.0 ms
    mask fill, one request/step    2 us median,    17-27 us median,
                                   66 us max       1.8 ms max
    mask fill, 16 requests/step    17 us median    251 us median
    =============================  ==============  ===============

The mask is filled every step for every constrained row, on the step's critical path on a CPU
worker; a compile happens once per distinct constraint, off the step loop and cached. xgrammar
pays at compile time (it precomputes which tokens each grammar position admits) so that the
per-step fill is ~10x cheaper, which is the cost that scales with traffic. It also enforces
more of JSON Schema than we found llguidance to (``uniqueItems``, ``patternProperties``,
formats; ``schema_check.py`` lists what it does not), and its matcher rolls back any number of
tokens (speculative drafts).

``GrammarBackend.compile(params)`` is the only function that touches xgrammar's compiler; its
errors come back as ``StructuredOutputError`` naming ``params.field_name``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import xgrammar as xgr

from engine.models.tokenizer import Tokenizer
from engine.structured.errors import StructuredOutputError
from engine.structured.formats import exact_formats
from engine.structured.params import StructuredOutputsParams
from engine.structured.schema_check import check_schema

# xgrammar's C++ errors start with "[hh:mm:ss] /project/cpp/file.cc:123: "
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarBackend:
    """xgrammar's compiler over one tokenizer. Thread-safe: compiles may run concurrently."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        """``vocab_size``: the model's logits width (may exceed the tokenizer's: padding)."""
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        encoded: list[str] = [""] * max(len(vocab), max(vocab.values(), default=-1) + 1)
        for token, token_id in vocab.items():
            encoded[token_id] = token
        self.info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                      stop_token_ids=list(stop_token_ids), add_prefix_space=False)
        # xgrammar's own cache stays off: ``compiler.py`` keeps a bounded one keyed by hash
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile a validated constraint. Raises StructuredOutputError (bad or unsupported)."""
        kind, field = params.kind, params.field_name
        check_schema(params)
        try:
            if kind == "json":
                # compact JSON (vLLM's disable_any_whitespace): a small model left free to emit
                # whitespace between tokens can loop on it until max_tokens
                return self._compiler.compile_json_schema(json.dumps(exact_formats(params.schema())),
                                                          any_whitespace=False, strict_mode=params.strict)
            if kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                          strict_mode=False)
            if kind == "regex":
                return self._compiler.compile_regex(str(params.regex))
            if kind == "choice":
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice or ())
                return self._compiler.compile_grammar(f"root ::= {alternatives}")
            return self._compiler.compile_grammar(str(params.grammar))
        except (RuntimeError, ValueError) as e:
            raise StructuredOutputError(field, f"does not compile: {_clean(str(e))}") from None


def _clean(message: str) -> str:
    return _LOG_PREFIX.sub("", message.strip()).strip()
