r"""Optimizers for Megatron-style training: ``get_megatron_optimizer`` and the wrapper classes it builds.

The factory groups params (by default no weight decay for biases and norms, and ``decoupled_lr`` for the
embedding and output weights; ``config_overrides`` maps :class:`ParamKey`\ s to per-group settings, as in
Megatron-Core 0.19), builds torch's ``AdamW`` /
``Adam`` / ``SGD`` (fused on CUDA, foreach on CPU), and wraps it: ``DistributedOptimizer`` when
``use_distributed_optimizer``, ``Float16OptimizerWithFloat16Params`` for fp16/bf16, else
``FP32Optimizer``. Expert params get a separate optimizer over the expert DP group, and the two
are combined in a ``ChainedOptimizer``. ``optimizer="muon"`` / ``"adaptive_muon"`` sends 2-D weights to
Muon (:mod:`.emerging_optimizers`) and the rest to ``muon_scalar_optimizer`` (Adam or Lion), chained.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

from megatron_core._ground import get_pg_rank
from megatron_core.distributed import collectives
from megatron_core.optimizer.chained_optimizer import ChainedOptimizer
from megatron_core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
)
from megatron_core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
from megatron_core.optimizer.distrib_optimizer import DistributedOptimizer, Range
from megatron_core.optimizer.emerging_optimizers import (
    _EMERGING_OPTIMIZERS,
    HAVE_EMERGING_OPTIMIZERS,
    _create_emerging_optimizer,
    _emerging_param_overrides,
    _tag_params_for_emerging_optimizer,
)
from megatron_core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from megatron_core.optimizer.layer_wise_optimizer import (
    LayerWiseDistributedOptimizer,
    is_managed_by_layer_wise_optimizer,
)
from megatron_core.optimizer.lion import Lion
from megatron_core.optimizer.mup import get_mup_config_overrides
from megatron_core.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
    param_group_identifier_keys,
)
from megatron_core.optimizer.optimizer_config import EMERGING_OPTIMIZER_NAMES as _EMERGING_OPTIMIZER_NAMES
from megatron_core.optimizer.optimizer_config import AdamOptimizerConfig, OptimizerConfig, SGDOptimizerConfig
from megatron_core.optimizer.param_groups import (
    ParamCondition,
    default_no_weight_decay,
    dump_param_group_map,
    get_param_groups,
    get_param_groups_from_overrides,
)
from megatron_core.optimizer.param_keys import ParamKey, ParamPredicate, ParamWithNamePredicate
from megatron_core.optimizer.precision_aware_adam import PrecisionAwareAdam
from megatron_core.optimizer_param_scheduler import (
    ParamGroupOverride,
    combine_param_group_overrides,
    param_group_override_to_tuple,
)
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.transformer.fsdp_dtensor_checkpoint import get_global_unique_param_name

__all__ = [
    "HAVE_EMERGING_OPTIMIZERS",
    "AdamOptimizerConfig",
    "ChainedOptimizer",
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "HybridDeviceOptimizer",
    "LayerWiseDistributedOptimizer",
    "MegatronGradScaler",
    "MegatronOptimizer",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "ParamKey",
    "ParamPredicate",
    "ParamWithNamePredicate",
    "PrecisionAwareAdam",
    "Range",
    "SGDOptimizerConfig",
    "clip_grad_by_total_norm_fp32",
    "count_zeros_fp32",
    "get_grad_norm_fp32",
    "get_megatron_optimizer",
    "get_mup_config_overrides",
    "check_config_overrides_consistency",
    "get_param_groups",
    "get_standard_config_overrides",
    "is_managed_by_layer_wise_optimizer",
    # re-exported as in Megatron-Core's optimizer package
    "get_global_unique_param_name",
    "param_group_identifier_keys",
    "param_group_override_to_tuple",
]


def _flat_adam_serves(config: OptimizerConfig, param_groups: list[dict[str, Any]], fsdp: bool) -> bool:
    """Whether plain Adam under the distributed optimizer runs as its flat fused step.

    The flat step (:mod:`~megatron_core.optimizer.flat_adam`) belongs to ``PrecisionAwareAdam``; with fp32 state
    its arithmetic is Adam's, and it moves the bytes of a step once instead of in several passes. So on CUDA (or
    where ``DistributedOptimizer.flat_shard_step`` forces it) the distributed optimizer's Adam is that optimizer
    with fp32 moments; the state keeps Adam's keys, so checkpoints load either way.
    """
    if fsdp or not config.use_distributed_optimizer or config.optimizer != "adam" or config.use_precision_aware_optimizer:
        return False  # (CPU offload needs the precision-aware optimizer, so it never reaches here)
    return DistributedOptimizer.flat_step_on(param_groups[0]["params"][0].device)


def _torch_optimizer(config: OptimizerConfig, param_groups: list[dict[str, Any]],
                     allow_fused: bool = True, flat_adam: bool = False) -> torch.optim.Optimizer:
    if config.use_precision_aware_optimizer or flat_adam:
        return PrecisionAwareAdam(param_groups, lr=config.lr, weight_decay=config.weight_decay,
                                  betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                                  adam_w_mode=config.decoupled_weight_decay, exp_avg_dtype=config.exp_avg_dtype,
                                  exp_avg_sq_dtype=config.exp_avg_sq_dtype)
    if config.optimizer == "lion":
        return Lion(param_groups, lr=config.lr, betas=(config.lion_beta1, config.lion_beta2),
                    weight_decay=config.weight_decay)
    device = param_groups[0]["params"][0].device
    kernel = {"fused": True} if device.type == "cuda" and allow_fused else {"foreach": True}
    if config.optimizer == "adam":
        cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        return cls(param_groups, lr=config.lr, weight_decay=config.weight_decay,
                   betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, **kernel)
    return torch.optim.SGD(param_groups, lr=config.lr, weight_decay=config.weight_decay,
                           momentum=config.sgd_momentum, **kernel)


def _grad_scaler(config: OptimizerConfig) -> MegatronGradScaler | None:
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
                                 growth_factor=2.0, backoff_factor=0.5, growth_interval=config.loss_scale_window,
                                 hysteresis=config.hysteresis)
    return None


def _groups(pg_collection: Any, expert: bool) -> dict[str, Any]:
    """tp, data parallel and grad-stats groups for the dense or the expert optimizer (the package resolver).

    Roles with no group (nothing initialised, or unset in ``pg_collection``) are ``collectives.LOCAL``.
    """
    roles = {"tp": "expt_tp" if expert else "tp", "dp": "expt_dp" if expert else "dp_cp", "stats": "tp_ep_pp" if expert else "mp"}
    return {key: collectives.local_if_none(resolve_process_group(role, pg_collection)) for key, role in roles.items()}


def _distributed_optimizer_groups(model_chunks: list[torch.nn.Module], per_model_buffers: dict[int, list[Any]],
                                  default_group: Any) -> tuple[Any, int]:
    """The group the distributed optimizer shards over (its DDP buffers' group: one optimizer instance's ranks
    under ``num_distributed_optimizer_instances``) and this rank's instance id (its rank in the inter group)."""
    groups = {id(b.data_parallel_group): b.data_parallel_group for bs in per_model_buffers.values() for b in bs}
    if len(groups) > 1:
        raise ValueError("the model chunks' DDP buffers reduce over different data-parallel groups; the distributed "
                         "optimizer needs one")
    inter = [getattr(chunk, "inter_dist_opt_group", None) for chunk in model_chunks]
    instance_id = get_pg_rank(inter[0]) if inter and inter[0] is not None else 0
    return (next(iter(groups.values())) if groups else default_group), instance_id


