"""A character-level Hugging Face fast tokenizer with a chat template, built in memory (test helper)."""

from __future__ import annotations

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


class HFCharTokenizer:
    """Megatron-style tokenizer (``tokenize`` / ``detokenize`` / ``eod``) over a real ``PreTrainedTokenizerFast``."""

    def __init__(self, vocab_size: int = 128) -> None:
        from transformers import PreTrainedTokenizerFast

        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate(CHARS)}}
        core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
        core.decoder = decoders.Fuse()
        self.tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                                 unk_token="<unk>")
        self.tokenizer.chat_template = CHAT_TEMPLATE
        self.vocab_size = vocab_size
        self.eod = self.tokenizer.eos_token_id
        self.bos = self.tokenizer.bos_token_id

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i < 3 + len(CHARS)], skip_special_tokens=True)
