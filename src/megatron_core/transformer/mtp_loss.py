"""The multi-token prediction loss (Megatron-Core's ``process_mtp_loss`` and ``MTPLossAutoScaler`` of
``transformer.multi_token_prediction``, which re-exports them).

The GPT model's hidden states after the MTP block are the decoder's followed by each depth's along the sequence.
:func:`process_mtp_loss` splits them, computes each depth's cross entropy against the labels rolled once more per
depth (masked, averaged over the valid positions) and attaches ``mtp_loss_scaling_factor / mtp_num_layers`` times
it to the decoder's hidden states through :class:`MTPLossAutoScaler`: the forward returns the main hidden states
unchanged (so the reported loss is the main loss) and the backward adds MTP's gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core._ground import get_pg_size
from megatron_core.transformer.loss_auto_scaler import LossAutoScaler
from megatron_core.transformer.mtp_metrics import MTPLossLoggingHelper, mtp_acceptance_counts
from megatron_core.transformer.mtp_roll import roll_tensor
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["MTPLossAutoScaler", "process_mtp_loss"]


class MTPLossAutoScaler(LossAutoScaler):
    """Identity on ``output`` whose backward also sends ``main_loss_backward_scale`` into ``mtp_loss``.

    ``set_loss_scale`` stores ``torch.as_tensor(scale)`` (the schedules set ``loss_scale / num_microbatches``).
    """

    main_loss_backward_scale: torch.Tensor = torch.tensor(1.0)

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, mtp_loss: torch.Tensor) -> torch.Tensor:
        """Return ``output`` unchanged and keep ``mtp_loss`` for the backward (Megatron-Core's argument name)."""
        return LossAutoScaler.forward(ctx, output, mtp_loss)


def process_mtp_loss(hidden_states: torch.Tensor, labels: torch.Tensor | None, loss_mask: torch.Tensor | None,
                     output_layer: Any, output_weight: torch.Tensor | None, runtime_gather_output: bool | None,
                     is_training: bool, compute_language_model_loss: Any, config: TransformerConfig,
                     cp_group: Any = None, tp_group: Any = None, packed_seq_params: Any = None,
                     scale_logits_fn: Any = None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Split ``hidden_states`` (the decoder's, then each MTP depth's, along the sequence) and return the decoder's
    part with every depth's loss attached for the backward (see the module docstring).

    ``labels [b, s]`` (else derived from ``input_ids`` rolled left); ``loss_mask [b, s]`` (else all ones). With
    ``calculate_per_token_loss`` each depth's summed loss is rescaled by ``original tokens / depth tokens``, since
    ``finalize_model_grads`` divides by the main loss's token count.
    """
    depths = config.mtp_num_layers
    parts = torch.chunk(hidden_states, 1 + depths, dim=0)
    hidden_states = parts[0]
    from_ids = labels is None
    if from_ids:
        if input_ids is None:
            return hidden_states
        labels, _ = roll_tensor(input_ids, cp_group=cp_group, packed_seq_params=packed_seq_params)
    if config.mtp_detach_heads:
        output_weight = (output_weight if output_weight is not None else output_layer.weight).detach()
    mtp_labels = labels.clone()
    loss_mask = torch.ones_like(mtp_labels) if loss_mask is None else loss_mask
    if from_ids:  # the rolled-in last label is not a real token
        loss_mask, _ = roll_tensor(loss_mask, cp_group=cp_group, packed_seq_params=packed_seq_params)
    original_num_tokens = loss_mask.sum()
    scale = config.mtp_loss_scaling_factor / depths
    vocab_sharded = (not runtime_gather_output if runtime_gather_output is not None
                     else not getattr(output_layer, "gather_output", False))
    for depth in range(depths):
        logits, _ = output_layer(parts[depth + 1], weight=output_weight, runtime_gather_output=runtime_gather_output)
        if scale_logits_fn is not None:
            logits = scale_logits_fn(logits)
        mtp_labels, _ = roll_tensor(mtp_labels, cp_group=cp_group, packed_seq_params=packed_seq_params)
        loss_mask, num_tokens = roll_tensor(loss_mask, cp_group=cp_group, packed_seq_params=packed_seq_params)
        mtp_loss = loss_mask * compute_language_model_loss(mtp_labels, logits)
        if is_training:
            logged = mtp_loss.sum() * (num_tokens > 0).to(mtp_loss.dtype) / num_tokens.clamp(min=1)
            correct, total = mtp_acceptance_counts(logits, mtp_labels, loss_mask, vocab_sharded, tp_group)
            MTPLossLoggingHelper.save_metrics_to_tracker(
                logged, correct, total, depth, depths,
                avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True)
                if parallel_state.model_parallel_is_initialized() else None)
        if config.calculate_per_token_loss:
            whole, shifted = _tokens_over_cp(original_num_tokens, num_tokens, cp_group)
            attached = scale * mtp_loss * (whole / shifted.clamp(min=1))
        else:
            attached = scale * mtp_loss / num_tokens.clamp(min=1)
        hidden_states = MTPLossAutoScaler.apply(hidden_states, attached)
    return hidden_states


def _tokens_over_cp(original_num_tokens: torch.Tensor, num_tokens: torch.Tensor, cp_group: Any
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The main loss's and a depth's valid-token counts over the whole sequence: summed over the CP group.

    Megatron-Core rescales by this rank's own counts, so a rank whose chunk loses a different share of tokens to the
    roll weighs its depth loss differently from one process (about 1e-3 in the gradients at CP=2); the ratio of the
    sequence's counts is the one a single process uses (docs/compat.md).
    """
    if cp_group is None or get_pg_size(cp_group) <= 1:
        return original_num_tokens, num_tokens
    counts = torch.stack([original_num_tokens.detach(), num_tokens.detach()]).to(torch.float32)
    dist.all_reduce(counts, group=cp_group)
    return counts[0], counts[1]
