"""Tiny random-weight Hugging Face hybrid Mamba models (``NemotronHForCausalLM``, ``Mamba2ForCausalLM``) saved with
``save_pretrained``, for the bridge tests.

Every parameter is drawn afresh from N(0, 0.3) (``A_log`` from U(-1, 1)), so no norm weight or ``D`` keeps the
round value of an initialisation, and ``softplus(dt)`` stays far above ``time_step_min`` (below it transformers'
NemotronH clamps the time step, which Megatron-Core's mixer does not).
"""

from __future__ import annotations

import os

import torch

from tests.models.hf.hf_models import VOCAB

HYBRID_KINDS = ("nemotron_h", "nemotron_h_alt", "mamba2")


def hybrid_config(kind: str, **overrides):
    """A tiny transformers config of ``kind`` (see :data:`HYBRID_KINDS`)."""
    import transformers

    if kind.startswith("nemotron_h"):
        alt = kind == "nemotron_h_alt"  # attention first, conv width 3, tie_word_embeddings (NemotronH ignores it)
        cfg = transformers.NemotronHConfig(
            vocab_size=VOCAB, hidden_size=16, hybrid_override_pattern="*-M" if alt else "M*M-",
            num_attention_heads=4, num_key_value_heads=2, head_dim=4, intermediate_size=24, mamba_num_heads=4,
            mamba_head_dim=6, n_groups=2, ssm_state_size=8, conv_kernel=3 if alt else 4, chunk_size=5,
            layer_norm_epsilon=1e-5, tie_word_embeddings=alt, use_mamba_kernels=False)
    elif kind == "mamba2":
        cfg = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_heads=4,
                                        head_dim=8, expand=2, n_groups=2, state_size=8, conv_kernel=3, chunk_size=5,
                                        tie_word_embeddings=True)
    else:
        raise ValueError(kind)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def make_hybrid_model(kind: str, path: str | os.PathLike, seed: int = 0, **overrides):
    """Create, randomise and ``save_pretrained`` a tiny hybrid model into ``path``; returns it (eval mode)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hybrid_config(kind, **overrides)).eval()
    gen = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.rand(param.shape, generator=gen) * 2 - 1)
            else:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(os.fspath(path))
    return model
