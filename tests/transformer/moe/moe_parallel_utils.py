"""Helpers for the expert-parallel tests: a tiny MoE GPT, and moving weights through the global checkpoint layout.

The sharded state dict describes each rank's tensors as pieces of TP/EP/PP-independent global
tensors. :func:`global_tensors` assembles a single-process model's globals; :func:`load_globals`
copies the matching pieces into a parallel model, and :func:`local_vs_global` pairs each local
piece of a parallel model with the reference global slice, for any layout.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from megatron_core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron_core.transformer import TransformerConfig
from tests.models.gpt_test_utils import MAX_SEQ, SEQ, VOCAB

__all__ = ["FLAVOURS", "MAX_SEQ", "SEQ", "VOCAB", "batches", "build"]

FLAVOURS = {
    # Mixtral-like: softmax top-2, aux + z losses.
    "mixtral": dict(moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3),
    # DeepSeek-like: sigmoid scores, aux-loss-free expert bias, a gated shared expert, a sequence aux loss.
    "deepseek": dict(moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_bias_update_rate=0.01, moe_shared_expert_intermediate_size=16,
                     moe_shared_expert_gate=True, moe_router_load_balancing_type="seq_aux_loss",
                     moe_aux_loss_coeff=0.02),
}


def build(flavour: str, pre_process: bool = True, post_process: bool = True, **overrides) -> GPTModel:
    """A 2-layer MoE GPT (4 experts, SwiGLU, RMSNorm, RoPE, no biases, tied embeddings) on CPU."""
    cfg = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
               num_moe_experts=4, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
               **FLAVOURS[flavour])
    cfg.update(overrides)
    config = TransformerConfig(**cfg)
    return GPTModel(config, get_gpt_decoder_block_spec(config, False), VOCAB, MAX_SEQ, position_embedding_type="rope",
                    pre_process=pre_process, post_process=post_process)


def batches(num: int, seed: int = 3, seq: int = SEQ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``num`` micro-batches ``(ids, position_ids, labels)`` of shape ``[1, seq]``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        ids = torch.randint(0, VOCAB, (1, seq), generator=gen)
        labels = torch.randint(0, VOCAB, (1, seq), generator=gen)
        out.append((ids, torch.arange(seq).unsqueeze(0), labels))
    return out


def shards(model: torch.nn.Module) -> Iterator[ShardedTensor]:
    """Every ``ShardedTensor`` of ``model``'s sharded state dict (factories built)."""
    for item in model.sharded_state_dict().values():
        if isinstance(item, ShardedTensorFactory):
            built = item.build()
            yield from (built.values() if isinstance(built, dict) else built)
        elif isinstance(item, ShardedTensor):
            yield item


def global_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The global tensors of a single-process ``model`` (every piece is local)."""
    out: dict[str, torch.Tensor] = {}
    for shard in shards(model):
        full = out.setdefault(shard.key, torch.zeros(shard.global_shape, dtype=shard.data.dtype))
        full[shard.global_slice()] = shard.data.detach()
    return out


def load_globals(model: torch.nn.Module, globals_: dict[str, torch.Tensor]) -> None:
    """Copy each local piece of ``model`` from ``globals_``."""
    with torch.no_grad():
        for shard in shards(model):
            shard.data.copy_(globals_[shard.key][shard.global_slice()])


def local_vs_global(model: torch.nn.Module, globals_: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(key, local piece, matching reference slice)`` for every piece of ``model``."""
    for shard in shards(model):
        yield shard.key, shard.data.detach(), globals_[shard.key][shard.global_slice()]


def sequential_to_grouped_state(state: dict) -> dict:
    """A ``SequentialMLP`` model's state dict in the grouped layout's keys (``...experts.linear_fc1.weight<e>``)."""
    converted = {}
    for key, value in state.items():
        if ".local_experts." in key:
            head, rest = key.split(".local_experts.")
            idx, fc, _ = rest.split(".", 2)
            if key.endswith(".weight"):
                converted[f"{head}.{fc}.weight{idx}"] = value
        elif not key.endswith("_extra_state"):
            converted[key] = value
    return converted
