"""Text tokenizer classes, one per metadata ``model_type``."""

from megatron_core.tokenizers.text.models.bert_tokenizer import BertTokenizer
from megatron_core.tokenizers.text.models.default_tokenizer import DefaultTokenizerText
from megatron_core.tokenizers.text.models.gpt_tokenizer import GPTTokenizer
from megatron_core.tokenizers.text.models.mamba_tokenizer import MambaTokenizer
from megatron_core.tokenizers.text.models.t5_tokenizer import T5Tokenizer

__all__ = ["BertTokenizer", "DefaultTokenizerText", "GPTTokenizer", "MambaTokenizer", "T5Tokenizer"]
