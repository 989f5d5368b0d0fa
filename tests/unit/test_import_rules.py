"""The layering rules of DESIGN.md, checked: engine/ imports no network code, and the router's
disaggregated path (what a router process loads) never imports torch."""

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


def test_router_disaggregated_path_is_torch_free():
    code = (
        "import sys\n"
        "import services.router.frontend, services.router.openai_http, services.router.grpc_frontend\n"
        "import services.router.disaggregated, services.router.policy\n"
        "import engine.sampling_params, engine.kv_cache.hashing, engine.models.tokenizer\n"
        "import engine.sampling.detokenizer\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
