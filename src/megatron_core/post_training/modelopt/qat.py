"""Quantization-aware training (QAT): training continues on a model that Model Optimizer fake-quantizes.

Megatron-LM's QAT is ``pretrain_gpt.py`` run on a checkpoint quantized by Model Optimizer: the quantizers
stay in the linear layers, their amax as calibrated, and the weights keep training in high precision
while every forward sees them (and the activations) quantized; the gradients pass the rounding
straight through (Model Optimizer's fake-quant functions). Here:

* :func:`quantize_for_training` quantizes and calibrates (``mtq.quantize``) and checks that calibration
  reached every quantizer;
* :func:`token_windows` cuts training batches from a token stream (e.g. the main job's corpus as bytes),
  the same on every rank of a model-parallel group;
* :func:`train_steps` runs N steps with this library's optimizer
  (:func:`~megatron_core.optimizer.get_megatron_optimizer`): the loss averaged over the loss-masked tokens,
  backward, ``optimizer.step()``. A ``loss_func`` such as :func:`.distillation.distillation_loss` makes the
  same loop distil (quantization-aware distillation when the student is quantized too).

Under tensor parallelism the quantizers' amax agree over TP (:mod:`.quant_modules`) and the per-token loss
is whole on every rank, so a TP=N run follows the one-process run.
Under pipeline parallelism :func:`train_steps` (one model, no schedule) does not apply: each stage is
quantized with a ``forward_loop`` that runs the calibration batches through the pipeline schedule (forward
only), then trained with ``get_forward_backward_func()`` (with :func:`lm_loss` as the loss function) and the
same optimizer; the stages' amax need no agreeing (each holds its own layers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from megatron_core.distributed.finalize_model_grads import finalize_model_grads
from megatron_core.post_training.modelopt._backend import modelopt_modules
from megatron_core.post_training.modelopt.calibration import check_calibrated

__all__ = ["lm_loss", "quantize_for_training", "token_windows", "train_steps"]

LossFunc = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict]]


def quantize_for_training(model: torch.nn.Module, config: dict[str, Any],
                          forward_loop: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
    """``mtq.quantize(model, config, forward_loop)``, then ``ValueError`` if a quantizer was left uncalibrated.

    ``config``: a Model Optimizer quantization config (e.g. ``recipes.get_quant_config("FP8_DEFAULT_CFG")``).
    """
    model = modelopt_modules("quantization-aware training").mtq.quantize(model, config, forward_loop)
    check_calibrated(model)
    return model


def token_windows(tokens: torch.Tensor, seq_length: int, batch_size: int, num_batches: int, seed: int = 0,
                  ) -> Iterator[dict[str, torch.Tensor]]:
    """``num_batches`` batches of ``batch_size`` random windows of a 1-D token stream, as a GPT dataset gives them.

    Each batch holds ``tokens`` and ``labels`` (the next tokens) ``[b, seq_length]``, ``position_ids`` and a
    ``loss_mask`` of ones. The windows depend only on ``seed`` (the same on every rank). ``ValueError`` when
    the stream is shorter than one window or a size is not positive.
    """
    if seq_length <= 0 or batch_size <= 0 or num_batches <= 0:
        raise ValueError(f"seq_length ({seq_length}), batch_size ({batch_size}) and num_batches ({num_batches}) "
                         "must be positive")
    if tokens.dim() != 1 or tokens.numel() < seq_length + 1:
        raise ValueError(f"tokens must be a 1-D stream of at least seq_length + 1 ({seq_length + 1}) tokens; "
                         f"got shape {tuple(tokens.shape)}")
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(seq_length).unsqueeze(0).expand(batch_size, -1)
    for _ in range(num_batches):
        starts = torch.randint(0, tokens.numel() - seq_length, (batch_size,), generator=gen).tolist()
        window = torch.stack([tokens[s:s + seq_length + 1] for s in starts]).long()
        yield {"tokens": window[:, :-1], "labels": window[:, 1:], "position_ids": positions,
               "loss_mask": torch.ones(batch_size, seq_length)}


def lm_loss(model: torch.nn.Module, output_tensor: torch.Tensor, loss_mask: torch.Tensor,
            ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The plain language-model loss: ``(sum of the per-token loss over masked tokens, num_tokens, report)``."""
    dtype = torch.float64 if output_tensor.dtype == torch.float64 else torch.float32
    loss = torch.sum(output_tensor.reshape(-1).to(dtype) * loss_mask.reshape(-1).to(dtype))
    num_tokens = loss_mask.sum().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.to(dtype)])}


def train_steps(model: torch.nn.Module, optimizer: Any, batches: Iterable[dict[str, torch.Tensor]],
                loss_func: LossFunc = lm_loss, on_step: Callable[[int, dict], None] | None = None) -> list[float]:
    """One optimizer step per batch; returns each step's loss (averaged over its loss-masked tokens).

    ``model(tokens, position_ids, None, labels=labels)`` gives the per-token loss; ``loss_func(model,
    per_token_loss, loss_mask)`` reduces it (:func:`lm_loss`, or :func:`.distillation.distillation_loss`);
    the mean over tokens is backpropagated, ``finalize_model_grads([model])`` finishes the gradient
    reductions (data-parallel for a DDP-wrapped model; over TP for ``sequence_parallel`` parameters such
    as the norms), and ``optimizer`` (a ``MegatronOptimizer``) steps.
    ``on_step(step, info)`` sees each step's ``report`` (means over tokens), ``grad_norm`` and ``loss``.
    ``RuntimeError`` when the optimizer skips a step (inf/nan gradients).
    """
    model.train()
    device = next(model.parameters()).device
    losses = []
    for step, batch in enumerate(batches):
        batch = {k: v.to(device) for k, v in batch.items()}
        optimizer.zero_grad()
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss_sum, num_tokens, report = loss_func(model, output, batch["loss_mask"])
        loss = loss_sum / num_tokens.clamp(min=1)
        loss.backward()
        finalize_model_grads([model])
        success, grad_norm, _ = optimizer.step()
        if not success:
            raise RuntimeError(f"step {step}: the optimizer skipped the update (inf or nan gradients)")
        losses.append(loss.item())
        if on_step is not None:
            means = {k: (v[0] / v[1].clamp(min=1)).item() for k, v in report.items()}
            on_step(step, {"loss": losses[-1], "grad_norm": grad_norm, "report": means})
    return losses
