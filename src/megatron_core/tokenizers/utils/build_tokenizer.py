"""``build_tokenizer(args)``: a tokenizer from Megatron's training arguments (``--tokenizer-type`` etc.).

Maps the ``tokenizer_type`` name to a metadata library and keyword arguments and calls
:meth:`MegatronTokenizer.from_pretrained`. With ``args.pad_vocab_size`` (default True) it also sets
``args.padded_vocab_size`` (unless already set) to the vocab size rounded up to a multiple of
``make_vocab_size_divisible_by * tensor_model_parallel_size``. Arguments absent from ``args`` read
as Megatron's defaults.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from megatron_core.tokenizers.megatron_tokenizer import MegatronTokenizer

MEGATRON_TOKENIZERS = ["BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer"]
SP_TOKENIZERS = ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"]
SUPPORTED_TOKENIZERS = [
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "MultimodalTokenizer",
    "NullTokenizer",
    "NullMultimodalTokenizer",
    "SFTTokenizer",
    *MEGATRON_TOKENIZERS,
    *SP_TOKENIZERS,
]
"""The ``tokenizer_type`` names Megatron accepts."""

_DEFAULTS: dict[str, Any] = {
    "special_tokens": None,
    "vocab_file": None,
    "merge_file": None,
    "tokenizer_model": None,
    "tokenizer_hf_no_use_fast": False,
    "tokenizer_hf_no_include_special_tokens": False,
    "trust_remote_code": False,
    "chat_template": None,
    "tokenizer_sentencepiece_ignore_extra_whitespaces": True,
    "tokenizer_sentencepiece_legacy": False,
    "tiktoken_pattern": None,
    "tiktoken_num_special_tokens": 1000,
    "vocab_size": None,
    "metadata_path": None,
    "pad_vocab_size": True,
    "null_tokenizer_eod_id": None,
    "null_tokenizer_pad_id": None,
    "make_vocab_size_divisible_by": 128,
    "tensor_model_parallel_size": 1,
    "rank": 0,
    "tokenizer_prompt_format": None,
    "image_tag_type": None,
    "force_system_message": False,
    "sft_tokenizer_prompt_format": None,
}

logger = logging.getLogger(__name__)


def _arg(args: Any, name: str) -> Any:
    return getattr(args, name, _DEFAULTS[name])


def _library_and_kwargs(args: Any) -> tuple[str, str | None, dict[str, Any]]:
    """Metadata library, tokenizer path and keyword arguments for ``args.tokenizer_type``."""
    kind = args.tokenizer_type
    kwargs: dict[str, Any] = {}
    if kind in MEGATRON_TOKENIZERS:
        kwargs["additional_special_tokens"] = _arg(args, "special_tokens") or []
        kwargs["vocab_file"] = _arg(args, "vocab_file")
        kwargs["merges_file"] = _arg(args, "merge_file")
        return "megatron", kind, kwargs
    if kind in SP_TOKENIZERS:
        kwargs["chat_template"] = _arg(args, "chat_template")
        kwargs["ignore_extra_whitespaces"] = _arg(args, "tokenizer_sentencepiece_ignore_extra_whitespaces")
        kwargs["legacy"] = _arg(args, "tokenizer_sentencepiece_legacy")
        kwargs["special_tokens"] = _arg(args, "special_tokens")
        return "sentencepiece", _arg(args, "tokenizer_model"), kwargs
    if kind == "TikTokenizer":
        kwargs["chat_template"] = _arg(args, "chat_template")
        if _arg(args, "tiktoken_pattern"):
            kwargs["pattern"] = _arg(args, "tiktoken_pattern")
        if _arg(args, "vocab_size"):
            kwargs["vocab_size"] = _arg(args, "vocab_size")
        kwargs["num_special_tokens"] = _arg(args, "tiktoken_num_special_tokens")
        kwargs["special_tokens"] = _arg(args, "special_tokens")
        return "tiktoken", _arg(args, "tokenizer_model"), kwargs
    if kind == "HuggingFaceTokenizer":
        kwargs["chat_template"] = _arg(args, "chat_template")
        kwargs["vocab_file"] = _arg(args, "vocab_file")
        kwargs["merges_file"] = _arg(args, "merge_file")
        kwargs["additional_special_tokens"] = _arg(args, "special_tokens") or []
        kwargs["use_fast"] = not _arg(args, "tokenizer_hf_no_use_fast")
        kwargs["trust_remote_code"] = _arg(args, "trust_remote_code")
        kwargs["include_special_tokens"] = not _arg(args, "tokenizer_hf_no_include_special_tokens")
        return "huggingface", _arg(args, "tokenizer_model"), kwargs
    if kind == "MultimodalTokenizer":
        kwargs["prompt_format"] = _arg(args, "tokenizer_prompt_format")
        kwargs["special_tokens"] = _arg(args, "special_tokens")
        kwargs["image_tag_type"] = _arg(args, "image_tag_type")
        kwargs["force_system_message"] = _arg(args, "force_system_message")
        return "multimodal", _arg(args, "tokenizer_model"), kwargs
    if kind == "SFTTokenizer":
        kwargs["prompt_format"] = _arg(args, "sft_tokenizer_prompt_format")
        return "sft", _arg(args, "tokenizer_model"), kwargs
    if kind == "NullMultimodalTokenizer":
        if _arg(args, "vocab_size"):
            kwargs["vocab_size"] = _arg(args, "vocab_size")
        return "null-multimodal", None, kwargs
    # NullTokenizer
    if _arg(args, "vocab_size"):
        kwargs["vocab_size"] = _arg(args, "vocab_size")
    if _arg(args, "null_tokenizer_eod_id") is not None:
        kwargs["eod_id"] = _arg(args, "null_tokenizer_eod_id")
    if _arg(args, "null_tokenizer_pad_id") is not None:
        kwargs["pad_id"] = _arg(args, "null_tokenizer_pad_id")
    return "null-text", None, kwargs


def build_tokenizer(args: Any, **kwargs: Any) -> Any:
    """Build the tokenizer ``args.tokenizer_type`` names (Megatron's ``--tokenizer-type``)."""
    tokenizer_type = getattr(args, "tokenizer_type", None)
    if tokenizer_type not in SUPPORTED_TOKENIZERS:
        raise ValueError(
            f"tokenizer_type {tokenizer_type} is not supported. See list of available tokenizers: "
            f"{SUPPORTED_TOKENIZERS}"
        )
    library, tokenizer_path, library_kwargs = _library_and_kwargs(args)
    if library in ("null-text", "null-multimodal") and "vocab_size" not in library_kwargs:
        raise ValueError(f"build_tokenizer: tokenizer_type {tokenizer_type} needs args.vocab_size")
    metadata: str | dict = {"library": library}
    if library not in ("null-text", "null-multimodal") and _arg(args, "metadata_path"):
        metadata = _arg(args, "metadata_path")
    tokenizer = MegatronTokenizer.from_pretrained(tokenizer_path=tokenizer_path, metadata_path=metadata, **library_kwargs)
    if _arg(args, "pad_vocab_size"):
        _set_padded_vocab_size(args, tokenizer)
    return tokenizer


def vocab_size_with_padding(orig_vocab_size: int, args: Any, logging_enabled: bool = True) -> int:
    """``orig_vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by * TP size``."""
    multiple = _arg(args, "make_vocab_size_divisible_by") * _arg(args, "tensor_model_parallel_size")
    after = int(math.ceil(orig_vocab_size / multiple) * multiple)
    if _arg(args, "rank") == 0 and logging_enabled:
        logger.info(
            " > padded vocab (size: %d) with %d dummy tokens (new size: %d)",
            orig_vocab_size, after - orig_vocab_size, after,
        )
    return after


def _set_padded_vocab_size(args: Any, tokenizer: Any) -> None:
    """Set ``args.padded_vocab_size`` unless it is already set (e.g. from a checkpoint)."""
    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, args)
