"""Shared pieces of the absorbed-MLA tests: a tiny config, a dense causal core attention for the absorbed
(multi-query latent) layout, and standard / absorbed layers built from the same spec parts and weights."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_core.models.gpt import get_gpt_layer_local_spec
from megatron_core.transformer import MLATransformerConfig
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.experimental_attention_variant.absorbed_mla import (
    AbsorbedMLASelfAttention,
    AbsorbedMLASelfAttentionSubmodules,
)
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.multi_latent_attention import MLASelfAttention
from megatron_core.transformer.spec_utils import ModuleSpec, build_module

SEQ, BATCH, HIDDEN = 10, 2, 32
TOL = dict(rtol=1e-5, atol=1e-5)
SHAPE = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
             qk_pos_emb_head_dim=4, v_head_dim=6, ffn_hidden_size=64, qk_layernorm=True, add_bias_linear=False,
             hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, layernorm_epsilon=1e-6,
             normalization="RMSNorm")
YARN = dict(rope_type="yarn", rotary_base=1000.0, rotary_scaling_factor=4.0, original_max_position_embeddings=4,
            mscale=1.0, mscale_all_dim=0.7)


def mla_config(**overrides: Any) -> MLATransformerConfig:
    """A tiny MLA config with YaRN RoPE (fp32, CPU initialization)."""
    return MLATransformerConfig(**{**SHAPE, **YARN, **overrides})


class DenseAbsorbedCoreAttention(MegatronModule):
    """Causal softmax attention over the absorbed layout, written out directly (a reference, not a kernel).

    Query ``[sq, b, n, c + r]``, one key head ``[sk, b, 1, c + r]``, ``value=None`` (the value is the key's
    first ``v_channels`` channels); returns the latent ``[sq, b, n * v_channels]`` (or ``[t, n * v_channels]``
    for packed sequences, whose documents attend only within themselves).
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 softmax_scale: float | None = None, k_channels: int | None = None, v_channels: int | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config)
        self.softmax_scale, self.v_channels = softmax_scale, v_channels

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                attention_mask: torch.Tensor | None, x: torch.Tensor | None = None, qr: torch.Tensor | None = None,
                up_v_weight: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                attn_mask_type: AttnMaskType | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        """The latent attention output (see the class docstring)."""
        assert value is None and key.shape[2] == 1 and up_v_weight is not None and x is not None and qr is not None
        sq, sk = query.shape[0], key.shape[0]
        scores = torch.einsum("sbnd,tbd->bnst", query, key[:, :, 0]) * self.softmax_scale
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril()
        if packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q.tolist()
            doc = torch.zeros(sq, dtype=torch.long, device=query.device)
            for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
                doc[a:b] = i
            allowed = allowed & (doc[:, None] == doc[None, :])
        probs = F.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out = torch.einsum("bnst,tbc->sbnc", probs, key[:, :, 0, :self.v_channels])
        out = out.reshape(sq, query.shape[1], -1)
        return out.squeeze(1) if packed_seq_params is not None else out


def standard_attention_spec(qk_layernorm: bool = True) -> ModuleSpec:
    """The local GPT spec's ``MLASelfAttention`` spec (causal, ``DotProductAttention``)."""
    layer = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=qk_layernorm)
    return layer.submodules.self_attention


def absorbed_attention_spec(qk_layernorm: bool = True, core_attention: Any = DenseAbsorbedCoreAttention
                            ) -> ModuleSpec:
    """The same parts as :func:`standard_attention_spec`, as ``AbsorbedMLASelfAttention`` over ``core_attention``."""
    std = standard_attention_spec(qk_layernorm).submodules
    names = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
             "linear_proj", "q_layernorm", "kv_layernorm")
    subs = AbsorbedMLASelfAttentionSubmodules(core_attention=core_attention,
                                              **{n: getattr(std, n) for n in names})
    return ModuleSpec(module=AbsorbedMLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=subs)


def perturb_norms(module: torch.nn.Module, seed: int = 11) -> None:
    """Move the latent norms' weights off 1 so that checks see them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "layernorm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))


def layer_pair(cfg: MLATransformerConfig, seed: int = 3, absorbed_core: Any = DenseAbsorbedCoreAttention
               ) -> tuple[MLASelfAttention, AbsorbedMLASelfAttention]:
    """A standard MLA layer and an absorbed one holding its weights (loaded through the state dict, strict)."""
    torch.manual_seed(seed)
    standard = build_module(standard_attention_spec(cfg.qk_layernorm), config=cfg, layer_number=1)
    perturb_norms(standard)
    absorbed = build_module(absorbed_attention_spec(cfg.qk_layernorm, absorbed_core), config=cfg, layer_number=1)
    absorbed.load_state_dict(standard.state_dict(), strict=True)
    return standard, absorbed


def inputs(seq: int = SEQ, batch: int = BATCH, seed: int = 1, dtype: torch.dtype = torch.float32
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [seq, batch, hidden], output weights [seq, batch, hidden])`` for a loss ``(out * w).sum()``."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(seq, batch, HIDDEN, generator=gen).to(dtype),
            torch.randn(seq, batch, HIDDEN, generator=gen).to(dtype))


def run_layer(layer: torch.nn.Module, x: torch.Tensor, w: torch.Tensor, **kwargs: Any
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(output, input gradient, parameter gradients)`` of ``(layer(x) * w).sum()``."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out, bias = layer(x, None, **kwargs)
    assert bias is None
    (out * w).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.detach(), grads


def assert_same_run(got: tuple, want: tuple, tol: dict | None = None) -> None:
    """Outputs, input gradients and every parameter gradient match (same names, same values)."""
    tol = tol or TOL
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    assert sorted(got[2]) == sorted(want[2])
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], **tol, msg=lambda m, n=name: f"{n}: {m}")
