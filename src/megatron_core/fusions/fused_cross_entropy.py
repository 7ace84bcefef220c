"""Vocab-parallel cross entropy in fused passes (Megatron-Core's ``fusions.fused_cross_entropy``).

The loss of :func:`~megatron_core.tensor_parallel.vocab_parallel_cross_entropy` (no label
smoothing) with fewer passes over the ``[s, b, V / TP]`` logits and less memory: the forward reads
the logits twice (local max, then shifted sum of exponentials and the target logit; the max and the
two sums are all-reduced over TP in between) and keeps only the logits it was given plus one
log-sum-exp per token; the backward writes ``(softmax - onehot) * grad`` in one pass, in the
logits' dtype. Each pass is a ``jit_fuser`` function, one kernel on an accelerator. No fp32 copy of
the logits or of the log-probabilities is stored.

The ``calculate_*`` helpers are Megatron-Core's steps of its own fused cross entropy, each a thin wrapper over
the matching :class:`~megatron_core.tensor_parallel.cross_entropy.VocabParallelCrossEntropy` step (the target and
sum-of-exponential logits travel concatenated, ready for one all-reduce); this module's loss does not use them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.jit import jit_fuser
from megatron_core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron_core.tensor_parallel.groups import resolve_tp_group
from megatron_core.tensor_parallel.mappings import _all_reduce_
from megatron_core.tensor_parallel.utils import VocabUtility

__all__ = [
    "calculate_cross_entropy_loss",
    "calculate_gradients",
    "calculate_logits_max",
    "calculate_predicted_logits",
    "fused_vocab_parallel_cross_entropy",
]


def calculate_logits_max(vocab_parallel_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits in fp32 and their max over this rank's vocabulary shard (to be all-reduced with MAX)."""
    return VocabParallelCrossEntropy.calculate_logits_max(vocab_parallel_logits)


def calculate_predicted_logits(
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor, logits_max: torch.Tensor, vocab_start_index: int,
    vocab_end_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(target_mask, masked_target_1d, predicted_and_sum_exp, exp_logits)`` of the max-shifted logits.

    ``predicted_and_sum_exp`` is the target logit (0 where another rank owns the target) followed by the sum of
    exponentials, concatenated along the first dimension so that one SUM all-reduce covers both.
    """
    target_mask, masked_target_1d, predicted, sum_exp, exp_logits = VocabParallelCrossEntropy.calculate_predicted_logits(
        vocab_parallel_logits, target, logits_max, vocab_start_index, vocab_end_index)
    return target_mask, masked_target_1d, torch.cat((predicted, sum_exp)), exp_logits


def calculate_cross_entropy_loss(
    exp_logits: torch.Tensor, predicted_logits_sum_exp_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax over this shard, per-token loss)`` from the all-reduced :func:`calculate_predicted_logits` pair."""
    predicted, sum_exp = torch.split(predicted_logits_sum_exp_logits, predicted_logits_sum_exp_logits.size(0) // 2)
    return VocabParallelCrossEntropy.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)


def calculate_gradients(
    softmax: torch.Tensor, grad_output: torch.Tensor, target_mask: torch.Tensor, masked_target_1d: torch.Tensor
) -> torch.Tensor:
    """``(softmax - onehot(target)) * grad_output`` on this shard, returned in bf16 as Megatron-Core's does."""
    grad_2d, arange_1d, softmax_update, grad_input = VocabParallelCrossEntropy.prepare_gradient_calculation_operands(
        softmax, target_mask)
    grad_input = VocabParallelCrossEntropy.calculate_gradients(
        grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output)
    return grad_input.to(torch.bfloat16)


@jit_fuser
def _local_max(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().amax(dim=-1)


@jit_fuser
def _shifted_sums(logits: torch.Tensor, logits_max: torch.Tensor, local_target: torch.Tensor,
                  owned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_v exp(logit_v - max)`` and the shifted target logit (0 where another rank owns the target)."""
    shifted = logits.float() - logits_max.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)
    predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * owned
    return sum_exp, predicted


@jit_fuser
def _gradient(logits: torch.Tensor, log_sum_exp: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor,
              grad_output: torch.Tensor) -> torch.Tensor:
    """``(softmax - onehot(target)) * grad_output`` on the local shard, in the logits' dtype."""
    softmax = (logits.float() - log_sum_exp.unsqueeze(-1)).exp()
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (vocab == local_target.unsqueeze(-1)) & owned.unsqueeze(-1).bool()
    return ((softmax - onehot.float()) * grad_output.unsqueeze(-1).float()).to(logits.dtype)


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits: torch.Tensor, target: torch.Tensor, tp_group) -> torch.Tensor:
        world_size = get_pg_size(tp_group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            vocab_parallel_logits.shape[-1], get_pg_rank(tp_group), world_size)
        owned = (target >= start) & (target < end)
        local_target = torch.where(owned, target - start, torch.zeros_like(target))
        owned = owned.float()
        logits_max = _local_max(vocab_parallel_logits)
        if world_size > 1:
            _all_reduce_(logits_max, tp_group, op=dist.ReduceOp.MAX)
        sum_exp, predicted = _shifted_sums(vocab_parallel_logits, logits_max, local_target, owned)
        if world_size > 1:
            sums = _all_reduce_(torch.stack((sum_exp, predicted)), tp_group)
            sum_exp, predicted = sums[0], sums[1]
        log_sum_exp_shifted = torch.log(sum_exp)
        ctx.save_for_backward(vocab_parallel_logits, log_sum_exp_shifted + logits_max, local_target, owned)
        return log_sum_exp_shifted - predicted

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        logits, log_sum_exp, local_target, owned = ctx.saved_tensors
        return _gradient(logits, log_sum_exp, local_target, owned, grad_output), None, None


def fused_vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                       tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Per-token cross entropy (shape of ``target``, fp32) of logits ``[..., V / TP]`` split over TP.

    ``target`` holds global token ids in ``[0, V)``; the gradient comes back in the logits' dtype.
    """
    if tuple(vocab_parallel_logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"logits of shape {tuple(vocab_parallel_logits.shape)} do not match target of shape "
            f"{tuple(target.shape)}: expected logits [*target.shape, V / TP]"
        )
    tp_group = resolve_tp_group(tp_group)
    return _FusedVocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group)
