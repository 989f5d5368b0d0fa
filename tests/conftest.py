"""Session-wide fixtures (the default model loaded once, by us and by the HF oracle) and the
markers every test gets from where it lives and what it starts:

- ``cluster``: the module starts real service processes (a worker, router, kvstore or
  ``pdserve up`` child, a gRPC server child, Ray Serve); ``pytest -m "not cluster"`` runs the
  in-process rest. A module is one when its source calls a process-starting helper or starts
  such a child (``CLUSTER_SOURCE``); a test the rule misses can say ``@pytest.mark.cluster``.
- ``gpu``: needs CUDA; every test under ``tests/gpu/`` or using the ``cuda_device`` fixture.
  Without CUDA they are skipped, with the reason.
- ``slow`` stays as the modules set it (end-to-end tests, the oracle model).

``make test`` runs the tests on two pytest-xdist workers (``-n``; ``PYTEST_WORKERS=0`` for one
process): while one waits on the processes a cluster test starts, another computes.
``ModuleScheduling`` (below) hands out whole modules, so a module's fixtures (its cluster) exist
once and its tests run in order on one worker; the modules that use the HF oracle
(``HF_ORACLE_MODULES``) go together, so it is loaded and run once; slow
modules first, so no long one is left for the end. Each worker computes on its share of the cores
(``OMP_NUM_THREADS``: torch, OpenBLAS and the engine's default ``num_threads`` read it; the
processes a test starts inherit it, and most take ``--num-threads`` anyway): two workers whose
pools each spanned both cores spent the cores spinning for each other (the HF parity module took
214 CPU-seconds beside another worker, 112 alone; an OpenBLAS thread spins ~0.1 s after each
call). OpenMP also spins briefly (``GOMP_SPINCOUNT``, as ``pdserve up`` sets it for workers
sharing cores).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
REPO = Path(__file__).resolve().parents[1]
GPU_DIR = Path(__file__).parent / "gpu"
HF_ORACLE_FIXTURES = {"hf_model", "hf_greedy"}
# the modules that use them (checked at collection): one xdist work unit
HF_ORACLE_MODULES = frozenset({"tests/integration/test_parity_hf.py", "tests/integration/test_quant_parity_hf.py",
                               "tests/unit/test_loader.py"})
SLOW_SOURCE = re.compile(r"pytest\.mark\.slow\b")
# pytest-xdist's worker count in a worker process (unset in a plain run)
NUM_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
# services.launcher.plan.SHARED_CORES_SPIN_COUNT's value; not imported from there, since that module
# imports torch, and libgomp reads the variable once, as torch loads it
if NUM_XDIST_WORKERS > 1:
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // NUM_XDIST_WORKERS)))


@functools.cache
def _starts_services(path: Path) -> bool:
    return CLUSTER_SOURCE.search(path.read_text()) is not None


def _work_unit(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return "hf_oracle" if module in HF_ORACLE_MODULES else module


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The xdist controller's scheduler: whole modules (module docstring)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

        def schedule(self) -> None:
            first = self.collection is None
            super().schedule()  # fills the queue and sends each worker its first units
            if first and self.workqueue:
                units = sorted(self.workqueue.items(), key=lambda unit: not _is_slow(unit[0]))
                self.workqueue.clear()
                self.workqueue.update(units)

    config.option.loadscopereorder = False  # collection order, then slow modules first (above)
    return ModuleScheduling(config, log)


def _is_slow(unit: str) -> bool:
    paths = HF_ORACLE_MODULES if unit == "hf_oracle" else [unit]
    return any(SLOW_SOURCE.search((REPO / path).read_text()) for path in paths)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    oracle_users = {item.nodeid.split("::")[0] for item in items
                    if HF_ORACLE_FIXTURES & set(getattr(item, "fixturenames", ()))}
    if not oracle_users <= HF_ORACLE_MODULES:
        raise pytest.UsageError(f"add {sorted(oracle_users - HF_ORACLE_MODULES)} to tests/conftest.py's "
                                "HF_ORACLE_MODULES (the HF oracle's modules run on one xdist worker)")
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
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Inside: the ``gguf`` package's file reader and tensor-name map are built once per argument.
    transformers parses the file's header twice (for the config, then the tensors) and builds the
    name map once per module (397 times): 10 of its 17.5 s load here (2 cores, alone). Only
    repeated work goes; what transformers makes of the file is its own."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(reader)
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


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
