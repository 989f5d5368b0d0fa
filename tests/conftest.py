"""Session-wide fixtures: the default model loaded once, by us and by the HF oracle."""

from __future__ import annotations

import os

import pytest

# Set on a machine that cannot have the default GGUF (the GPU check, ``loadtests/gpu/run.sh``): tests that
# need it skip with the reason instead of erroring. Unset (``make test``), a missing model fails.
ALLOW_NO_DEFAULT_MODEL_ENV = "PDSERVE_TESTS_ALLOW_NO_DEFAULT_MODEL"


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from engine.models.default_model import default_model_path
    try:
        return default_model_path()
    except FileNotFoundError as error:
        if os.environ.get(ALLOW_NO_DEFAULT_MODEL_ENV) == "1":
            pytest.skip(f"the default model is not installed here ({error})")
        raise


@pytest.fixture(scope="session")
def loaded_model(default_model_path):
    from engine.models.loader import load_model
    return load_model(default_model_path)


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    """HF transformers on the same GGUF weights, fp32 on CPU: the correctness oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def parity_prompts(loaded_model) -> list[list[int]]:
    """The HF parity prompts' token ids (tests/integration/hf_parity.py), one of ~1,000 tokens."""
    from tests.integration.hf_parity import parity_prompts as build

    prompts = build(loaded_model.tokenizer)
    assert max(len(p) for p in prompts) >= 900, "the long-context prompt must be ~1,000 tokens"
    return prompts


@pytest.fixture(scope="session")
def hf_greedy(hf_model, parity_prompts) -> list[list[int]]:
    """HF's greedy tokens for each parity prompt: built once for the fp32 and the q4 parity tests."""
    from tests.integration.hf_parity import hf_greedy_tokens

    return hf_greedy_tokens(hf_model, parity_prompts)


def _embedded_redis():
    from services.index.redis_server import EmbeddedRedis

    with EmbeddedRedis.start() as server:
        yield server


@pytest.fixture
def redis_server():
    """A real, empty ``redis-server`` on a free loopback port for one test (``.url``; ``.kill()``
    then ``.restart()`` simulates a crash: it comes back empty on the same port)."""
    yield from _embedded_redis()


@pytest.fixture(scope="module")
def module_redis_server():
    """The same, shared by one module's tests (for a module-scoped cluster that publishes to it)."""
    yield from _embedded_redis()
