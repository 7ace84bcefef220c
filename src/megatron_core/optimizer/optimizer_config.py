"""``OptimizerConfig``: optimizer choice, learning rate, precision, loss scaling and clipping settings.

Mirrors Megatron-Core's dataclass of the same name (field names and defaults). The inner
optimizer is torch's ``AdamW`` / ``Adam`` / ``SGD`` (fused on CUDA, foreach on CPU), or Muon
(``optimizer="muon"`` / ``"adaptive_muon"``, :mod:`.emerging_optimizers`) with Adam or Lion for the
parameters Muon leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_core.config_rules import OPTIMIZER_RULES as _OPTIMIZER_RULES
from megatron_core.config_rules import apply_rules as _apply_rules
from megatron_core.optimizer.newton_schulz import (
    COEFFICIENT_SETS,
    FP32_MATMUL_PRECISIONS,
    MUON_SCALE_MODES,
    MUON_TP_MODES,
)
from megatron_core.optimizer.param_keys import (  # noqa: F401 - importable from here, as in Megatron-Core
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
)

_OPTIMIZERS = ("adam", "sgd", "muon", "adaptive_muon", "dist_muon")
# Muon-family names; "dist_muon" is Megatron's deprecated spelling of muon + use_layer_wise_distributed_optimizer.
EMERGING_OPTIMIZER_NAMES = ("muon", "adaptive_muon", "dist_muon")
_MUON_CHOICES = (
    ("muon_scale_mode", MUON_SCALE_MODES),
    ("muon_fp32_matmul_prec", FP32_MATMUL_PRECISIONS),
    ("muon_coefficient_type", tuple(COEFFICIENT_SETS)),
    ("muon_tp_mode", MUON_TP_MODES),
    ("muon_scalar_optimizer", ("adam", "lion")),
    ("adaptive_muon_moment2_method", ("adamuon", "normuon")),
)
_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PRECISION_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


def _check_muon(config: OptimizerConfig) -> None:
    """The Muon fields' choices, and the settings Muon cannot be combined with (``ValueError`` naming them)."""
    for name, choices in _MUON_CHOICES:
        if getattr(config, name) not in choices:
            raise ValueError(f"{name} ({getattr(config, name)!r}) must be one of {choices}")
    if config.muon_coefficient_type == "cubic5" and config.muon_num_ns_steps != len(COEFFICIENT_SETS["cubic5"]):
        raise ValueError(f"muon_num_ns_steps ({config.muon_num_ns_steps}) must be 5 with "
                         "muon_coefficient_type='cubic5' (a fixed 5-step schedule)")
    if config.optimizer not in EMERGING_OPTIMIZER_NAMES:
        return
    if config.fp16:
        raise ValueError(f"optimizer={config.optimizer!r} does not support fp16=True (use bf16 or fp32), "
                         "as in Megatron-Core")
    if config.use_distributed_optimizer:
        raise ValueError(
            f"optimizer={config.optimizer!r} cannot use use_distributed_optimizer=True (the distributed optimizer "
            "splits matrices into element ranges; Muon needs whole matrices): set "
            "use_layer_wise_distributed_optimizer=True instead, as Megatron-LM's --use-distributed-optimizer does "
            "for Muon")


def _check_precision_and_offload(config: OptimizerConfig) -> None:
    """Megatron-Core's rules for the precision-aware optimizer and CPU offload, as ``ValueError``s."""
    if config.use_precision_aware_optimizer:
        if config.optimizer != "adam":
            raise ValueError(f"use_precision_aware_optimizer=True needs optimizer='adam' (got {config.optimizer!r})")
        if not config.use_distributed_optimizer:
            raise ValueError("use_precision_aware_optimizer=True needs use_distributed_optimizer=True")
        for name in _PRECISION_FIELDS:
            allowed = (torch.float32, torch.bfloat16) if name.startswith("main_") else _STATE_DTYPES
            if getattr(config, name) not in allowed:
                raise ValueError(f"{name} ({getattr(config, name)}) must be one of {allowed}")
        if config.main_grads_dtype != config.main_params_dtype:
            raise ValueError(
                f"main_grads_dtype ({config.main_grads_dtype}) must equal main_params_dtype "
                f"({config.main_params_dtype}) here: the gradient is handed to the update in the main params' dtype"
            )
    else:
        for name in _PRECISION_FIELDS:
            if getattr(config, name) != torch.float32:
                raise ValueError(
                    f"{name} ({getattr(config, name)}) can only be torch.float32 when use_precision_aware_optimizer=False"
                )
    if config.optimizer_cpu_offload and not config.use_precision_aware_optimizer:
        raise ValueError("optimizer_cpu_offload=True needs use_precision_aware_optimizer=True (the offloaded step "
                         "is the precision-aware optimizer's)")
    if not 0.0 <= config.optimizer_offload_fraction <= 1.0:
        raise ValueError(f"optimizer_offload_fraction ({config.optimizer_offload_fraction}) must be in [0, 1]")
    if config.optimizer_offload_fraction > 0.0 and not config.optimizer_cpu_offload:
        raise ValueError(f"optimizer_offload_fraction ({config.optimizer_offload_fraction}) > 0 needs "
                         "optimizer_cpu_offload=True")


