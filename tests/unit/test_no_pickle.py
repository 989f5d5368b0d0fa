"""No code path can unpickle what the network sends: an ``ast`` scan of engine/, services/,
kernels/ and loadtests/.

The rules (what the scanner flags):

- importing ``pickle``, ``_pickle``, ``cPickle``, ``dill``, ``cloudpickle``, ``marshal``,
  ``shelve`` or ``joblib`` at all (so ``pickle.loads`` and friends cannot be reached);
- ``torch.load`` / ``torch.serialization.load`` unless the call says ``weights_only=True``
  literally. That mode refuses anything but tensors and plain containers, and the accepted use
  is a local file the operator put there (a checkpoint), never bytes from a socket;
- ``numpy.load(..., allow_pickle=<anything but False>)`` (numpy's default is False);
- ``yaml.load`` / ``yaml.load_all`` without ``Loader=SafeLoader`` (or ``CSafeLoader`` /
  ``BaseLoader``), and ``yaml.unsafe_load`` / ``yaml.full_load`` in any form;
- any ``read_pickle`` call (pandas), and ``ray.put`` anywhere.

Ray pickles its own actor arguments and handles; that is Ray's business. Ours: hand Ray only
our config dataclasses and address strings, never bytes that came from a client or a peer
(the Ray ingress proxies HTTP to the router; KV moves worker to worker) — hence no ``ray.put``.
Wire formats are protobuf (services/common/wire.py) and raw KV bytes with a checked header.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("engine", "services", "kernels", "loadtests")
PICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader"}


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted module path it stands for (``np`` -> ``numpy``)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                names[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_constant(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _call_problem(call: ast.Call, name: str) -> str | None:
    if name in ("torch.load", "torch.serialization.load"):
        if not _is_constant(_keyword(call, "weights_only"), True):
            return f"{name} without weights_only=True"
    elif name in ("numpy.load",):
        allow = _keyword(call, "allow_pickle")
        if allow is not None and not _is_constant(allow, False):
            return "numpy.load with allow_pickle"
    elif name in ("yaml.load", "yaml.load_all"):
        loader = _keyword(call, "Loader")
        if loader is None and len(call.args) > 1:
            loader = call.args[1]
        loader_name = loader.attr if isinstance(loader, ast.Attribute) else getattr(loader, "id", "")
        if loader_name not in SAFE_YAML_LOADERS:
            return f"{name} without a safe Loader"
    elif name in ("yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all", "yaml.full_load_all"):
        return name
    elif name.endswith("read_pickle") or name == "ray.put":
        return name
    return None


def scan_source(source: str, filename: str = "<snippet>") -> list[str]:
    """Every rule broken in ``source``, as ``file:line: what``."""
    tree = ast.parse(source, filename=filename)
    aliases = _aliases(tree)
    problems = []
    for node in ast.walk(tree):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        for module in modules:
            if module.split(".")[0] in PICKLING_MODULES:
                problems.append(f"{filename}:{node.lineno}: imports {module}")
        if isinstance(node, ast.Call):
            problem = _call_problem(node, _dotted(node.func, aliases))
            if problem is not None:
                problems.append(f"{filename}:{node.lineno}: {problem}")
    return problems


def test_no_code_unpickles_anything():
    problems = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            problems += scan_source(path.read_text(), str(path.relative_to(ROOT)))
    assert problems == []


def test_the_scanner_flags_every_rule():
    """Positive control: each forbidden form is caught, through aliases too."""
    flagged = {
        "import pickle": "imports pickle",
        "import cloudpickle as cp": "imports cloudpickle",
        "from dill import loads": "imports dill",
        "import marshal, shelve": "imports marshal",
        "import torch\ntorch.load(path)": "torch.load without weights_only=True",
        "import torch\ntorch.load(buf, weights_only=False)": "torch.load without weights_only=True",
        "from torch import load\nload(f, weights_only=flag)": "torch.load without weights_only=True",
        "import numpy as np\nnp.load(f, allow_pickle=True)": "numpy.load with allow_pickle",
        "import yaml\nyaml.load(text)": "yaml.load without a safe Loader",
        "import yaml\nyaml.load(text, Loader=yaml.Loader)": "yaml.load without a safe Loader",
        "import yaml\nyaml.unsafe_load(text)": "yaml.unsafe_load",
        "import pandas as pd\npd.read_pickle(p)": "pandas.read_pickle",
        "import ray\nray.put(body)": "ray.put",
    }
    for snippet, problem in flagged.items():
        found = scan_source(snippet)
        assert any(problem in p for p in found), (snippet, found)


def test_the_scanner_passes_the_safe_forms():
    safe = ("import torch\ntorch.load(path, weights_only=True)",
            "import numpy as np\nnp.load(path)\nnp.load(path, allow_pickle=False)",
            "import yaml\nyaml.safe_load(text)\nyaml.load(text, Loader=yaml.SafeLoader)",
            "from yaml import CSafeLoader, load\nload(text, CSafeLoader)",
            "import json\njson.loads(text)\nmodel.load_state_dict(state)")
    for snippet in safe:
        assert scan_source(snippet) == [], snippet
