"""The one place this library imports TensorRT-LLM (``pip install tensorrt-llm``), always lazily.

TensorRT-LLM installs only on NVIDIA GPU machines; without it the export's weight conversion still works
and everything that needs its model configs, ``Mapping`` or engine builder raises the ``ImportError`` below.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

HAVE_TRTLLM: bool = importlib.util.find_spec("tensorrt_llm") is not None
"""Whether the ``tensorrt_llm`` package is installed (found without importing it)."""


def import_tensorrt_llm(purpose: str, module: str = "tensorrt_llm") -> ModuleType:
    """Import ``module`` (``tensorrt_llm`` or one of its submodules) for ``purpose``.

    Raises ``ImportError`` naming the package and how to install it when TensorRT-LLM is missing.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{purpose} needs the tensorrt_llm package (NVIDIA TensorRT-LLM, `pip install tensorrt-llm`, "
            f"GPU machines only), which could not be imported ({module}: {exc}); the weight conversion itself "
            "(SingleDeviceTRTLLMModelWeightsConverter / DistributedTRTLLMModelWeightsConverter) works without it"
        ) from exc
