"""Fixtures shared by unit-test modules: the default model's tokenizer and a constraint compiler
over it (module-scoped; closed after the module). A module may define its own ``tokenizer``."""

from __future__ import annotations

import pytest

from engine.models.loader import load_tokenizer
from engine.structured.compiler import ConstraintCompiler


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = ConstraintCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    yield compiler
    compiler.close()
