"""Knowledge distillation of a GPT student from a frozen teacher through Model Optimizer's ``modelopt.torch.distill``.

Megatron-LM's post-training path (``megatron/post_training/model_builder.py`` and ``loss_func.py``, with
Model Optimizer's Megatron plugin) distils this way, and so does this module, on this library's models:

* :class:`DistillationConfig` holds the run's settings under Megatron-LM's names (``logit_layers``,
  ``intermediate_layer_pairs``, ``skip_lm_loss``, ``kd_loss_scale``, ``logit_kl_temperature``);
  :func:`setup_distillation_config` turns them into Model Optimizer's ``criterion`` (a TP-aware
  :class:`~.distillation_losses.LogitsKLLoss` between the logit layers, an MSE or cosine loss per
  intermediate pair, the student projected to the teacher's width where they differ) and a
  :class:`LogitsAndIntermediatesLossBalancer`.
* :func:`convert_to_distillation_model` wraps the student with ``mtd.convert(student, mode=[("kd_loss",
  ...)])``: Model Optimizer's ``DistillationModel`` runs the teacher (frozen, without gradients) before the
  student on every forward and captures the named layers' outputs through forward hooks. Model
  Optimizer drives this library's modules as they are (hooks only; nothing of its Megatron plugin,
  which imports NVIDIA's ``megatron.core``, is needed): only the losses are this library's own.
* :func:`distillation_loss` is Megatron-LM's loss function: the LM loss and each distillation loss masked
  and summed over tokens (``DistillationModel.compute_kd_loss``), balanced into one total, with the
  number of tokens to average by.

Every loss is whole on each TP rank (the logit KL all-reduces its vocabulary parts), so the loss needs no
further reduction over TP. Under pipeline parallelism student and teacher activations travel between
stages together (:mod:`.distillation_pipeline`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch

from megatron_core._ground import get_pg_size
from megatron_core.post_training.modelopt._backend import modelopt_distill
from megatron_core.post_training.modelopt.distillation_losses import (
    HiddenStateCosineLoss,
    LogitsKLLoss,
    MSELoss,
    ProjectionLayer,
)
from megatron_core.post_training.modelopt.distillation_pipeline import (
    adjust_model_for_pipeline,
    local_layer_name,
)
from megatron_core.process_groups_config import resolve_process_group

_BALANCER_CLASS: type | None = None
# Made on first access by the module's ``__getattr__`` (it subclasses a Model Optimizer class).
LogitsAndIntermediatesLossBalancer: type

__all__ = ["DistillationConfig", "LogitsAndIntermediatesLossBalancer", "convert_to_distillation_model",
           "distillation_loss", "export_student", "setup_distillation_config"]

_INTERMEDIATE_LOSSES = {"cosine": HiddenStateCosineLoss, "mse": MSELoss}


@dataclass
class DistillationConfig:
    """A distillation run's settings (Megatron-LM's distillation YAML; Model Optimizer's ``DistillationConfig``).

    ``logit_layers``: the student's and the teacher's modules whose outputs are the logits.
    ``intermediate_layer_pairs``: ``(student_module, teacher_module[, "cosine" | "mse"])`` whose outputs
    are compared too (cosine by default). ``skip_lm_loss``: train on the distillation loss alone;
    otherwise ``kd_loss_scale`` weighs it against the LM loss. ``logit_kl_temperature``: the KL's
    temperature (> 0). ``criterion`` and ``loss_balancer`` are filled in by :func:`setup_distillation_config`
    unless given.
    """

    intermediate_layer_pairs: list[tuple[str, ...]] = field(default_factory=list)
    logit_layers: tuple[str, str] = ("output_layer", "output_layer")
    skip_lm_loss: bool = True
    kd_loss_scale: float = 1.0
    logit_kl_temperature: float = 1.0
    criterion: dict[tuple[str, str], torch.nn.Module] | None = None
    loss_balancer: Any = None

    def __post_init__(self) -> None:
        if len(self.logit_layers) != 2:
            raise ValueError(f"logit_layers ({self.logit_layers!r}) must name two modules: the student's and the teacher's")
        for entry in self.intermediate_layer_pairs:
            if len(entry) not in (2, 3):
                raise ValueError(f"intermediate_layer_pairs entry {entry!r} must be (student_module, teacher_module"
                                 "[, loss]) with loss 'cosine' or 'mse'")
            if len(entry) == 3 and entry[2] not in _INTERMEDIATE_LOSSES:
                raise ValueError(f"intermediate_layer_pairs entry {entry!r}: unknown loss {entry[2]!r}; known: "
                                 f"{', '.join(sorted(_INTERMEDIATE_LOSSES))}")
        if not self.kd_loss_scale > 0:
            raise ValueError(f"kd_loss_scale ({self.kd_loss_scale}) must be > 0")
        if not self.logit_kl_temperature > 0:
            raise ValueError(f"logit_kl_temperature ({self.logit_kl_temperature}) must be > 0: "
                             "the logits are divided by it")


class _LossBalancing:
    """Combines the LM loss, the logit KL and the intermediate losses into ``{"kd_loss", "logits_loss", "intermediate_loss"}``.

    The intermediate losses (averaged) are rescaled to the logit loss's magnitude; with
    ``skip_original_loss`` the total is their sum, otherwise that sum is rescaled to the LM loss's
    magnitude, times ``kd_loss_scale``, plus the LM loss (Megatron-LM's balancing). The public class,
    :class:`LogitsAndIntermediatesLossBalancer`, adds Model Optimizer's ``DistillationLossBalancer`` base
    when first used, so importing this module needs no Model Optimizer.
    """

    def __init__(self, kd_loss_scale: float = 1.0, skip_original_loss: bool = False) -> None:
        super().__init__()
        self._kd_loss_scale = kd_loss_scale
        self._skip_original_loss = skip_original_loss

    def forward(self, loss_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The total and its parts from ``compute_kd_loss``'s dict of reduced losses."""
        loss_dict = dict(loss_dict)
        original = loss_dict.pop(modelopt_distill().loss_balancers.STUDENT_LOSS_KEY, None)
        logits_keys = [k for k in loss_dict if k.startswith(LogitsKLLoss.__name__)]
        if len(logits_keys) != 1:
            raise ValueError(f"the distillation losses {sorted(loss_dict)} must hold exactly one logit loss")
        logits_loss = loss_dict.pop(logits_keys[0])
        if loss_dict:
            intermediate = sum(loss_dict.values()) / len(loss_dict)
            scaled = intermediate * (logits_loss.detach() / intermediate.detach()) if intermediate > 0 else intermediate
        else:
            intermediate = scaled = torch.zeros_like(logits_loss)
        kd_loss = logits_loss + scaled
        if self._skip_original_loss or original is None:
            total = kd_loss
        else:
            if kd_loss > 0 and original > 0:
                kd_loss = kd_loss * (original.detach() / kd_loss.detach())
            total = original + kd_loss * self._kd_loss_scale
        return {"kd_loss": total, "logits_loss": logits_loss, "intermediate_loss": intermediate}


def _balancer_class() -> type:
    """``LogitsAndIntermediatesLossBalancer``: :class:`_LossBalancing` on Model Optimizer's balancer base (made once)."""
    global _BALANCER_CLASS
    if _BALANCER_CLASS is None:
        _BALANCER_CLASS = type("LogitsAndIntermediatesLossBalancer",
                               (_LossBalancing, modelopt_distill().DistillationLossBalancer),
                               {"__module__": __name__, "__doc__": _LossBalancing.__doc__})
    return _BALANCER_CLASS


def __getattr__(name: str) -> Any:
    """``LogitsAndIntermediatesLossBalancer`` on first access (it subclasses a Model Optimizer class)."""
    if name == "LogitsAndIntermediatesLossBalancer":
        return _balancer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def setup_distillation_config(config_or_path: DistillationConfig | str | os.PathLike | None, student_cfg: Any,
                              teacher_cfg: Any, tp_group: Any = None) -> DistillationConfig:
    """The config with its ``criterion`` and ``loss_balancer`` filled in (Model Optimizer's function of that name).

    ``config_or_path``: a :class:`DistillationConfig`, a YAML file of its fields, or ``None`` for logits
    only. ``student_cfg``/``teacher_cfg``: the models' transformer configs (the projection for
    intermediate pairs maps ``student_cfg.hidden_size`` to ``teacher_cfg.hidden_size``). ``tp_group``:
    the group the logits' vocabulary is split over (default: this process's TP group).
    """
    if config_or_path is None:
        cfg = DistillationConfig()
    elif isinstance(config_or_path, DistillationConfig):
        cfg = config_or_path
    else:
        import yaml

        with open(config_or_path, encoding="utf-8") as f:
            cfg = DistillationConfig(**(yaml.safe_load(f) or {}))
    if cfg.criterion is None:
        criterion: dict[tuple[str, str], torch.nn.Module] = {
            tuple(cfg.logit_layers): LogitsKLLoss(student_cfg, cfg.logit_kl_temperature, tp_group=tp_group)}
        projection = ProjectionLayer(student_cfg, teacher_cfg)  # shared by all intermediate pairs
        for entry in cfg.intermediate_layer_pairs:
            loss_cls = _INTERMEDIATE_LOSSES[entry[2] if len(entry) == 3 else "cosine"]
            criterion[(entry[0], entry[1])] = loss_cls(student_cfg, projection_layer=projection)
        cfg.criterion = criterion
    if cfg.loss_balancer is None:
        cfg.loss_balancer = _balancer_class()(cfg.kd_loss_scale, cfg.skip_lm_loss)
    return cfg


def _check_pair(student: torch.nn.Module, teacher: torch.nn.Module) -> None:
    for who, model in (("student", student), ("teacher", teacher)):
        layer = getattr(model, "output_layer", None)
        if getattr(layer, "gather_output", False) and get_pg_size(getattr(layer, "tp_group", None)) > 1:
            raise ValueError(f"the {who}'s output layer gathers its logits over TP (parallel_output=False), but the "
                             f"logit KL reads them vocab-parallel: build the {who} with parallel_output=True")
    s_vocab, t_vocab = getattr(student, "vocab_size", None), getattr(teacher, "vocab_size", None)
    if s_vocab != t_vocab:
        raise ValueError(f"the student's vocab_size ({s_vocab}) and the teacher's ({t_vocab}) must be equal: the logit "
                         "KL compares their distributions over the same tokens")


def convert_to_distillation_model(student: torch.nn.Module, teacher: torch.nn.Module,
                                  config: DistillationConfig | str | os.PathLike | None = None) -> torch.nn.Module:
    """``student`` converted in place to Model Optimizer's ``DistillationModel`` around the frozen ``teacher``.

    Both are ``GPTModel``s (or this pipeline stage of them) of the same vocabulary with vocab-parallel logits
    (``parallel_output=True``; ``ValueError`` otherwise). Under pipeline parallelism the losses are set on
    the last stage only, intermediate layers renamed to its local numbers, and every stage passes
    student and teacher activations on together (:mod:`.distillation_pipeline`; give the schedule
    ``get_tensor_shapes_adjust_fn_for_distillation(model)``). The teacher's LM loss is never computed;
    the student's is skipped in training when ``skip_lm_loss``; ``state_dict``/``sharded_state_dict``
    hold the student (and projection) only. The loss modules (a projection) are cast to the dtype of the
    student's parameters.
    """
    _check_pair(student, teacher)
    cfg = setup_distillation_config(config, student.config, teacher.config,
                                    tp_group=getattr(getattr(student, "output_layer", None), "tp_group", None))
    dtype = next(student.parameters()).dtype
    for loss in cfg.criterion.values():
        loss.to(dtype)  # a projection takes the student's dtype
    pipelined = get_pg_size(resolve_process_group("pp")) > 1
    criterion = cfg.criterion
    if pipelined:  # the losses live on the last stage, under its local layer numbers
        criterion = {} if not student.post_process else {
            (local_layer_name(s, student.config), local_layer_name(t, teacher.config)): loss
            for (s, t), loss in criterion.items()}
    model = modelopt_distill().convert(student, mode=[("kd_loss", {"teacher_model": teacher, "criterion": criterion,
                                                     "loss_balancer": cfg.loss_balancer})])
    model._distillation_config = cfg
    if pipelined:
        adjust_model_for_pipeline(model)

    def teacher_lm_loss(self: Any, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(labels, dtype=logits.dtype)

    def student_lm_loss(self: Any, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if cfg.skip_lm_loss and self.training:
            return torch.zeros_like(labels, dtype=logits.dtype)
        return type(self).compute_language_model_loss(self, labels, logits)

    def sharded_state_dict(self: Any, *args: Any, **kwargs: Any) -> dict:
        with self.hide_teacher_model():
            return type(self).sharded_state_dict(self, *args, **kwargs)

    model.teacher_model.compute_language_model_loss = MethodType(teacher_lm_loss, model.teacher_model)
    model.compute_language_model_loss = MethodType(student_lm_loss, model)
    model.sharded_state_dict = MethodType(sharded_state_dict, model)
    return model


def _masked_sum(loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``sum(loss * loss_mask)`` over ``[b, s]`` tokens, in fp32 (fp64 for fp64 losses)."""
    dtype = torch.float64 if loss.dtype == torch.float64 else torch.float32
    return torch.sum(loss.reshape(-1).to(dtype) * loss_mask.reshape(-1).to(dtype))


def distillation_loss(model: torch.nn.Module, output_tensor: torch.Tensor, loss_mask: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron-LM's loss function with distillation: ``(loss, num_tokens, report)``.

    ``output_tensor``: the model's per-token LM loss ``[b, s]`` (zeros when ``skip_lm_loss`` in training).
    ``loss`` is the masked sum over tokens (divide by ``num_tokens`` for the mean): the balanced total in
    training, the LM loss in eval. ``report`` holds ``lm loss``, ``total loss``, ``logits distillation
    loss`` and ``intermediate distillation loss``, each as ``[sum, num_tokens]``.
    """
    lm_loss = _masked_sum(output_tensor, loss_mask)
    num_tokens = loss_mask.sum().detach().to(torch.int)
    losses = model.compute_kd_loss(student_loss=lm_loss, loss_reduction_fn=lambda x: _masked_sum(x, loss_mask))

    def entry(value: torch.Tensor) -> torch.Tensor:
        return torch.stack([value.detach().reshape(()).to(lm_loss.dtype), num_tokens.to(lm_loss.dtype)])

    report = {"lm loss": entry(lm_loss), "total loss": entry(losses["kd_loss"]),
              "logits distillation loss": entry(losses["logits_loss"]),
              "intermediate distillation loss": entry(losses["intermediate_loss"])}
    return (losses["kd_loss"] if model.training else lm_loss), num_tokens, report


def export_student(model: torch.nn.Module) -> torch.nn.Module:
    """The student alone again (Model Optimizer's ``mtd.export``): the teacher and the hooks removed."""
    return modelopt_distill().export(model)
