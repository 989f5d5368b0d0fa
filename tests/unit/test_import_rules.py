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
        "import services.router.pipeline.frontend, services.router.http.server, services.router.grpc.servicer\n"
        "import services.router.backends.disaggregated, services.router.routing.policy, services.router.app\n"
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


# ---- module boundaries: private names and import cycles ----------------------------------------

FIRST_PARTY = ("engine", "services", "kernels", "loadtests")
# namedtuple's public API is spelled with an underscore
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make"}
# The one allowed use: kernels/compile_check.py lowers each kernel module's JIT kernels for a GPU
# target (a check of the kernels package by itself). The test fails on any use not listed here.
KNOWN_PRIVATE_USES = {
    *(("kernels/compile_check.py", f".{name}") for name in (
        "_paged_attention_kernel", "_reduce_splits_kernel", "_rms_norm_kernel", "_silu_and_mul_kernel",
        "_rotary_kernel", "_rotary_store_kv_kernel", "_store_kv_kernel", "_store_kv_quant_kernel",
        "_copy_blocks_kernel", "_quant_gemv_kernel", "_gemv_kernel", "_greedy_kernel")),
}
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def _first_party_files() -> dict[str, Path]:
    """Module name -> file, for every first-party module (generated protobuf code aside)."""
    modules = {}
    for package in FIRST_PARTY:
        for path in (ROOT / package).rglob("*.py"):
            if "gen" in path.relative_to(ROOT).parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _private_uses(path: Path) -> list[tuple[int, str]]:
    """``from first_party import _name``, and ``obj._name`` for a ``_name`` this module does not
    define itself (``self._x`` / ``cls._x`` are the module's own)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
    uses = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.ImportFrom) and node.level == 0
                and (node.module or "").split(".")[0] in FIRST_PARTY):
            uses += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                     if a.name.startswith("_") and not a.name.startswith("__")]
        elif (isinstance(node, ast.Attribute) and node.attr.startswith("_")
              and not node.attr.startswith("__") and node.attr not in own | PUBLIC_UNDERSCORE
              and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            uses.append((node.lineno, f".{node.attr}"))
    return uses


def test_no_module_uses_another_modules_private_names():
    """A leading underscore means "this module's own": another module (another room of
    services/router, another package) calls only public names. The router's local and
    migration paths once called ``DisaggregatedBackend._remote`` / ``_pick``."""
    offenders = []
    for path in _first_party_files().values():
        file = str(path.relative_to(ROOT))
        offenders += [f"{file}:{line} {name}" for line, name in _private_uses(path)
                      if (file, name) not in KNOWN_PRIVATE_USES]
    assert offenders == []


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """First-party modules ``module`` imports anywhere (top level, TYPE_CHECKING, functions)."""
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {resolve(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[:len(module.split(".")) - (path.name != "__init__.py")]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found |= {resolve(f"{base}.{a.name}") for a in node.names}
    return {m for m in found if m is not None and m != module}


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(tuple(sorted(component)))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles_between_modules():
    """No two modules import each other, directly or around a loop, even under TYPE_CHECKING
    or inside a function: a cycle means two concerns were never separated."""
    modules = _first_party_files()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert all("services.router.backends.disaggregated" in graph[m]
               for m in ("services.router.app",))  # the graph sees function-level imports
    assert sorted(set(_cycles(graph)) - KNOWN_CYCLES) == []


# services/router's rooms, top to bottom (services/router/__init__.py): a module imports only
# modules of its own room or of rooms below it.
ROUTER_ROOMS = [
    {"__main__", "app", "limit_flags", "client"},
    {"http", "grpc"},
    {"tools"},
    {"pipeline"},
    {"backends"},
    {"routing"},
    {"errors", "deadline", "metrics", "model_info"},
]


def test_router_rooms_import_only_downwards():
    def rank(module: str) -> int:
        first = module.removeprefix("services.router.").split(".")[0]
        return next(i for i, room in enumerate(ROUTER_ROOMS) if first in room)

    modules = _first_party_files()
    offenders = []
    for module, path in modules.items():
        if not module.startswith("services.router.") or module.endswith("__init__"):
            continue
        for imported in _imports(module, path, modules):
            if imported.startswith("services.router.") and rank(imported) < rank(module):
                offenders.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert offenders == []
