"""The tokenizer of a Hugging Face model directory, with its special tokens and chat template.

:class:`HFDirectoryTokenizer` is the library's :class:`HuggingFaceTokenizer` (``tokenizer.json``
through the ``tokenizers`` package) whose end-of-document, beginning and pad tokens come from
``tokenizer_config.json`` (or ``special_tokens_map.json``), and which renders the directory's
chat template (``chat_template`` in ``tokenizer_config.json`` or ``chat_template.jinja``) with
``jinja2`` in a sandbox, as chat fine-tuning data needs.
"""

from __future__ import annotations

import json
import os
from typing import Any

from megatron_core.tokenizers.legacy.huggingface import HuggingFaceTokenizer


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


class HFDirectoryTokenizer(HuggingFaceTokenizer):
    """``tokenizer.json`` + ``tokenizer_config.json`` of an HF model directory (special tokens, chat template)."""

    def __init__(self, directory: str, **kwargs: Any) -> None:
        config = {**_read_json(os.path.join(directory, "special_tokens_map.json")),
                  **_read_json(os.path.join(directory, "tokenizer_config.json"))}
        self.special_tokens = {role: _token_text(config.get(f"{role}_token")) for role in ("bos", "eos", "pad", "unk")}
        kwargs.setdefault("eod_token", self.special_tokens["eos"])
        kwargs.setdefault("bos_token", self.special_tokens["bos"])
        kwargs.setdefault("pad_token", self.special_tokens["pad"])
        super().__init__(directory, **kwargs)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        self.chat_template: str | None = template

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = True, **extra: Any) -> list[int] | str:
        """Render ``messages`` with the directory's chat template; token ids (``tokenize``) or text."""
        if self.chat_template is None:
            raise ValueError("this tokenizer directory has no chat template (tokenizer_config.json 'chat_template')")
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as error:
            raise ImportError("chat templates need the 'jinja2' package: pip install jinja2 "
                              "(or pip install 'megatron_core[hf]')") from error

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters.setdefault("tojson", lambda value, indent=None: json.dumps(value, indent=indent))
        tokens = {f"{role}_token": text or "" for role, text in self.special_tokens.items()}
        text = env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **tokens, **extra)
        return self.tokenize(text) if tokenize else text
