"""Session-wide fixtures (the default model loaded once, by us and by the HF oracle) and the
markers every test gets from where it lives and what it starts:

- ``cluster``: the module starts real service processes (a worker, router, kvstore or
  ``pdserve up`` child, a gRPC server child, Ray Serve); ``pytest -m "not cluster"`` runs the
  in-process rest. A module is one when its source calls a process-starting helper or starts
  such a child (``CLUSTER_SOURCE``); a test the rule misses can say ``@pytest.mark.cluster``.
- ``gpu``: needs CUDA; every test under ``tests/gpu/`` or using the ``cuda_device`` fixture.
  Without CUDA they are skipped, with the reason.
- ``slow`` stays as the modules set it (end-to-end tests, the oracle model).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest

# Set on a machine that cannot have the default GGUF (the GPU check, ``loadtests/gpu/run.sh``): tests that
# need it skip with the reason instead of erroring. Unset (``make test``), a missing model fails.
ALLOW_NO_DEFAULT_MODEL_ENV = "PDSERVE_TESTS_ALLOW_NO_DEFAULT_MODEL"


# What starts a service process in a test module's source: the cluster helpers of
# tests/integration (cluster_fixtures, auth_cluster) and loadtests.cluster, a child running
# `python -m services.cli ...`, a gRPC server child (`-c SERVER`), spawned server processes, Ray.
CLUSTER_SOURCE = re.compile(
    r"\b(start_worker|start_router|start_kvstore|up_cluster|running_cluster|start_cluster)\("
    r"|Popen\(.{0,200}?\"services\.cli\""
    r"|\"-c\", SERVER\b"
    r"|get_context\(\"spawn\"\)"
    r"|\bray\.init\(", re.DOTALL)
GPU_DIR = Path(__file__).parent / "gpu"


@functools.cache
def _starts_services(path: Path) -> bool:
    return CLUSTER_SOURCE.search(path.read_text()) is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath))
        if path.suffix == ".py" and _starts_services(path):
            item.add_marker(pytest.mark.cluster)
        if GPU_DIR in path.parents or "cuda_device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.gpu)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False here")
            for item in gpu_items:
                item.add_marker(skip)


@pytest.fixture
def cuda_device():
    """``torch.device("cuda")`` for a test that needs a GPU (it is marked ``gpu``; skipped without CUDA)."""
    import torch

    return torch.device("cuda")


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
