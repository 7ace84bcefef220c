"""Cross entropy over logits whose vocabulary dim is split across tensor-parallel ranks.

Each rank holds ``[s, b, V / TP]`` logits. The loss equals ``F.cross_entropy`` on the gathered
``[s, b, V]`` logits (per token, no reduction) without gathering them: the max, the target
logit and the sum of exponentials are all-reduced (the last two in one call). Label smoothing
follows ``F.cross_entropy``: ``(1 - eps) * nll + eps * mean_v(-log p_v)``. The backward is the
closed form ``softmax - (1 - eps) * onehot - eps / V`` on the local shard, with no communication.
With a tensor-parallel group of one it is ``F.cross_entropy`` on fp32 logits (same result, one kernel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.tensor_parallel.groups import resolve_tp_group
from megatron_core.tensor_parallel.mappings import _all_reduce_
from megatron_core.tensor_parallel.utils import VocabUtility


class VocabParallelCrossEntropy:
    """The local (communication-free) steps of the vocab-parallel cross entropy, as in Megatron-Core."""

    @staticmethod
    def calculate_logits_max(vocab_parallel_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits in fp32 and their local max over the vocabulary shard."""
        vocab_parallel_logits = vocab_parallel_logits.float()
        return vocab_parallel_logits, vocab_parallel_logits.max(dim=-1)[0]

    @staticmethod
    def calculate_predicted_logits(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        logits_max: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shift by the global max; return (target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits).

        ``predicted_logits`` is the shifted target logit on the rank that owns the target id and 0
        elsewhere; ``target_mask`` is True where this rank does not own the target.
        """
        shifted = vocab_parallel_logits - logits_max.unsqueeze(-1)
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = (target - vocab_start_index).masked_fill(target_mask, 0)
        partition_vocab_size = shifted.size(-1)
        logits_2d = shifted.reshape(-1, partition_vocab_size)
        masked_target_1d = masked_target.reshape(-1)
        arange_1d = torch.arange(logits_2d.size(0), device=logits_2d.device)
        predicted_logits = logits_2d[arange_1d, masked_target_1d].reshape(target.shape)
        predicted_logits = predicted_logits.masked_fill(target_mask, 0.0)
        exp_logits = shifted.exp()
        sum_exp_logits = exp_logits.sum(dim=-1)
        return target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits

    @staticmethod
    def calculate_cross_entropy_loss(
        exp_logits: torch.Tensor, predicted_logits: torch.Tensor, sum_exp_logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """From global sums: (softmax over the local shard, per-token loss ``log(sum exp) - target logit``)."""
        loss = torch.log(sum_exp_logits) - predicted_logits
        softmax = exp_logits / sum_exp_logits.unsqueeze(-1)
        return softmax, loss

    @staticmethod
    def prepare_gradient_calculation_operands(
        softmax: torch.Tensor, target_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(grad_2d view, row indices, 1 where this rank owns the target, grad_input buffer)."""
        grad_input = softmax.clone()
        grad_2d = grad_input.view(-1, softmax.size(-1))
        arange_1d = torch.arange(grad_2d.size(0), device=grad_2d.device)
        softmax_update = 1.0 - target_mask.reshape(-1).float()
        return grad_2d, arange_1d, softmax_update, grad_input

    @staticmethod
    def calculate_gradients(
        grad_2d: torch.Tensor,
        arange_1d: torch.Tensor,
        masked_target_1d: torch.Tensor,
        softmax_update: torch.Tensor,
        grad_input: torch.Tensor,
        grad_output: torch.Tensor,
    ) -> torch.Tensor:
        """``(softmax - onehot) * grad_output`` on the local shard."""
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        return grad_input.mul_(grad_output.unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, tp_group):
        logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(vocab_parallel_logits)
        _all_reduce_(logits_max, tp_group, op=dist.ReduceOp.MAX)
        partition_vocab_size = logits.size(-1)
        world_size = get_pg_size(tp_group)
        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, get_pg_rank(tp_group), world_size
        )
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(logits, target, logits_max, vocab_start, vocab_end)
        )
        vocab_size = partition_vocab_size * world_size
        # One all-reduce for every per-token sum; the smoothing term needs sum_v(shifted logit_v).
        sums = [predicted, sum_exp]
        if label_smoothing > 0.0:
            sums.append((logits - logits_max.unsqueeze(-1)).sum(dim=-1))
        reduced = _all_reduce_(torch.stack(sums), tp_group)
        predicted, sum_exp = reduced[0], reduced[1]
        softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        if label_smoothing > 0.0:
            mean_log_probs = reduced[2] / vocab_size - torch.log(sum_exp)
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_probs
        ctx.label_smoothing = label_smoothing
        ctx.vocab_size = vocab_size
        ctx.input_dtype = vocab_parallel_logits.dtype
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, softmax_update, grad_input = (
            VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, target_mask)
        )
        smoothing = ctx.label_smoothing
        if smoothing > 0.0:
            grad_2d[arange_1d, masked_target_1d] -= (1.0 - smoothing) * softmax_update
            grad_2d -= smoothing / ctx.vocab_size
            grad_input.mul_(grad_output.unsqueeze(-1))
        else:
            grad_input = VocabParallelCrossEntropy.calculate_gradients(
                grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output
            )
        return grad_input.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-token cross entropy (shape of ``target``) of logits split over TP along the last dim.

    ``vocab_parallel_logits``: ``[..., V / TP]`` (any float dtype; computed in fp32);
    ``target``: ``[...]`` global token ids in ``[0, V)``.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing ({label_smoothing}) must be in [0, 1)")
    if tuple(vocab_parallel_logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"logits of shape {tuple(vocab_parallel_logits.shape)} do not match target of shape "
            f"{tuple(target.shape)}: expected logits [*target.shape, V / TP]"
        )
    tp_group = resolve_tp_group(tp_group)
    if get_pg_size(tp_group) == 1:
        # The whole vocabulary is local: torch's fused log-softmax kernel, still computed in fp32.
        logits_2d = vocab_parallel_logits.float().reshape(-1, vocab_parallel_logits.size(-1))
        return F.cross_entropy(logits_2d, target.reshape(-1), reduction="none",
                               label_smoothing=label_smoothing).reshape(target.shape)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, tp_group)
