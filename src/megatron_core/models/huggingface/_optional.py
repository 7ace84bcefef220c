"""The one place ``models.huggingface`` imports its optional libraries: ``transformers`` and NVIDIA NeMo.

Nothing here imports either library when this package is imported: ``HAVE_TRANSFORMERS`` only asks whether
``transformers`` is installed, the other helpers import on first use and turn a missing install into an
``ImportError`` that names the package to install.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

HAVE_TRANSFORMERS: bool = importlib.util.find_spec("transformers") is not None


def transformers_attr(module: str, name: str, what: str) -> Any:
    """``name`` from the ``transformers`` module ``module`` (e.g. ``"transformers"``, ``"AutoModel"``)."""
    if not HAVE_TRANSFORMERS:
        raise ImportError(f"transformers is required for {what}: pip install transformers (or the 'hf' extra)")
    return getattr(importlib.import_module(module), name)


def import_nemo_asr(what: str) -> ModuleType:
    """NeMo's ``nemo.collections.asr`` (the Parakeet encoders' ``nemo://`` backend)."""
    try:
        return importlib.import_module("nemo.collections.asr")
    except ImportError as error:
        raise ImportError(
            f"{what} with a 'nemo://' model needs NVIDIA NeMo's ASR collection: pip install 'nemo_toolkit[asr]' "
            "(or use the 'hf://' form of the model, which needs only transformers)"
        ) from error


class TransformersClasses:
    """A class attribute that reads as a list of ``transformers`` classes, imported on first access.

    The wrappers name the Hugging Face layer classes FSDP2 wraps as units (``_fsdp_modules``) without importing
    ``transformers`` when their module is imported; without ``transformers`` installed it reads as ``[]``.
    """

    def __init__(self, module: str, *names: str) -> None:
        self.module = module
        self.names = names

    def __get__(self, instance: object, owner: type | None = None) -> list[type]:
        if not HAVE_TRANSFORMERS:
            return []
        source = importlib.import_module(self.module)
        return [getattr(source, name) for name in self.names]
