"""pdserve's inference core. ``from engine import LLM, EngineArgs, SamplingParams``."""

from engine.args import EngineArgs
from engine.sampling_params import SamplingParams


def __getattr__(name: str) -> type:
    # LLM pulls in torch and the model code; keep `import engine` light for the router.
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "EngineArgs", "SamplingParams"]
