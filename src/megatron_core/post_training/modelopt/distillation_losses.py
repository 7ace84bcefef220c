"""Knowledge-distillation losses for models whose logits are split over tensor parallelism.

Megatron-LM distils with Model Optimizer's Megatron plugin (``modelopt.torch.distill.plugins.megatron``:
``LogitsKLLoss``, ``MSELoss``, ``HiddenStateCosineLoss``, ``ProjectionLayer``), which is written against
NVIDIA's ``megatron.core``; these are this library's losses with the same names, arguments and outputs,
on this library's process groups.

Each loss takes the student's and the teacher's captured layer outputs (``[s, b, ...]``, or a layer's
``(output, bias)`` tuple) and returns the unreduced per-token loss ``[b, s]``, the layout of the language
model loss, so the caller masks and averages it over tokens (:mod:`.distillation`).

The logit KL (:func:`vocab_parallel_kl_divergence`) works on vocab-parallel logits ``[s, b, V / TP]``
without gathering them: the maxima and the sums of exponentials are all-reduced over the TP group (as
the vocab-parallel cross entropy does), and the per-token KL is the all-reduced sum of each rank's part,
so every TP rank holds the whole per-token KL. The backward is the closed form on the local shard
(``(p_student - p_teacher) / T`` for the forward KL), so TP=N gives the one-process gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.loss import _Loss

from megatron_core.tensor_parallel.groups import resolve_tp_group
from megatron_core.tensor_parallel.mappings import _all_reduce_, gather_from_sequence_parallel_region

__all__ = ["HiddenStateCosineLoss", "LogitsKLLoss", "MSELoss", "ProjectionLayer", "vocab_parallel_kl_divergence"]


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 logits (the KL is never computed in half precision)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _log_softmax(logits: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """Log-softmax over the vocabulary split across ``tp_group`` (last dim local); works in place on ``logits``."""
    logits_max = _all_reduce_(logits.max(dim=-1, keepdim=True)[0], tp_group, op=dist.ReduceOp.MAX)
    logits -= logits_max
    sum_exp = _all_reduce_(logits.exp().sum(dim=-1, keepdim=True), tp_group)
    return logits.sub_(sum_exp.log())


class _VocabParallelKL(torch.autograd.Function):
    """Per-token KL between vocab-parallel student and teacher logits; the gradient flows to the student only."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, temperature: float, reverse: bool,
                tp_group: Any) -> torch.Tensor:
        dtype = _compute_dtype(student)
        log_s = _log_softmax(student.to(dtype) / temperature, tp_group)
        log_t = _log_softmax(teacher.detach().to(dtype) / temperature, tp_group)
        p_s, p_t = log_s.exp(), log_t.exp()
        if reverse:  # KL(student || teacher)
            local = (p_s * (log_s - log_t)).sum(dim=-1)
        else:  # KL(teacher || student)
            local = (p_t * (log_t - log_s)).sum(dim=-1)
        kl = _all_reduce_(local, tp_group)
        ctx.temperature, ctx.reverse, ctx.input_dtype = temperature, reverse, student.dtype
        if reverse:
            ctx.save_for_backward(p_s, log_s - log_t, kl)
        else:
            ctx.save_for_backward(p_s, p_t)
        return kl

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if ctx.reverse:
            # d KL(s||t) / d z_s = p_s * (log p_s - log p_t - KL) / T
            p_s, log_ratio, kl = ctx.saved_tensors
            grad = p_s * (log_ratio - kl.unsqueeze(-1))
        else:
            p_s, p_t = ctx.saved_tensors
            grad = p_s - p_t
        grad = grad * (grad_output.unsqueeze(-1) / ctx.temperature)
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_kl_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                                 temperature: float = 1.0, reverse: bool = False, tp_group: Any = None,
                                 ) -> torch.Tensor:
    """Per-token KL divergence ``[...]`` between logits ``[..., V / TP]`` split over ``tp_group``'s ranks.

    ``KL(teacher || student)`` of the softmaxes of ``logits / temperature`` (``reverse``: ``KL(student ||
    teacher)``), computed in fp32 (fp64 for fp64 logits), equal to the KL of the gathered logits; the
    teacher gets no gradient. ``ValueError`` when the shapes differ or ``temperature`` is not positive.
    """
    if not temperature > 0:
        raise ValueError(f"temperature ({temperature}) must be > 0: the logits are divided by it")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} must have "
            "the same shape ([s, b, V / TP]): distillation needs the same vocabulary (and TP size) for both models"
        )
    tp_group = resolve_tp_group(tp_group)
    return _VocabParallelKL.apply(student_logits, teacher_logits, float(temperature), bool(reverse), tp_group)


