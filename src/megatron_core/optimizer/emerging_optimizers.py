"""Megatron-Core 0.19's emerging optimizers: tensor-parallel Muon, its adaptive variant, and their registry.

Muon (Keller Jordan, 2024) keeps an EMA momentum ``m <- beta m + (1 - beta) g`` per 2-D weight, optionally takes the
Nesterov mix ``g + beta (m - g)``, replaces that direction by its approximate polar factor
(:mod:`.newton_schulz`) times a shape scale, and steps ``p <- p - lr * update`` after decoupled weight decay
``p <- p - lr * wd * p``. Megatron-Core takes the update rule from NVIDIA's emerging-optimizers package; here it is
written out, with the same constructor arguments and state (``momentum_buffer``; adaptive: ``moment2_buffer``).

Parameters with ``tensor_model_parallel`` set are TP shards along ``partition_dim``; ``tp_mode`` says how they are
orthogonalised: ``"duplicated"`` gathers the whole matrix on every TP rank, ``"distributed"`` iterates on the
shards with the Gram matrix all-reduced (both equal the TP=1 update up to rounding), ``"blockwise"`` treats each
shard as a matrix of its own (no communication, a different update). A fused QKV weight tagged ``is_qkv`` is
orthogonalised as three matrices, the query, key and value rows of all of its query groups.

``_EMERGING_OPTIMIZERS`` maps ``OptimizerConfig.optimizer`` to the class, how it reads the config and which
parameters it leaves to the scalar optimizer (``muon_scalar_optimizer``: embeddings, the output layer and every
parameter that is not 2-D); :func:`~megatron_core.optimizer.get_megatron_optimizer` builds from it.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_core.distributed import collectives
from megatron_core.optimizer.newton_schulz import (
    COEFFICIENT_SETS,
    FP32_MATMUL_PRECISIONS,
    MUON_SCALE_MODES,
    MUON_TP_MODES,
    fp32_matmul_precision,
    get_muon_scale_factor,
    newton_schulz_tp,
)
from megatron_core.optimizer.param_keys import ParamKey, ParamPredicate
from megatron_core.process_groups_config import resolve_tp_group

__all__ = [
    "HAVE_EMERGING_OPTIMIZERS",
    "EmergingOptimizerEntry",
    "TensorParallelAdaptiveMuon",
    "TensorParallelMuon",
    "get_supported_coefficient_types",
    "validate_coefficient_type",
]

logger = logging.getLogger(__name__)

# Megatron-Core's flag for "the emerging optimizers can be built": they are part of this library.
HAVE_EMERGING_OPTIMIZERS = True

MOMENT2_METHODS = ("adamuon", "normuon")
SCALAR_OPTIMIZERS = ("adam", "lion")


def get_supported_coefficient_types() -> tuple[str, ...]:
    """The Newton-Schulz coefficient sets ``muon_coefficient_type`` may name."""
    return tuple(COEFFICIENT_SETS)


def validate_coefficient_type(coefficient_type: str) -> None:
    """``ValueError`` naming the valid types unless ``coefficient_type`` is one of them."""
    supported = get_supported_coefficient_types()
    if coefficient_type not in supported:
        raise ValueError(f"muon_coefficient_type ({coefficient_type!r}) must be one of {supported}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} ({value!r}) must be one of {choices}")


class TensorParallelMuon(torch.optim.Optimizer):
    """Muon over 2-D weights, aware of tensor-parallel shards and fused QKV weights (see the module docstring).

    ``use_decoupled_weight_decay=False`` adds ``wd * p`` to the gradient instead (L2). ``fp32_matmul_prec`` is the
    precision of the Newton-Schulz matmuls (``"medium"``: bf16). ``pg_collection`` supplies the TP groups (``tp``,
    ``expt_tp`` for params tagged ``expert_tp``); ``None`` means ``parallel_state``'s.
    """

    def __init__(self, params: Iterable[Any], lr: float = 3e-4, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.01, use_decoupled_weight_decay: bool = True, split_qkv: bool = False,
                 is_qkv_fn: Callable[[torch.Tensor], bool] | None = None, qkv_split_shapes: list[int] | None = None,
                 fp32_matmul_prec: str = "medium", coefficient_type: str = "quintic", num_ns_steps: int = 5,
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0, pg_collection: Any = None,
                 tp_mode: str = "duplicated") -> None:
        if num_ns_steps < 1:
            raise ValueError(f"num_ns_steps ({num_ns_steps}) must be >= 1")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum ({momentum}) must be in [0, 1)")
        validate_coefficient_type(coefficient_type)
        _check_choice("scale_mode", scale_mode, MUON_SCALE_MODES)
        _check_choice("tp_mode", tp_mode, MUON_TP_MODES)
        _check_choice("fp32_matmul_prec", fp32_matmul_prec, FP32_MATMUL_PRECISIONS)
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})
        self.nesterov = nesterov
        self.weight_decay_method = "decoupled" if use_decoupled_weight_decay else "l2"
        self.split_qkv = split_qkv
        self.is_qkv_fn = is_qkv_fn if is_qkv_fn is not None else (lambda p: getattr(p, "is_qkv", False))
        self.qkv_split_shapes = qkv_split_shapes
        self.fp32_matmul_prec = fp32_matmul_prec
        self.coefficient_type = coefficient_type
        self.num_ns_steps = num_ns_steps
        self.scale_mode = scale_mode
        self.extra_scale_factor = extra_scale_factor
        self.pg_collection = pg_collection
        self.tp_mode = tp_mode
        self._scale_in_orthogonalize = True  # the adaptive variant scales after its second-moment step

    # -- orthogonalisation -------------------------------------------------------------------------

    def _tp_group(self, p: torch.Tensor) -> Any:
        return collectives.local_if_none(resolve_tp_group(pg_collection=self.pg_collection,
                                                          is_expert=getattr(p, "expert_tp", False)))

    def _partition_dim(self, p: torch.Tensor, tp_group: Any) -> int | None:
        """The dimension ``p`` is sharded along over ``tp_group`` (``None``: whole, or blockwise mode)."""
        dim = getattr(p, "partition_dim", None)
        if (self.tp_mode == "blockwise" or not getattr(p, "tensor_model_parallel", False) or dim is None
                or dim < 0 or collectives.group_size(tp_group) == 1):
            return None
        return dim

    def scaled_orthogonalize_fn(self, grad: torch.Tensor, tp_group: Any, partition_dim: int | None = None
                                ) -> torch.Tensor:
        """The orthogonalised ``grad`` (a local slice along ``partition_dim``, or whole) times the Muon scale of the
        whole matrix's shape and ``extra_scale_factor``."""
        orth = newton_schulz_tp(grad, self.num_ns_steps, self.coefficient_type, tp_group, partition_dim,
                                "duplicated" if self.tp_mode == "blockwise" else self.tp_mode, self.fp32_matmul_prec)
        if not self._scale_in_orthogonalize:
            return orth
        return orth * self._scale(grad.shape, tp_group, partition_dim)

    def _scale(self, local_shape: torch.Size, tp_group: Any, partition_dim: int | None) -> float:
        size = [local_shape[0], local_shape[1]]
        if partition_dim is not None:
            size[partition_dim] *= collectives.group_size(tp_group)
        return get_muon_scale_factor(size[0], size[1], self.scale_mode) * self.extra_scale_factor

    def _qkv_split_shapes(self, p: torch.Tensor, shape: torch.Size) -> list[int]:
        shapes = getattr(p, "qkv_split_shapes", None) or self.qkv_split_shapes
        if shapes is None:
            raise ValueError("split_qkv=True and the parameter is tagged is_qkv, but neither it nor the optimizer "
                             "has qkv_split_shapes")
        if shape[0] % sum(shapes) != 0:
            raise ValueError(f"a QKV weight of shape {tuple(shape)} does not split into query groups of "
                             f"{list(shapes)} rows (sum {sum(shapes)})")
        return list(shapes)

    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The scaled orthogonal update for parameter ``p`` from its momentum direction ``grad``.

        ``kwargs`` (the param group's entries) are accepted for Megatron-Core's signature and not used.
        """
        if grad.ndim != 2:
            raise ValueError(f"Muon updates 2-D weights only, got shape {tuple(grad.shape)}")
        tp_group = self._tp_group(p)
        partition_dim = self._partition_dim(p, tp_group)
        if not (self.split_qkv and self.is_qkv_fn(p)):
            return self.scaled_orthogonalize_fn(grad, tp_group, partition_dim)
        shapes = self._qkv_split_shapes(p, grad.shape)
        groups, cols = grad.shape[0] // sum(shapes), grad.shape[1]
        # [groups * (q + k + v), cols] -> three [groups * part, cols] matrices (all groups' q rows, k rows, v rows)
        parts = torch.split(grad.view(groups, sum(shapes), cols), shapes, dim=1)
        orth = [self.scaled_orthogonalize_fn(part.reshape(-1, cols), tp_group, partition_dim).view(groups, -1, cols)
                for part in parts]
        return torch.cat(orth, dim=1).view(grad.shape)

    # -- the step ----------------------------------------------------------------------------------

    @torch.no_grad()
    def _init_group(self, group: dict[str, Any], skip_non_grad_params: bool = True) -> None:
        """Create the momentum buffers of the group's params (only those with a gradient unless told)."""
        for p in group["params"]:
            if skip_non_grad_params and p.grad is None:
                continue
            if len(self.state[p]) == 0:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)

    def _direction(self, p: torch.Tensor, group: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply weight decay and the momentum update; ``(raw gradient, direction to orthogonalise)``."""
        grad = p.grad
        lr, wd = group["lr"], group["weight_decay"]
        if wd != 0.0:
            if self.weight_decay_method == "decoupled":
                p.mul_(1.0 - lr * wd)
            else:
                grad = grad + wd * p
        buffer = self.state[p]["momentum_buffer"]
        buffer.lerp_(grad, 1.0 - group["momentum"])
        return grad, grad.lerp(buffer, group["momentum"]) if self.nesterov else buffer

    def _update(self, p: torch.Tensor, direction: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The step's update of ``p`` (subtracted times the learning rate): the scaled orthogonalised direction."""
        with fp32_matmul_precision(self.fp32_matmul_prec):
            return self.orthogonalize(p, direction, **{k: v for k, v in group.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._init_group(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                _, direction = self._direction(p, group)
                p.add_(self._update(p, direction, group), alpha=-group["lr"])
        return loss


class TensorParallelAdaptiveMuon(TensorParallelMuon):
    """Muon with a second moment of the orthogonalised update (AdaMuon / NorMuon), then the Muon scale.

    ``moment2_method="adamuon"``: ``v <- beta2 v + (1 - beta2) O^2`` element-wise, update ``O / (sqrt(v) + eps)``.
    ``"normuon"``: ``v`` is the mean of ``O^2`` over the shorter local dimension (one value per row or column of the
    longer one), update ``O / sqrt(max(v, eps))`` rescaled to ``||O||_F``. The Muon scale (of the whole matrix's shape) is applied after. Under TP the second
    moment is taken over this rank's slice.
    """

    def __init__(self, params: Iterable[Any], lr: float = 3e-4, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.01, use_decoupled_weight_decay: bool = True, split_qkv: bool = False,
                 is_qkv_fn: Callable[[torch.Tensor], bool] | None = None, qkv_split_shapes: list[int] | None = None,
                 fp32_matmul_prec: str = "medium", coefficient_type: str = "quintic", num_ns_steps: int = 5,
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0, pg_collection: Any = None,
                 tp_mode: str = "duplicated", moment2_method: str = "adamuon", beta2: float = 0.95,
                 eps: float = 1e-8) -> None:
        _check_choice("moment2_method", moment2_method, MOMENT2_METHODS)
        super().__init__(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                         use_decoupled_weight_decay=use_decoupled_weight_decay, split_qkv=split_qkv,
                         is_qkv_fn=is_qkv_fn, qkv_split_shapes=qkv_split_shapes, fp32_matmul_prec=fp32_matmul_prec,
                         coefficient_type=coefficient_type, num_ns_steps=num_ns_steps, scale_mode=scale_mode,
                         extra_scale_factor=extra_scale_factor, pg_collection=pg_collection, tp_mode=tp_mode)
        self.moment2_method = moment2_method
        self._scale_in_orthogonalize = False
        for group in self.param_groups:
            group.setdefault("beta2", beta2)
            group.setdefault("eps", eps)

    @staticmethod
    def _normuon_dim(shape: torch.Size) -> int:
        return -1 if shape[-2] >= shape[-1] else -2

    @torch.no_grad()
    def _init_group(self, group: dict[str, Any], skip_non_grad_params: bool = True) -> None:
        """Create the momentum and second-moment buffers."""
        for p in group["params"]:
            if skip_non_grad_params and p.grad is None:
                continue
            if len(self.state[p]) == 0:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                shape = list(p.shape)
                if self.moment2_method == "normuon":
                    shape[self._normuon_dim(p.shape)] = 1
                self.state[p]["moment2_buffer"] = torch.zeros(shape, dtype=p.dtype, device=p.device)

    def _second_moment(self, orth: torch.Tensor, moment2: torch.Tensor, beta2: float, eps: float) -> torch.Tensor:
        if self.moment2_method == "adamuon":
            moment2.lerp_(orth.square(), 1.0 - beta2)
            return orth / (moment2.sqrt() + eps)
        moment2.lerp_(orth.square().mean(dim=self._normuon_dim(orth.shape), keepdim=True), 1.0 - beta2)
        update = orth * moment2.clamp_min(eps).rsqrt()
        return update * (torch.linalg.vector_norm(orth) / torch.linalg.vector_norm(update).clamp_min(eps))

    def _update(self, p: torch.Tensor, direction: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Raw Newton-Schulz, then the second moment, then the whole matrix's Muon scale."""
        with fp32_matmul_precision(self.fp32_matmul_prec):
            orth = self.orthogonalize(p, direction)
        update = self._second_moment(orth, self.state[p]["moment2_buffer"], group["beta2"], group["eps"])
        tp_group = self._tp_group(p)
        return update * self._scale(p.shape, tp_group, self._partition_dim(p, tp_group))


# -- the registry ----------------------------------------------------------------------------------


def _eopt_init_state_fn(opt: torch.optim.Optimizer, config: Any = None) -> None:
    """Create the state of every parameter, with or without a gradient (checkpoint loading needs it)."""
    for group in opt.param_groups:
        opt._init_group(group, skip_non_grad_params=False)


def _is_nonlinear_or_embedding(param: torch.Tensor) -> bool:
    """True for what Muon leaves to the scalar optimizer: embedding/output weights and every non-2-D parameter."""
    return getattr(param, "is_embedding_or_output_parameter", False) or len(param.shape) != 2


def _default_param_overrides_factory() -> dict[ParamKey, dict[str, Any]]:
    return {ParamKey(predicate=ParamPredicate(name="nonlinear_or_embedding", fn=_is_nonlinear_or_embedding)):
            {"optimizer": "adam"}}


def _get_qkv_split_shapes(model_cfg: Any) -> list[int]:
    """Rows per query group of a fused QKV weight: ``[q, k, v]`` (``[q, gate, k, v]`` with an output gate)."""
    query = model_cfg.num_attention_heads // model_cfg.num_query_groups * model_cfg.kv_channels
    if getattr(model_cfg, "attention_output_gate", False):
        return [query, query, model_cfg.kv_channels, model_cfg.kv_channels]
    return [query, model_cfg.kv_channels, model_cfg.kv_channels]


def _model_config(model_chunks: list[torch.nn.Module]) -> Any:
    return getattr(model_chunks[0], "config", None) if model_chunks else None


def _kwargs_from_config(optimizer_cls: type, prefix: str, config: Any) -> dict[str, Any]:
    """Constructor arguments of ``optimizer_cls`` read from ``config.<prefix>_<name>``, else ``config.<name>``."""
    kwargs: dict[str, Any] = {}
    for name in inspect.signature(optimizer_cls.__init__).parameters:
        if name in ("self", "params"):
            continue
        for attr in (f"{prefix}_{name}", name):
            if hasattr(config, attr):
                kwargs[name] = getattr(config, attr)
                break
    return kwargs


def _muon_config_to_kwargs(config: Any, model_chunks: list[torch.nn.Module], pg_collection: Any) -> dict[str, Any]:
    kwargs = _kwargs_from_config(TensorParallelMuon, "muon", config)
    model_cfg = _model_config(model_chunks)
    kwargs["is_qkv_fn"] = lambda p: getattr(p, "is_qkv", False)
    kwargs["qkv_split_shapes"] = _get_qkv_split_shapes(model_cfg) if model_cfg is not None else None
    kwargs["pg_collection"] = pg_collection
    return kwargs


def _adaptive_muon_config_to_kwargs(config: Any, model_chunks: list[torch.nn.Module],
                                    pg_collection: Any) -> dict[str, Any]:
    kwargs = _muon_config_to_kwargs(config, model_chunks, pg_collection)
    for name in ("moment2_method", "beta2", "eps"):
        kwargs[name] = getattr(config, f"adaptive_muon_{name}")
    return kwargs


@dataclass
class EmergingOptimizerEntry:
    """How to build one emerging optimizer: its class, state initialiser, config reader and parameter routing.

    ``default_param_overrides`` are added to the caller's ``config_overrides``; their ``optimizer`` entries send the
    matching parameters to another optimizer (Muon: the scalar one).
    """

    optimizer_cls: type
    init_state_fn: Callable[..., None] = _eopt_init_state_fn
    config_to_kwargs: Callable[[Any, list[torch.nn.Module], Any], dict[str, Any]] | None = None
    default_param_overrides: dict[ParamKey, dict[str, Any]] = field(default_factory=_default_param_overrides_factory)


_EMERGING_OPTIMIZERS: dict[str, EmergingOptimizerEntry] = {
    "muon": EmergingOptimizerEntry(TensorParallelMuon, config_to_kwargs=_muon_config_to_kwargs),
    "adaptive_muon": EmergingOptimizerEntry(TensorParallelAdaptiveMuon,
                                            config_to_kwargs=_adaptive_muon_config_to_kwargs),
}


def _create_emerging_optimizer(config: Any, param_groups: list[dict[str, Any]], eopt_name: str,
                               model_chunks: list[torch.nn.Module], pg_collection: Any
                               ) -> tuple[torch.optim.Optimizer, Callable[..., None]]:
    """``(optimizer over param_groups, its init_state_fn)`` for the registered ``eopt_name``."""
    entry = _EMERGING_OPTIMIZERS[eopt_name]
    kwargs = (entry.config_to_kwargs(config, model_chunks, pg_collection) if entry.config_to_kwargs is not None
              else _kwargs_from_config(entry.optimizer_cls, eopt_name, config))
    return entry.optimizer_cls(param_groups, **kwargs), entry.init_state_fn


def _emerging_param_overrides(eopt_name: str, config: Any) -> dict[ParamKey, dict[str, Any]]:
    """A copy of the entry's routing overrides, the Muon family's scalar optimizer set from the config."""
    overrides = copy.deepcopy(_EMERGING_OPTIMIZERS[eopt_name].default_param_overrides)
    if eopt_name in ("muon", "adaptive_muon"):
        for override in overrides.values():
            if override.get("optimizer") in SCALAR_OPTIMIZERS:
                override["optimizer"] = config.muon_scalar_optimizer
    return overrides


def _tag_params_for_emerging_optimizer(model_chunks: list[torch.nn.Module]) -> None:
    """Mark routed-expert weights ``expert_tp`` and fused QKV weights ``is_qkv`` / ``qkv_split_shapes``."""
    for chunk in model_chunks:
        model_cfg = getattr(chunk, "config", None)
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if "experts" in name and "shared" not in name:
                param.expert_tp = True
            if "linear_qkv.weight" in name and param.dim() == 2 and model_cfg is not None:
                shapes = _get_qkv_split_shapes(model_cfg)
                if param.shape[0] % sum(shapes) == 0:
                    param.is_qkv = True
                    param.qkv_split_shapes = shapes
                else:
                    logger.debug("Muon QKV split skipped for %s: shape %s, split %s", name, tuple(param.shape), shapes)
