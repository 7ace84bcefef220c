"""``MambaTokenizer``: the Mamba text tokenizer (``model_type`` metadata)."""

from __future__ import annotations

from typing import Any

from megatron_core.tokenizers.text.text_tokenizer import MegatronTokenizerText


class MambaTokenizer(MegatronTokenizerText):
    """Text tokenizer for Mamba models; records its class in the metadata."""

    def __init__(self, path: str | None = None, config: dict | None = None, **kwargs: Any) -> None:
        config = dict(config or {})
        config["class_name"] = type(self).__name__
        config["class_path"] = type(self).__module__
        super().__init__(path, config, **kwargs)
