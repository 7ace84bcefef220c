"""A tiny random Llama in Hugging Face and the same weights in GPTModel (test helper)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig
from tests.models.hf_weight_mapping import llama_to_mcore, load_into

VOCAB, HIDDEN, FFN, LAYERS, HEADS, GROUPS, MAX_POS = 128, 64, 96, 2, 4, 2, 256


def hf_llama():
    """A perturbed random ``LlamaForCausalLM`` (GQA 4 heads / 2 groups), eager attention, no EOS."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=MAX_POS, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=gen))
    model.config._attn_implementation = "eager"
    return model


def mcore_config(**overrides) -> TransformerConfig:
    """The GPTModel config matching :func:`hf_llama`."""
    kwargs = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=FFN, normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def mcore_llama(hf_model=None, **config_overrides) -> GPTModel:
    """GPTModel holding ``hf_model``'s weights (single process)."""
    hf_model = hf_model if hf_model is not None else hf_llama()
    model = GPTModel(
        mcore_config(**config_overrides), get_gpt_layer_local_spec(), VOCAB, MAX_POS, position_embedding_type="rope",
        rotary_base=10000,
    ).eval()
    load_into(model, llama_to_mcore(hf_model.state_dict(), LAYERS, HEADS, GROUPS))
    return model


def prompts(lengths=(5, 17, 9, 30), seed: int = 3) -> list[list[int]]:
    """Random prompts of the given lengths (ids >= 1)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    """Hugging Face ``generate(do_sample=False)`` continuation of one prompt."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt):].tolist()


class CharTokenizer:
    """Bytes as tokens (ids 3..130 hold ASCII 0..127); 1 = BOS, 2 = EOD. A test tokenizer."""

    bos, eod, vocab_size = 1, 2, VOCAB

    def tokenize(self, text: str) -> list[int]:
        return [3 + (ord(c) % 125) for c in text]

    def detokenize(self, ids: list[int]) -> str:
        return "".join(chr(i - 3) for i in ids if i >= 3)