def _uses_torch_fsdp(model_chunks: list[torch.nn.Module]) -> bool:
    from megatron_core.distributed.torch_fully_sharded_data_parallel import is_torch_fsdp_module

    return any(is_torch_fsdp_module(chunk) for chunk in model_chunks)


def _build(config: OptimizerConfig, model_chunks: list[torch.nn.Module], param_groups: list[dict[str, Any]],
           expert: bool, pg_collection: Any) -> MegatronOptimizer:
    groups = _groups(pg_collection, expert)
    fsdp = _uses_torch_fsdp(model_chunks)
    # FSDP2: foreach kernels over the DTensor shards (the fused-clipping path hands plain tensors to the kernel).
    optimizer = _torch_optimizer(config, param_groups, allow_fused=not fsdp,
                                 flat_adam=_flat_adam_serves(config, param_groups, fsdp))
    if fsdp:
        # FSDP2 keeps fp32 sharded params (the main params) and sharded grads: a plain fp32 step
        # on the shards; clipping reduces the norm over the shards' mesh as well.
        wrapped = FP32Optimizer(optimizer, config)
        wrapped.tp_group = groups["tp"]
        wrapped.grad_stats_parallel_group = groups["stats"]
        return wrapped
    if config.use_distributed_optimizer:
        attr = "expert_parallel_buffers" if expert else "buffers"
        per_model_buffers = {i: getattr(chunk, attr) for i, chunk in enumerate(model_chunks)}
        dp_group, instance_id = _distributed_optimizer_groups(model_chunks, per_model_buffers, groups["dp"])
        wrapped: MegatronOptimizer = DistributedOptimizer(
            optimizer, config, _grad_scaler(config), lambda opt: None, model_chunks, per_model_buffers,
            dp_group, distributed_optimizer_instance_id=instance_id,
        )
        wrapped.tp_group = groups["tp"]
        # With several optimizer instances each holds whole gradients: the statistics of one instance suffice.
        wrapped.grad_stats_parallel_group = collectives.GroupProduct(dp_group, groups["stats"])
        return wrapped
    if config.fp16 or config.bf16:
        wrapped = Float16OptimizerWithFloat16Params(optimizer, config, _grad_scaler(config))
    else:
        wrapped = FP32Optimizer(optimizer, config)
    wrapped.tp_group = groups["tp"]
    wrapped.grad_stats_parallel_group = groups["stats"]
    return wrapped


