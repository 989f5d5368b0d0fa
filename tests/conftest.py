"""Session-wide fixtures: the default model loaded once, by us and by the HF oracle."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from engine.models.default_model import default_model_path
    return default_model_path()


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
