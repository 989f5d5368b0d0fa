"""The layering rules of DESIGN.md, checked: engine/ imports no network code, the router's
disaggregated path (what a router process loads) never imports torch, and services use the
engine only through its named API (AsyncEngine, EngineCore's public methods)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NETWORK_MODULES = {"grpc", "redis", "aiohttp", "fastapi", "uvicorn", "requests", "httpx", "services"}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_engine_imports_no_network_code():
    offenders = {str(p.relative_to(ROOT)): sorted(_imported_modules(p) & NETWORK_MODULES)
                 for p in (ROOT / "engine").rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_kernels_import_nothing_from_the_engine():
    """kernels/ is the bottom layer: the engine picks its kernels, never the other way round."""
    offenders = {str(p.relative_to(ROOT)): sorted(_imported_modules(p) & {"engine", "services"})
                 for p in (ROOT / "kernels").rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_router_disaggregated_path_is_torch_free():
    code = (
        "import sys\n"
        "import services.router.frontend, services.router.openai_http, services.router.grpc_frontend\n"
        "import services.router.disaggregated, services.router.policy, services.router.app\n"
        "import services.worker.stats\n"
        "import engine.sampling_params, engine.kv_cache.hashing, engine.models.tokenizer\n"
        "import engine.sampling.detokenizer\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# EngineCore's parts: a service that reads these from the event-loop thread races the engine
# thread, and couples itself to the scheduler's layout.
ENGINE_INTERNALS = {"scheduler", "block_pool", "kv_manager", "runner", "spec"}


def _is_core(node: ast.expr) -> bool:
    """``core``, ``c`` in ``call(lambda c: ...)``, or ``<anything>.core``."""
    return ((isinstance(node, ast.Name) and node.id in ("core", "c"))
            or (isinstance(node, ast.Attribute) and node.attr == "core"))


def test_services_reach_no_engine_internals():
    offenders = []
    for path in (ROOT / "services").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS and _is_core(node.value):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert offenders == []


def test_services_hold_the_engine_only_in_async_engine():
    """Only AsyncEngine keeps an EngineCore; everything else asks it (``core`` attributes
    elsewhere would let handlers bypass it)."""
    offenders = []
    for path in (ROOT / "services").rglob("*.py"):
        if path.name == "async_engine.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "core":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_one_cdiv():
    """Ceiling division is engine.mathutils.cdiv everywhere outside kernels/ (which imports
    nothing from the engine and keeps triton's)."""
    from engine.mathutils import cdiv, round_up

    assert [cdiv(n, 16) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]
    assert [round_up(n, 32) for n in (0, 1, 32, 33)] == [0, 32, 32, 64]
    offenders = []
    for package in ("engine", "services", "loadtests"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "mathutils.py":
                continue
            text = path.read_text()
            if "-(-" in text or "def cdiv" in text or "def _cdiv" in text:
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_services_import_no_private_engine_names():
    """``from engine.x import _name`` (or ``engine_module._name``) in services/ couples a service
    to an engine detail; the engine's public names are its API."""
    offenders = []
    for path in (ROOT / "services").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        engine_modules: set[str] = set()  # local names bound to engine modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "engine":
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}"
                              for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Import):
                engine_modules.update(a.asname or a.name.split(".")[0] for a in node.names
                                      if a.name.split(".")[0] == "engine")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and _root_name(node) in engine_modules):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert offenders == []


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None