def _build_layer_wise(config: OptimizerConfig, model_chunks: list[torch.nn.Module], dense: list[dict[str, Any]],
                      expert: list[dict[str, Any]], pg_collection: Any) -> LayerWiseDistributedOptimizer:
    """``use_layer_wise_distributed_optimizer``: Adam/SGD over whole params per DP rank (dense, then expert)."""
    if config.use_distributed_optimizer or _uses_torch_fsdp(model_chunks):
        raise ValueError("use_layer_wise_distributed_optimizer=True needs use_distributed_optimizer=False and "
                         f"DistributedDataParallel chunks (use_distributed_optimizer={config.use_distributed_optimizer}"
                         f", FSDP2={_uses_torch_fsdp(model_chunks)})")
    parts = [(groups, is_expert) for groups, is_expert in ((dense, False), (expert, True)) if groups]
    optimizer = LayerWiseDistributedOptimizer([_torch_optimizer(config, groups) for groups, _ in parts], config,
                                              pg_collection, model_chunks=model_chunks)
    for wrapped, (_, is_expert) in zip(optimizer.chained_optimizers, parts):
        groups = _groups(pg_collection, is_expert)
        wrapped.tp_group = groups["tp"]
        wrapped.grad_stats_parallel_group = groups["stats"]
    return optimizer


def get_standard_config_overrides(config: OptimizerConfig) -> dict[ParamKey, ParamGroupOverride]:
    """The default overrides: no weight decay for biases and 1-D parameters (except the q/k layernorm weights
    under ``apply_wd_to_qk_layernorm``), and ``decoupled_lr`` / ``decoupled_min_lr`` for the embedding and output
    weights when ``decoupled_lr`` is set. Extend a copy of it to add your own."""
    overrides: dict[ParamKey, ParamGroupOverride] = {}
    if config.apply_wd_to_qk_layernorm:
        def no_wd(param: torch.nn.Parameter, name: str) -> bool:
            return default_no_weight_decay(name, param) and not ("q_layernorm." in name or "k_layernorm." in name)

        no_wd_key = ParamKey(with_name_predicate=ParamWithNamePredicate(name="s1_not_qkln", fn=no_wd))
    else:
        no_wd_key = ParamKey(with_name_predicate=ParamWithNamePredicate(
            name="bias_or_1d", fn=lambda param, name: default_no_weight_decay(name, param)))
    overrides[no_wd_key] = ParamGroupOverride(wd_mult=0.0)
    if config.decoupled_lr is not None:
        decoupled = ParamGroupOverride(max_lr=config.decoupled_lr)
        if config.decoupled_min_lr is not None:
            decoupled["min_lr"] = config.decoupled_min_lr
        overrides[ParamKey(attr="is_embedding_or_output_parameter")] = decoupled
    return overrides


