"""``null-multimodal`` library: ids written as space-separated integers, plus an image placeholder.

Megatron semantics, as the legacy ``NullTokenizer`` it extends: ``vocab_size + 1`` ids with ``eod``
the extra last one, cls/sep/mask -1, no pad. ``convert_tokens_to_ids`` also knows the image token
(``<image>`` by default), which maps to ``image_token_id`` (``DEFAULT_IMAGE_TOKEN_INDEX``, -200, by
default); like Megatron it splits a string of several tokens on two spaces.
"""

from __future__ import annotations

from megatron_core.tokenizers.legacy.null import NullTokenizer
from megatron_core.tokenizers.vision.image_tokens import DEFAULT_IMAGE_TOKEN_INDEX, IMAGE_TOKEN


class MegatronNullMultimodalTokenizer(NullTokenizer):
    """Synthetic multimodal tokenizer for mock data: ``"3 1 4"`` is ids ``[3, 1, 4]``."""

    def __init__(self, vocab_size: int, image_token: str | None = None, image_token_id: int | None = None) -> None:
        super().__init__(vocab_size)
        self._image_token = IMAGE_TOKEN if image_token is None else image_token
        self._image_token_id = DEFAULT_IMAGE_TOKEN_INDEX if image_token_id is None else int(image_token_id)

    def tokenize(self, text: str) -> list[int]:
        """Parse space-separated integers; raises ``ValueError`` naming a piece that is not one."""
        return [self._parse(piece, text) for piece in text.split()]

    def convert_tokens_to_ids(self, tokens: str) -> int | list[int]:
        """Id of each token in ``tokens`` (separated by two spaces): the image token or an integer."""
        ids = [self._image_token_id if token == self._image_token else self._parse(token, tokens)
               for token in tokens.split("  ")]
        return ids if len(ids) > 1 else ids[0]

    def _parse(self, piece: str, text: str) -> int:
        try:
            return int(piece)
        except ValueError:
            raise ValueError(f"MegatronNullMultimodalTokenizer: {piece!r} in {text!r} is not an integer id "
                             f"(or the image token {self._image_token!r})") from None
