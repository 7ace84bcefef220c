"""``MegatronTokenizer``: restore a tokenizer from its files and metadata (Megatron-Core 0.19 API).

Metadata is a dict, or a JSON file (by default ``tokenizer_metadata.json`` in the tokenizer's
directory, written by :meth:`MegatronTokenizer.write_metadata`) with the keys ``library`` (required),
``model_type`` (``"gpt"``, ``"bert"``, ``"t5"``, ``"mamba"``, ``"default-text"``; default
``"default-text"``; ``"default-vision"`` for the vision libraries ``multimodal`` and
``null-multimodal``), ``class_name``/``class_path`` (a custom tokenizer class) and ``chat_template``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections import OrderedDict
from typing import Any

from megatron_core.tokenizers.base_tokenizer import MegatronTokenizerBase

TOKENIZER_MAPPING_NAMES = OrderedDict(
    [
        ("default-text", "DefaultTokenizerText"),
        ("gpt", "GPTTokenizer"),
        ("mamba", "MambaTokenizer"),
        ("bert", "BertTokenizer"),
        ("t5", "T5Tokenizer"),
        ("default-vision", "DefaultTokenizerVision"),
    ]
)
"""``model_type`` to tokenizer class name."""

TEXT_LIBRARIES = ["sentencepiece", "huggingface", "megatron", "tiktoken", "byte-level", "null-text", "sft"]
"""Text tokenizer libraries Megatron names."""

VISION_LIBRARIES = ["multimodal", "null-multimodal"]
"""Vision tokenizer libraries Megatron names."""

PATHLESS_LIBRARIES = ["byte-level", "null-text", "null-multimodal"]
"""Libraries that need no tokenizer file."""

METADATA_FILE_NAME = "tokenizer_metadata.json"

logger = logging.getLogger(__name__)


class MegatronTokenizer:
    """Factory for tokenizers; use :meth:`from_pretrained` (the class itself is not instantiable)."""

    def __init__(self) -> None:
        raise OSError(
            "MegatronTokenizer is designed to be instantiated using the `MegatronTokenizer.from_pretrained()` method."
        )

    @staticmethod
    def from_pretrained(
        tokenizer_path: str | None = None, metadata_path: str | dict | None = None, **kwargs: Any
    ) -> MegatronTokenizerBase:
        """Build the tokenizer at ``tokenizer_path`` described by ``metadata_path`` (a JSON file or a dict).

        Without ``metadata_path`` the metadata is read from ``tokenizer_metadata.json`` next to the
        tokenizer. Keyword arguments go to the library tokenizer (e.g. ``vocab_size`` for
        ``null-text``, ``vocab_file``/``merges_file`` for ``megatron``).
        """
        if not metadata_path:
            if not tokenizer_path:
                raise ValueError("MegatronTokenizer.from_pretrained: give tokenizer_path, metadata_path or both")
            metadata_path = _get_metadata_path(tokenizer_path)
        if isinstance(metadata_path, (str, os.PathLike)):
            metadata_path = os.fspath(metadata_path)
            if not os.path.isfile(metadata_path):
                raise FileNotFoundError(
                    f"Tokenizer metadata file {metadata_path} does not exist; write it with "
                    "MegatronTokenizer.write_metadata() or pass metadata_path as a dict such as {'library': ...}"
                )
            with open(metadata_path, encoding="utf-8") as stream:
                metadata = json.load(stream)
            if not isinstance(metadata, dict):
                raise ValueError(f"Tokenizer metadata file {metadata_path} must hold a JSON object")
        elif isinstance(metadata_path, dict):
            metadata = dict(metadata_path)
            metadata_path = None
        else:
            raise ValueError(f"Expected metadata_path to be str or dict, but got {type(metadata_path)}.")

        library = metadata.get("library")
        _check_library(library)
        if library not in PATHLESS_LIBRARIES and not tokenizer_path:
            raise ValueError(f"Tokenizer library {library!r} needs tokenizer_path (got {tokenizer_path!r})")
        if tokenizer_path is not None:
            tokenizer_path = os.fspath(tokenizer_path)
        if library == "multimodal":
            missing = [name for name in ("prompt_format", "special_tokens", "image_tag_type") if name not in kwargs]
            if missing:
                raise ValueError(f"Tokenizer library 'multimodal' needs the keyword arguments {missing}")
        tokenizer_cls = _get_tokenizer_model_class(library, metadata)
        metadata["metadata_path"] = metadata_path
        return tokenizer_cls(path=tokenizer_path, config=metadata, **kwargs)

    @staticmethod
    def write_metadata(
        tokenizer_path: str,
        tokenizer_library: str,
        model_type: str | None = None,
        tokenizer_class: type | None = None,
        chat_template: str | None = None,
        overwrite: bool = False,
        metadata_path: str | None = None,
    ) -> None:
        """Write the metadata JSON for the tokenizer at ``tokenizer_path``.

        The file goes to ``metadata_path``, else to ``tokenizer_metadata.json`` in the tokenizer's
        directory. ``model_type`` defaults to ``"default-text"`` unless ``tokenizer_class`` is given.
        An existing file is kept unless ``overwrite`` is set (then a ``ValueError`` is raised).
        """
        if not os.path.exists(tokenizer_path):
            raise FileNotFoundError(f"Tokenizer path {tokenizer_path} does not exist")
        _check_library(tokenizer_library)
        if model_type is None and tokenizer_class is None:
            model_type = "default-text" if tokenizer_library in TEXT_LIBRARIES else "default-vision"
        if not metadata_path:
            metadata_path = _get_metadata_path(tokenizer_path)
        if os.path.exists(metadata_path) and not overwrite:
            raise ValueError(
                f"Metadata file {metadata_path} already exists. If you want to overwrite it, set overwrite=True."
            )
        metadata = {
            "library": tokenizer_library,
            "class_name": tokenizer_class.__name__ if tokenizer_class else None,
            "class_path": tokenizer_class.__module__ if tokenizer_class else None,
            "model_type": model_type,
            "chat_template": chat_template,
        }
        with open(metadata_path, "w", encoding="utf-8") as stream:
            json.dump(metadata, stream)
        logger.info("Metadata file was successfully saved: %s.", metadata_path)


def _check_library(library: Any) -> None:
    known = TEXT_LIBRARIES + VISION_LIBRARIES
    if library not in known:
        raise ValueError(f"Tokenizer library {library!r} is not supported; metadata 'library' must be one of {known}")


def _get_metadata_path(tokenizer_path: str) -> str:
    """``tokenizer_metadata.json`` in the tokenizer's directory (or in ``tokenizer_path`` if it is one)."""
    tokenizer_path = os.fspath(tokenizer_path)
    directory = os.path.dirname(tokenizer_path) if os.path.isfile(tokenizer_path) else tokenizer_path
    return os.path.join(directory, METADATA_FILE_NAME)


def _get_tokenizer_model_class(library: str, metadata: dict) -> type:
    """The class for the metadata: a custom ``class_path.class_name``, else the ``model_type``'s class."""
    model_type = metadata.get("model_type")
    class_name, class_path = metadata.get("class_name"), metadata.get("class_path")
    if model_type is None and class_name and class_path:
        if class_path.startswith("megatron.core."):
            class_path = "megatron_core." + class_path[len("megatron.core."):]
        return getattr(importlib.import_module(class_path), class_name)
    kind = "text" if library in TEXT_LIBRARIES else "vision"
    if model_type is None:
        model_type = f"default-{kind}"
    supported = [name for name in TOKENIZER_MAPPING_NAMES if (name == "default-vision") == (kind == "vision")]
    if model_type not in supported:
        raise ValueError(f"Tokenizer model_type {model_type!r} is not supported for library {library!r}; "
                         f"use one of {supported}")
    models = importlib.import_module(f"megatron_core.tokenizers.{kind}.models")
    return getattr(models, TOKENIZER_MAPPING_NAMES[model_type])