_FIXED_BY_CONFIG = ("optimizer", "optimizer_cpu_offload", "overlap_param_gather_with_optimizer_step")


def _check_overrides(config: OptimizerConfig, config_overrides: dict[ParamKey, ParamGroupOverride]) -> None:
    if not isinstance(config_overrides, dict):
        raise TypeError(
            f"get_megatron_optimizer's third argument is config_overrides, a dict of ParamKey -> ParamGroupOverride "
            f"(Megatron-Core 0.19's signature), got {type(config_overrides).__name__}; the earlier no_weight_decay_cond, "
            "scale_lr_cond and lr_mult are keyword-only here")
    for key, override in config_overrides.items():
        if not isinstance(key, ParamKey):
            raise TypeError(f"config_overrides keys must be ParamKey, got {type(key).__name__} ({key!r})")
        for name in _FIXED_BY_CONFIG:
            if name in override and override[name] != getattr(config, name, None):
                raise ValueError(f"config_overrides[{key}] sets {name}={override[name]!r}, but every param group "
                                 f"uses OptimizerConfig.{name}={getattr(config, name, None)!r}")


def check_config_overrides_consistency(config: OptimizerConfig,
                                       config_overrides: dict[ParamKey, ParamGroupOverride] | None) -> bool:
    """Check that ``config_overrides`` change no setting every group shares (the optimizer, its CPU offload, the
    param-gather overlap); ``ValueError`` / ``TypeError`` naming the override otherwise. ``True`` when consistent."""
    if config_overrides is not None:
        _check_overrides(config, config_overrides)
    return True


def _get_param_groups(model_chunks: list[torch.nn.Module], config: OptimizerConfig,
                      config_overrides: dict[ParamKey, ParamGroupOverride] | None) -> list[dict[str, Any]]:
    """Megatron-Core's (private) param-group builder, with its group entries: the groups of
    :func:`get_param_groups_from_overrides` (``None`` means no overrides) as ``params``, ``is_expert_parallel``,
    ``default_config``, ``wd_mult``, ``lr_mult``, ``is_decoupled_lr``, ``max_lr``, ``min_lr`` (``config.min_lr``,
    possibly ``None``) and the override's own keys; without the initial ``lr`` / ``weight_decay`` this library adds."""
    overrides = config_overrides or {}
    groups = get_param_groups_from_overrides(model_chunks, config, overrides)
    megatron_groups = []
    for group in groups:
        sample = group["params"][0]
        name = next((n for chunk in model_chunks for n, p in chunk.named_parameters() if p is sample), "")
        matched = [o for key, o in overrides.items() if key.matches(sample, name)]
        override = dict(combine_param_group_overrides(matched)) if matched else {}
        megatron_groups.append({
            "params": group["params"], "is_expert_parallel": group["is_expert_parallel"],
            "default_config": group["default_config"], "wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False,
            "max_lr": config.lr, "min_lr": config.min_lr, **override,
        })
    return megatron_groups


def _wrap_emerging(optimizer: torch.optim.Optimizer, init_state_fn: Any, config: OptimizerConfig,
                   expert: bool, pg_collection: Any) -> MegatronOptimizer:
    """Muon in Megatron's wrapper: fp32 main params for bf16 models, no grad scaler (fp16 is refused)."""
    if config.bf16:
        wrapped: MegatronOptimizer = Float16OptimizerWithFloat16Params(optimizer, config, None, init_state_fn)
    else:
        wrapped = FP32Optimizer(optimizer, config, init_state_fn)
    groups = _groups(pg_collection, expert)
    wrapped.tp_group = groups["tp"]
    wrapped.grad_stats_parallel_group = groups["stats"]
    return wrapped


