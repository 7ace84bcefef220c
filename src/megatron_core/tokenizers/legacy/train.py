"""``train_bpe_tokenizer``: train a byte-level BPE tokenizer with Hugging Face ``tokenizers``.

Writes ``tokenizer.json`` (for ``HuggingFaceTokenizer``) and GPT-2 style ``vocab.json`` +
``merges.txt`` (for ``GPT2BPETokenizer``) into ``output_path``. The examples train one on the Python
standard library's source files, which every machine has offline.
"""

from __future__ import annotations

import json
import os

from megatron_core.tokenizers.legacy.gpt2_bpe import END_OF_TEXT
from megatron_core.tokenizers.legacy.optional import import_tokenizers


def train_bpe_tokenizer(
    files: list[str], vocab_size: int, output_path: str, special_tokens: list[str] | None = None
) -> dict[str, str]:
    """Train on ``files``; return the paths written (``tokenizer_json``, ``vocab_file``, ``merge_file``).

    ``special_tokens`` defaults to ``["<|endoftext|>"]`` (the eod of both tokenizer types).
    """
    tokenizers = import_tokenizers()
    if not files:
        raise ValueError("train_bpe_tokenizer: no training files given")
    special_tokens = [END_OF_TEXT] if special_tokens is None else list(special_tokens)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(path) for path in files], trainer)
    os.makedirs(output_path, exist_ok=True)
    paths = {
        "tokenizer_json": os.path.join(output_path, "tokenizer.json"),
        "vocab_file": os.path.join(output_path, "vocab.json"),
        "merge_file": os.path.join(output_path, "merges.txt"),
    }
    tokenizer.save(paths["tokenizer_json"])
    model = json.loads(tokenizer.to_str())["model"]
    with open(paths["vocab_file"], "w", encoding="utf-8") as stream:
        json.dump(model["vocab"], stream, ensure_ascii=False)
    with open(paths["merge_file"], "w", encoding="utf-8") as stream:
        stream.write("#version: 0.2\n")
        for merge in model["merges"]:
            stream.write((merge if isinstance(merge, str) else " ".join(merge)) + "\n")
    return paths