class _DistillationLoss(_Loss):
    """Shared part of the losses: unwrap ``(output, bias)``, project the student, detach the teacher.

    A torch ``_Loss``, the type Model Optimizer's ``criterion`` takes.
    """

    def __init__(self, model_config: Any, projection_layer: torch.nn.Module | None = None) -> None:
        super().__init__()
        self._config = model_config
        self._projection = projection_layer

    def pre_forward(self, predictions: Any, targets: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The student's output (projected to the teacher's width where a projection is set) and the detached teacher's."""
        if isinstance(predictions, tuple):
            predictions, targets = predictions[0], targets[0]
        if self._projection is not None:
            predictions = self._projection(predictions)
        return predictions, targets.detach()

    def post_forward(self, loss: torch.Tensor) -> torch.Tensor:
        """``[s, b]`` (the sequence split over TP under sequence parallelism) -> ``[b, s]`` of the whole sequence."""
        if getattr(self._config, "sequence_parallel", False):
            # every TP rank gets the whole sequence; the backward keeps this rank's part (no reduction)
            loss = gather_from_sequence_parallel_region(loss, tensor_parallel_output_grad=False)
        return loss.transpose(0, 1).contiguous()


class LogitsKLLoss(_DistillationLoss):
    """Per-token KL divergence ``[b, s]`` between the student's and the teacher's vocab-parallel logits ``[s, b, V / TP]``.

    ``temperature`` divides both logits before the softmax (must be > 0; the loss is not rescaled by
    ``T**2``); ``reverse`` takes ``KL(student || teacher)`` instead of ``KL(teacher || student)``;
    ``tp_group``: the group the vocabulary is split over (default: this process's TP group).
    """

    def __init__(self, model_config: Any, temperature: float = 1.0, reverse: bool = False,
                 tp_group: Any = None) -> None:
        if not temperature > 0:
            raise ValueError(f"logit_kl_temperature ({temperature}) must be > 0: the logits are divided by it")
        super().__init__(model_config)
        self._temperature = float(temperature)
        self._reverse = reverse
        self._tp_group = tp_group

    def forward(self, predictions: Any, targets: Any) -> torch.Tensor:
        """The per-token KL ``[b, s]`` (the whole vocabulary's, on every TP rank)."""
        predictions, targets = self.pre_forward(predictions, targets)
        kl = vocab_parallel_kl_divergence(predictions, targets, self._temperature, self._reverse, self._tp_group)
        return kl.transpose(0, 1).contiguous()


class MSELoss(_DistillationLoss):
    """Per-token mean squared error ``[b, s]`` between hidden states ``[s, b, h]`` (mean over ``h``)."""

    def forward(self, predictions: Any, targets: Any) -> torch.Tensor:
        """``mean_h (student - teacher)**2`` per token."""
        predictions, targets = self.pre_forward(predictions, targets)
        return self.post_forward(F.mse_loss(predictions, targets, reduction="none").mean(dim=-1))


class HiddenStateCosineLoss(_DistillationLoss):
    """Per-token cosine loss ``1 - cos(student, teacher)`` ``[b, s]`` between hidden states ``[s, b, h]``.

    The hidden dim must be whole on every rank (e.g. a norm's or a transformer layer's output).
    """

    def forward(self, predictions: Any, targets: Any) -> torch.Tensor:
        """``1 - cos`` per token."""
        predictions, targets = self.pre_forward(predictions, targets)
        loss = 1.0 - F.cosine_similarity(predictions, targets, dim=-1)
        return self.post_forward(loss)


class ProjectionLayer(torch.nn.Module):
    """Maps the student's hidden states to the teacher's width (identity when they are equal).

    A ``Linear(student.hidden_size, teacher.hidden_size)`` initialised with the student config's
    ``init_method`` (bias zero), replicated over TP; under sequence parallelism its parameters are
    marked ``sequence_parallel`` so their gradients are summed over TP like a norm's.
    """

    def __init__(self, student_config: Any, teacher_config: Any) -> None:
        super().__init__()
        if student_config.hidden_size == teacher_config.hidden_size:
            self._fit = torch.nn.Identity()
            return
        self._fit = torch.nn.Linear(student_config.hidden_size, teacher_config.hidden_size,
                                    dtype=student_config.params_dtype)
        with torch.no_grad():
            student_config.init_method(self._fit.weight)
            self._fit.bias.zero_()
        for param in self._fit.parameters():
            param.sequence_parallel = bool(student_config.sequence_parallel)

    def forward(self, student_tensor: torch.Tensor) -> torch.Tensor:
        """The projected hidden states ``[..., teacher.hidden_size]``."""
        return self._fit(student_tensor)
