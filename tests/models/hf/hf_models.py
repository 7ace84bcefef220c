"""Tiny random-weight Hugging Face models saved with ``save_pretrained`` (no download), and their reference logits.

Every parameter gets a random offset after construction, so zero biases and unit norm weights
are exercised too. The Llama config uses ``llama3`` RoPE scaling with non-default low/high
frequency factors and original length, so the scaled frequencies matter at these lengths.
"""

from __future__ import annotations

import os

import torch

VOCAB, SEQ, BATCH = 96, 12, 2
FAMILIES = ("llama", "qwen2", "qwen3", "gpt2")
MOE_FAMILIES = ("mixtral", "qwen2_moe")
QWEN3_MOE = dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16,
                 tie_word_embeddings=False)


def hf_config(kind: str, **overrides):
    """A tiny transformers config of family ``kind``."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
            "original_max_position_embeddings": 16}, rope_theta=5000.0)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=48, n_layer=2, n_head=4,
                                      activation_function="gelu_new", bos_token_id=0, eos_token_id=0)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=4, head_dim=8, tie_word_embeddings=False,
                                         rope_theta=5000.0)
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(**{**common, "intermediate_size": 40}, num_local_experts=4,
                                         num_experts_per_tok=2, tie_word_embeddings=False, rope_theta=5000.0)
    elif kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**common, moe_intermediate_size=24, shared_expert_intermediate_size=56,
                                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                          decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
    elif kind == "qwen3_moe":  # layer 1 dense (mlp_only_layers)
        cfg = transformers.Qwen3MoeConfig(**{**common, "num_hidden_layers": 3}, **QWEN3_MOE, mlp_only_layers=[1])
    elif kind == "qwen3_next":  # gated delta net, gated attention, dense, MoE; partial RoPE
        cfg = transformers.Qwen3NextConfig(
            **{**common, "num_hidden_layers": 3, "num_attention_heads": 4}, head_dim=12, moe_intermediate_size=24,
            shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
            mlp_only_layers=[2], layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})
    else:
        raise ValueError(kind)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def make_hf_model(kind: str, path: str | os.PathLike, dtype: torch.dtype = torch.float32, seed: int = 0,
                  max_shard_size: str | None = None, **overrides):
    """Create, perturb and ``save_pretrained`` a tiny model into ``path``; returns the (eval, eager) model."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind, **overrides)).eval()
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    model = model.to(dtype)
    model.config._attn_implementation = "eager"
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(os.fspath(path), **kwargs)
    return model


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids)``, each ``[BATCH, SEQ]``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids, torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)


def our_logits(model: torch.nn.Module) -> torch.Tensor:
    """Logits (fp32) of our ``model`` on :func:`batch`, without gradients."""
    ids, pos = batch()
    with torch.no_grad():
        return model(ids, pos, None).float()


def hf_logits(path: str | os.PathLike) -> torch.Tensor:
    """Logits of the HF model saved at ``path`` (loaded back with ``from_pretrained``) on :func:`batch`."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(os.fspath(path), attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=batch()[0]).logits.float()


def safetensors_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor stored in the HF directory ``path`` (single file or index)."""
    import json

    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.isfile(index) else ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(os.path.join(path, name)))
    return out


def assert_same_tensors(original: str | os.PathLike, exported: str | os.PathLike) -> None:
    """The two HF directories hold the same tensor names, dtypes and bitwise-identical values."""
    a, b = safetensors_tensors(original), safetensors_tensors(exported)
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for name in a:
        assert a[name].dtype == b[name].dtype, (name, a[name].dtype, b[name].dtype)
        assert torch.equal(a[name], b[name]), name


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    """Add ``scale`` x N(0, 1) noise to every parameter and to DeepSeek's ``e_score_correction_bias`` buffers, so no
    norm weight or bias keeps the round value of a fresh initialisation (which would hide a misplaced tensor)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=gen))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(scale * torch.randn(buffer.shape, generator=gen))


def megatron_model(bridge, grouped: bool = False, **overrides) -> torch.nn.Module:
    """The bridge's GPTModel (one chunk) in eval mode, its weights loaded; ``grouped``: grouped-GEMM experts."""
    config = bridge.transformer_config(perform_initialization=False, moe_grouped_gemm=grouped, **overrides)
    (model,) = bridge.to_megatron_model(config=config)
    return model.eval()


def eval_logits(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``model``'s full-vocabulary logits of ``ids`` without gradients."""
    with torch.no_grad():
        return model(ids, positions, None, runtime_gather_output=True)
