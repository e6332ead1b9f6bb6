"""llmpy: GPT-2-family language-model training from Python, llm.c's design with Triton kernels."""
from .config import GPT2Config, parse_descriptor
from .errors import LlmpyError

__version__ = "0.1.0"
__all__ = ["GPT2Config", "parse_descriptor", "LlmpyError", "__version__"]