def _get_megatron_emerging_optimizer(config: OptimizerConfig, model_chunks: list[torch.nn.Module],
                                     config_overrides: dict[ParamKey, ParamGroupOverride], pg_collection: Any,
                                     dump_param_to_param_group_map: str | None = None) -> MegatronOptimizer:
    """Muon (or adaptive Muon) for the 2-D weights, the scalar optimizer for the rest (Megatron-Core 0.19's rule).

    The routing is a config override (``optimizer: "adam"`` / ``"lion"`` for embeddings, the output layer and
    non-2-D params); groups are bucketed by (optimizer, expert) in order of appearance and each bucket is one
    optimizer of the returned ``ChainedOptimizer``. With ``use_layer_wise_distributed_optimizer`` (or the deprecated
    ``optimizer="dist_muon"``) the buckets (by optimizer only) become the inner optimizers of one
    ``LayerWiseDistributedOptimizer``.
    """
    name, layer_wise = config.optimizer, config.use_layer_wise_distributed_optimizer
    if name.startswith("dist_"):
        warnings.warn(f"optimizer={name!r} is deprecated: use optimizer={name[5:]!r} with "
                      "use_layer_wise_distributed_optimizer=True", DeprecationWarning, stacklevel=3)
        name, layer_wise = name[5:], True
    if layer_wise and (_uses_torch_fsdp(model_chunks) or any(
            getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False) for chunk in model_chunks)):
        raise ValueError(f"optimizer={config.optimizer!r} with the layer-wise optimizer needs DistributedDataParallel "
                         "chunks built with DistributedDataParallelConfig(use_distributed_optimizer=False) (whole "
                         "gradients on every rank), not FSDP2 or reduce-scattered gradients")
    _tag_params_for_emerging_optimizer(model_chunks)
    overrides = {**config_overrides, **_emerging_param_overrides(name, config)}
    param_groups = get_param_groups_from_overrides(model_chunks, config, overrides)
    if not param_groups:
        raise ValueError("model_chunks have no trainable parameters")
    if dump_param_to_param_group_map is not None:
        dump_param_group_map(model_chunks, param_groups, dump_param_to_param_group_map)
    buckets: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for group in param_groups:
        key = (group.get("optimizer", name), group["is_expert_parallel"] and not layer_wise)
        buckets.setdefault(key, []).append(group)
    raw: list[tuple[torch.optim.Optimizer, Any]] = []
    results: list[MegatronOptimizer] = []
    for (opt_name, expert), groups in buckets.items():
        if opt_name == name and opt_name in _EMERGING_OPTIMIZERS:
            optimizer, init_fn = _create_emerging_optimizer(config, groups, name, model_chunks, pg_collection)
            if layer_wise:
                raw.append((optimizer, init_fn))
            else:
                results.append(_wrap_emerging(optimizer, init_fn, config, expert, pg_collection))
            continue
        scalar_config = copy.copy(config)  # no re-validation: "lion" is a scalar optimizer, not a config choice
        scalar_config.optimizer = opt_name
        if layer_wise:
            raw.append((_torch_optimizer(scalar_config, groups), None))
        else:
            wrapped = _build(scalar_config, model_chunks, groups, expert=expert, pg_collection=pg_collection)
            wrapped.config = config
            results.append(wrapped)
    if layer_wise:
        optimizers, init_fns = zip(*raw)
        chained = LayerWiseDistributedOptimizer(list(optimizers), config, pg_collection, list(init_fns),
                                                model_chunks=model_chunks)
        for wrapped in chained.chained_optimizers:
            groups_of = _groups(pg_collection, expert=False)
            wrapped.tp_group = groups_of["tp"]
            wrapped.grad_stats_parallel_group = groups_of["stats"]
        return chained
    return ChainedOptimizer(results)


