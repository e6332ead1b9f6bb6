"""llmpy: GPT-2-family language-model training from Python, llm.c's design with Triton kernels."""
from .config import GPT2Config, parse_descriptor
from .errors import LlmpyError

__version__ = "0.1.0"


def __getattr__(name):
    # the API pulls in torch and the trainer: load it on first use so `import llmpy` stays light
    if name in ("create_model", "load_model", "train", "sample"):
        from . import api
        return getattr(api, name)
    raise AttributeError(f"module 'llmpy' has no attribute {name!r}")


def __dir__():
    # the lazily loaded API too: a notebook's completion lists dir(llmpy)
    return sorted(set(globals()) | set(__all__))


__all__ = ["GPT2Config", "parse_descriptor", "LlmpyError", "create_model", "load_model", "train", "sample",
           "__version__"]
