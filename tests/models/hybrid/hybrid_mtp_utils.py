"""A tiny hybrid model with multi-token prediction ("M*M-/*M/*M": decoder "M*M-", two MTP depths of "*M") and the
direct computation of its training objective from its own modules, shared by the hybrid MTP tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from tests.models.mamba.mamba_test_utils import VOCAB, config

PATTERN = "M*M-/*M/*M"
MAX_SEQ = 32


def build(pattern: str = PATTERN, seed: int = 0, **overrides) -> HybridModel:
    """The hybrid MTP model of ``pattern`` (RoPE; ``mtp_num_layers`` = the pattern's depths unless overridden)."""
    main, *depths = pattern.split("/")
    overrides = {"mtp_num_layers": len(depths) or None, **overrides}
    torch.manual_seed(seed)
    return HybridModel(config(main.replace("|", ""), **overrides), hybrid_stack_spec, VOCAB, MAX_SEQ,
                       hybrid_layer_pattern=pattern, position_embedding_type="rope")


def make_batch(seed: int = 3, batch: int = 2, seq: int = 12) -> tuple[torch.Tensor, ...]:
    """``(input_ids, position_ids, labels, loss_mask)``, each ``[b, s]``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    loss_mask = (torch.rand(batch, seq, generator=gen) > 0.2).float()
    return ids, torch.arange(seq).expand(batch, -1), labels, loss_mask


def shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x [b, s]`` shifted left ``k`` tokens, zero-filled."""
    return torch.cat([x[:, k:], torch.zeros_like(x[:, :k])], dim=1) if k else x


def direct_objective(model: HybridModel, ids, pos, labels, loss_mask) -> tuple[torch.Tensor, torch.Tensor, list]:
    """``(per-token main loss [b, s], main mean + scale / D * sum_k masked mean of depth k's loss, depth losses)``.

    Depth k embeds the ids shifted k tokens, projects ``[enorm(embedding); hnorm(previous hidden)]``, runs its
    hybrid stack and final norm, and is scored against the labels shifted k tokens under the shifted mask.
    """
    cfg = model.config
    batch, seq = ids.shape
    rope = model.rotary_pos_emb(seq).to(ids.device)  # built on the current device, as in the model
    hidden = model.decoder(hidden_states=model.embedding(input_ids=ids, position_ids=pos), attention_mask=None,
                           rotary_pos_emb=rope)

    def token_loss(h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits, _ = model.output_layer(h)
        return F.cross_entropy(logits.transpose(0, 1).reshape(-1, VOCAB), target.reshape(-1),
                               reduction="none").view(batch, seq)

    main = token_loss(hidden, labels)
    total, depth_losses = main.mean(), []
    for k in range(1, cfg.mtp_num_layers + 1):
        layer = model.mtp.layers[0 if cfg.mtp_use_repeated_layer else k - 1]
        e = model.embedding(input_ids=shift(ids, k), position_ids=shift(pos, k))
        x, _ = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(hidden)], dim=-1))
        for inner in layer.mtp_model_layer.layers:  # the depth's pattern, layer by layer
            out = inner(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
            x = out[0] if isinstance(out, tuple) else out
        hidden = layer.final_layernorm(x)
        mask = shift(loss_mask, k)
        depth_losses.append((token_loss(hidden, shift(labels, k)) * mask).sum() / mask.sum())
        total = total + cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers * depth_losses[-1]
    return main, total, depth_losses
