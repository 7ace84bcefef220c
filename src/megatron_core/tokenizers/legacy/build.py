"""``build_tokenizer``: make a tokenizer from Megatron's ``--tokenizer-type`` name and its file arguments."""

from __future__ import annotations

from typing import Any

from megatron_core.tokenizers.legacy.megatron_tokenizer import MegatronTokenizer

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "NullTokenizer",
)


def _require(tokenizer_type: str, **values: Any) -> None:
    missing = [name for name, value in values.items() if value is None]
    if missing:
        raise ValueError(f"tokenizer_type {tokenizer_type} needs {', '.join(missing)}")


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = 1000,
    tokenizer_special_tokens: list[str] | None = None,
    **kwargs: Any,
) -> MegatronTokenizer:
    """Build the tokenizer Megatron's ``--tokenizer-type`` names, from the matching file arguments.

    ``GPT2BPETokenizer`` needs ``vocab_file`` and ``merge_file``; ``HuggingFaceTokenizer``,
    ``TikTokenizer`` and the SentencePiece types need ``tokenizer_model``; ``NullTokenizer`` needs
    ``vocab_size``. Extra keyword arguments go to the HuggingFace tokenizer (e.g. ``eod_token``).
    """
    if tokenizer_type == "GPT2BPETokenizer":
        from megatron_core.tokenizers.legacy.gpt2_bpe import GPT2BPETokenizer

        _require(tokenizer_type, vocab_file=vocab_file, merge_file=merge_file)
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        from megatron_core.tokenizers.legacy.huggingface import HuggingFaceTokenizer

        _require(tokenizer_type, tokenizer_model=tokenizer_model)
        return HuggingFaceTokenizer(tokenizer_model, **kwargs)
    if tokenizer_type == "TikTokenizer":
        from megatron_core.tokenizers.legacy.tiktoken_tokenizer import TikTokenizer

        _require(tokenizer_type, tokenizer_model=tokenizer_model)
        options: dict[str, Any] = {"num_special_tokens": tiktoken_num_special_tokens}
        if tiktoken_pattern:
            options["pattern"] = tiktoken_pattern
        if vocab_size:
            options["vocab_size"] = vocab_size
        if tokenizer_special_tokens:
            options["special_tokens"] = tokenizer_special_tokens
        return TikTokenizer(tokenizer_model, **options)
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        from megatron_core.tokenizers.legacy.sentencepiece_tokenizer import SentencePieceTokenizer

        _require(tokenizer_type, tokenizer_model=tokenizer_model)
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        from megatron_core.tokenizers.legacy.null import NullTokenizer

        _require(tokenizer_type, vocab_size=vocab_size)
        return NullTokenizer(vocab_size)
    raise ValueError(f"unknown tokenizer_type {tokenizer_type!r}; supported: {', '.join(TOKENIZER_TYPES)}")