@dataclass
class OptimizerConfig:
    """Settings read by :func:`~megatron_core.optimizer.get_megatron_optimizer`."""

    # Learning rate and weight decay
    optimizer: str = "adam"
    lr: float | None = None
    min_lr: float | None = None
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    weight_decay: float = 0.01
    apply_wd_to_qk_layernorm: bool = False

    # Precision
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    use_precision_aware_optimizer: bool = False
    store_param_remainders: bool = True
    main_grads_dtype: torch.dtype = torch.float32
    main_params_dtype: torch.dtype = torch.float32
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32

    # Loss scaling (fp16)
    loss_scale: float | None = None
    initial_loss_scale: float = 2**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2

    # Adam
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    decoupled_weight_decay: bool = True

    # SGD
    sgd_momentum: float = 0.9

    # Muon (optimizer="muon" / "adaptive_muon"); see megatron_core.optimizer.emerging_optimizers
    muon_momentum: float = 0.95
    muon_split_qkv: bool = True  # orthogonalise a fused QKV weight's query, key and value rows separately
    muon_nesterov: bool = False
    muon_scale_mode: str = "spectral"  # "spectral", "unit_rms_norm" or "shape_scaling"
    muon_fp32_matmul_prec: str = "medium"  # Newton-Schulz matmuls: "medium" (bf16), "high" (TF32), "highest"
    muon_coefficient_type: str = "quintic"  # see emerging_optimizers.get_supported_coefficient_types()
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"  # TP-sharded weights: "blockwise", "duplicated" or "distributed"
    muon_extra_scale_factor: float = 1.0
    muon_scalar_optimizer: str = "adam"  # for embeddings, the output layer, biases and norms: "adam" or "lion"

    # Lion (muon_scalar_optimizer="lion")
    lion_beta1: float = 0.95
    lion_beta2: float = 0.98

    # Adaptive Muon (optimizer="adaptive_muon")
    adaptive_muon_moment2_method: str = "adamuon"  # "adamuon" (element-wise) or "normuon" (per row / column)
    adaptive_muon_beta2: float = 0.95
    adaptive_muon_eps: float = 1e-8

    # Distributed optimizer
    use_distributed_optimizer: bool = False
    use_layer_wise_distributed_optimizer: bool = False  # LayerWiseDistributedOptimizer (whole params per DP rank)
    overlap_param_gather: bool = False
    overlap_param_gather_with_optimizer_step: bool = False

    # CPU offload of the distributed optimizer's shards (needs use_precision_aware_optimizer)
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    use_torch_optimizer_for_cpu_offload: bool = False
    overlap_cpu_optimizer_d2h_h2d: bool = False

    # Miscellaneous
    clip_grad: float = 1.0
    grad_norm_skip_threshold: float = float("inf")  # skip the update when the grad norm exceeds it (inf: never)
    log_num_zeros_in_grad: bool = False
    barrier_with_L1_time: bool = False
    timers: Any = None
    config_logger_dir: str = ""

    def __post_init__(self) -> None:
        """Validate the combination of options; errors name the fields and values."""
        _apply_rules("OptimizerConfig", self, _OPTIMIZER_RULES)
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(f"optimizer ({self.optimizer!r}) must be one of {_OPTIMIZERS}")
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 cannot both be True")
        if self.lr is not None and self.lr < 0:
            raise ValueError(f"lr ({self.lr}) must be >= 0")
        if self.lr is not None and self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must be <= lr ({self.lr})")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay ({self.weight_decay}) must be >= 0")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad ({self.clip_grad}) must be >= 0 (0 disables clipping)")
        if not 0.0 <= self.adam_beta1 < 1.0 or not 0.0 <= self.adam_beta2 < 1.0:
            raise ValueError(f"adam_beta1 ({self.adam_beta1}) and adam_beta2 ({self.adam_beta2}) must be in [0, 1)")
        if self.adam_eps <= 0:
            raise ValueError(f"adam_eps ({self.adam_eps}) must be > 0")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"loss_scale ({self.loss_scale}) must be > 0")
        if self.min_loss_scale <= 0 or self.initial_loss_scale < self.min_loss_scale:
            raise ValueError(
                f"initial_loss_scale ({self.initial_loss_scale}) must be >= min_loss_scale ({self.min_loss_scale}) > 0"
            )
        if self.hysteresis < 1 or self.loss_scale_window < 1:
            raise ValueError(
                f"hysteresis ({self.hysteresis}) and loss_scale_window ({self.loss_scale_window}) must be >= 1"
            )
        if self.overlap_param_gather_with_optimizer_step and not (
            self.use_distributed_optimizer and self.overlap_param_gather
        ):
            raise ValueError(
                "overlap_param_gather_with_optimizer_step=True needs use_distributed_optimizer=True and "
                f"overlap_param_gather=True (got {self.use_distributed_optimizer}, {self.overlap_param_gather})"
            )
        _check_precision_and_offload(self)
        _check_muon(self)
        if self.fp16 and self.params_dtype != torch.float16:
            self.params_dtype = torch.float16
        if self.bf16 and self.params_dtype != torch.bfloat16:
            self.params_dtype = torch.bfloat16


AdamOptimizerConfig = OptimizerConfig  # Megatron-Core's aliases: every optimizer shares one config class
SGDOptimizerConfig = OptimizerConfig