def get_megatron_optimizer(config: OptimizerConfig, model_chunks: list[torch.nn.Module],
                           config_overrides: dict[ParamKey, ParamGroupOverride] | None = None,
                           use_gloo_process_groups: bool = True, pg_collection: Any = None,
                           dump_param_to_param_group_map: str | None = None, *,
                           no_weight_decay_cond: ParamCondition | None = None,
                           scale_lr_cond: ParamCondition | None = None, lr_mult: float = 1.0,
                           default_skip_embedding_weight_decay: bool = False) -> MegatronOptimizer:
    """Build the optimizer for ``model_chunks`` (usually DDP-wrapped) as described in the module docstring.

    ``config_overrides`` (Megatron-Core 0.19): per-parameter group settings; ``None`` means
    :func:`get_standard_config_overrides`. The earlier conditions (``no_weight_decay_cond``, ``scale_lr_cond``,
    ``lr_mult``, ``default_skip_embedding_weight_decay``) still work by keyword, without ``config_overrides``.
    ``dump_param_to_param_group_map``: a directory where the map from each parameter's global name to its param
    group's index is saved with ``torch.distributed.checkpoint``. ``use_gloo_process_groups`` is accepted for
    compatibility; the optimizers here communicate on the model's own groups.
    """
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr must be set to build an optimizer")
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    from megatron_core.distributed.fsdp.mcore_fsdp_adapter import megatron_fsdp_optimizer_chunks

    # Megatron-FSDP chunks: the optimizer of the wrapper serving their sharding strategy.
    model_chunks, config = megatron_fsdp_optimizer_chunks(model_chunks, config)
    if config.use_distributed_optimizer and _uses_torch_fsdp(model_chunks):
        raise ValueError("OptimizerConfig.use_distributed_optimizer=True cannot be combined with "
                         "TorchFullyShardedDataParallel model chunks (FSDP2 already shards the optimizer state)")
    legacy = (no_weight_decay_cond is not None or scale_lr_cond is not None or lr_mult != 1.0
              or default_skip_embedding_weight_decay)
    emerging = config.optimizer in _EMERGING_OPTIMIZER_NAMES
    if legacy:
        if emerging:
            raise ValueError(f"optimizer={config.optimizer!r} takes config_overrides, not the earlier "
                             "no_weight_decay_cond / scale_lr_cond / lr_mult / default_skip_embedding_weight_decay")
        if config_overrides is not None:
            raise ValueError("pass either config_overrides or the earlier no_weight_decay_cond / scale_lr_cond / "
                             "lr_mult / default_skip_embedding_weight_decay, not both")
        param_groups = get_param_groups(model_chunks, config, no_weight_decay_cond, scale_lr_cond, lr_mult,
                                        default_skip_embedding_weight_decay)
    else:
        if config_overrides is None:
            config_overrides = get_standard_config_overrides(config)
        _check_overrides(config, config_overrides)
        if emerging:
            return _get_megatron_emerging_optimizer(config, model_chunks, config_overrides, pg_collection,
                                                    dump_param_to_param_group_map)
        param_groups = get_param_groups_from_overrides(model_chunks, config, config_overrides)
    if not param_groups:
        raise ValueError("model_chunks have no trainable parameters")
    dense = [g for g in param_groups if not g["is_expert_parallel"]]
    expert = [g for g in param_groups if g["is_expert_parallel"]]
    if config.use_layer_wise_distributed_optimizer:
        if dump_param_to_param_group_map is not None:
            dump_param_group_map(model_chunks, dense + expert, dump_param_to_param_group_map)
        return _build_layer_wise(config, model_chunks, dense, expert, pg_collection)
    optimizers = []
    if dense:
        optimizers.append(_build(config, model_chunks, dense, expert=False, pg_collection=pg_collection))
    if expert:
        optimizers.append(_build(config, model_chunks, expert, expert=True, pg_collection=pg_collection))
    if dump_param_to_param_group_map is not None:
        dump_param_group_map(model_chunks, dense + expert, dump_param_to_param_group_map)
    return optimizers[0] if len(optimizers) == 1 else ChainedOptimizer(optimizers)


