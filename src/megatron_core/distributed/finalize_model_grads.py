"""``finalize_model_grads``: the gradient reductions that run after the last microbatch's backward.

Megatron-Core's function of the same name, called by the pipeline schedules through
``config.finalize_model_grads_func``. In order: finish the DP x CP reduction of every model chunk;
all-reduce over TP the gradients of sequence-parallel params (layernorms, row-parallel biases) and, with
``qk_layernorm``, of the per-head q/k layernorms, and average over TP those of params marked ``average_gradients_across_tp_domain`` (replicated modules whose
copies must not drift: Hugging Face wrappers, the DSA indexer);
all-reduce tied word-embedding gradients over the embedding group (first and last PP stage, and any
stage with MTP layers, which holds a copy of the embedding) and
position-embedding gradients over the position-embedding group; update the MoE routers' expert
biases (aux-loss-free balancing) from the step's token counts summed over TP x DP x CP; update the
quantile-balancing routers' ``qb_beta`` from the step's quantiles averaged over DP x CP; restart the
routers' per-step accumulators (:func:`reset_model_temporary_tensors`); optionally divide every gradient
by the number of tokens of the global batch.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core._ground import get_pg_rank, get_pg_size, unwrap_model
from megatron_core._wrapped_model import get_model_config, submodules_with_attribute
from megatron_core.distributed import collectives
from megatron_core.process_groups_config import resolve_process_group


def _model_config(model_chunk: torch.nn.Module) -> Any:
    """The model's config: ``.config`` of the outermost wrapper that has one (``None`` when none has)."""
    try:
        return get_model_config(model_chunk)
    except RuntimeError:
        return None


def _main_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    grad = getattr(param, "main_grad", None)
    grad = param.grad if grad is None else grad
    # An FSDP2 gradient is a DTensor: reduce its local shard (identically sharded on every TP rank).
    return grad._local_tensor if grad is not None and hasattr(grad, "device_mesh") else grad


def _groups(pg_collection: Any) -> dict[str, Any]:
    """The groups of each reduction, from the package resolver; "no group" becomes ``collectives.LOCAL``."""
    if pg_collection is not None:
        for name in ("tp", "pp", "embd", "pos_embd"):
            if not hasattr(pg_collection, name):
                raise ValueError(f"pg_collection for finalize_model_grads must have '{name}' (set it to None if unused)")
    return {role: collectives.local_if_none(resolve_process_group(role, pg_collection))
            for role in ("tp", "pp", "embd", "pos_embd", "dp_cp")}


def _in_group(group: Any) -> bool:
    return get_pg_size(group) > 1


def _tied_embedding_params(model: list[torch.nn.Module], pp_group: Any) -> list[torch.nn.Parameter]:
    """This rank's copies of the word embedding: the first stage's, the last stage's tied output weight and the copy
    of a stage with MTP layers (the embedding group holds exactly the ranks that have one)."""
    pp_rank, pp_size = get_pg_rank(pp_group), get_pg_size(pp_group)
    chunks = [chunk for chunk in model if getattr(unwrap_model(chunk), "mtp_process", False)]
    if pp_rank == 0:
        chunks.append(model[0])
    if pp_rank == pp_size - 1:
        chunks.append(model[-1])
    found: dict[int, torch.nn.Parameter] = {}
    for chunk in chunks:
        module = unwrap_model(chunk)
        if getattr(module, "share_embeddings_and_output_weights", False) and hasattr(
            module, "shared_embedding_or_output_weight"
        ):
            weight = module.shared_embedding_or_output_weight()
            if weight is not None:
                found[id(weight)] = weight
        for param in module.parameters():
            if getattr(param, "shared_embedding", False):
                found[id(param)] = param
    return list(found.values())


def _position_embedding_params(model: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    module = unwrap_model(model[0])
    embedding = getattr(module, "embedding", None)
    position = getattr(embedding, "position_embeddings", None)
    weight = getattr(position, "weight", None)
    return [] if weight is None else [weight]


def _allreduce_grads(params: list[torch.nn.Parameter], group: Any) -> None:
    grads = [g for g in (_main_grad(p) for p in params) if g is not None]
    collectives.all_reduce_coalesced(grads, group)


def _average_grads(params: list[torch.nn.Parameter], group: Any) -> None:
    grads = [g for g in (_main_grad(p) for p in params) if g is not None]
    collectives.all_reduce_coalesced(grads, group)
    for grad in grads:
        grad.div_(get_pg_size(group))


def _tp_replicated_params(model: list[torch.nn.Module], config: Any
                          ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """The TP-replicated params whose gradients each TP rank holds only part of (summed over TP) and those marked
    ``average_gradients_across_tp_domain`` (averaged over TP), as Megatron-Core picks them.

    Summed: sequence-parallel params (with ``sequence_parallel``), and with ``qk_layernorm`` the q/k layernorms of
    head-parallel attention (each rank normalises only its own heads). MLA's ``q_layernorm`` normalises the
    latent, whose gradient is already complete on every rank without sequence parallelism, so it is left out.
    """
    sequence_parallel = getattr(config, "sequence_parallel", False)
    per_head_qk_norm = getattr(config, "qk_layernorm", False) and not getattr(config, "multi_latent_attention", False)
    summed, averaged = [], []
    for chunk in model:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if getattr(param, "average_gradients_across_tp_domain", False):
                averaged.append(param)
            elif ((sequence_parallel and getattr(param, "sequence_parallel", False))
                  or (per_head_qk_norm and ("q_layernorm" in name or "k_layernorm" in name))):
                summed.append(param)
    return summed, averaged


def _routers(model: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The MoE routers of every chunk (the modules with balancing state)."""
    return [module for chunk in model
            for module in submodules_with_attribute(unwrap_model(chunk), "update_expert_bias",
                                                    "reset_global_aux_loss_tracker")]


def _update_router_expert_bias(model: list[torch.nn.Module]) -> None:
    """Ask each MoE router to move its ``expert_bias`` toward balance.

    The router owns the rule (``TopKRouter.update_expert_bias``); this layer, below ``transformer``,
    only calls the hook.
    """
    for module in _routers(model):
        if hasattr(module, "update_expert_bias"):
            module.update_expert_bias()


def _update_router_qb_beta(model: list[torch.nn.Module], dp_cp_group: Any) -> None:
    """Move each quantile-balancing router's ``qb_beta`` to the step's quantile and restart its accumulators.

    A router in training mode averages its micro-batches' quantiles (``qb_beta_accum / qb_beta_count``),
    then averages that over ``dp_cp_group`` (one collective for all routers); the new bias is
    ``ema * qb_beta + (1 - ema) * average`` (``moe_router_quantile_balancing_ema``) minus its mean over
    the experts. The accumulators are zeroed afterwards by :func:`reset_model_temporary_tensors`.
    """
    routers = [m for m in _routers(model) if getattr(m, "qb_beta_accum", None) is not None]
    training = [m for m in routers if m.training]
    with torch.no_grad():
        if training:
            averages = torch.stack([m.qb_beta_accum / m.qb_beta_count.clamp(min=1).to(m.qb_beta_accum.dtype)
                                    for m in training])
            collectives.all_reduce(averages, dp_cp_group)
            averages /= get_pg_size(dp_cp_group)
            for module, average in zip(training, averages):
                ema = module.config.moe_router_quantile_balancing_ema
                blended = ema * module.qb_beta + (1.0 - ema) * average
                module.qb_beta.copy_(blended - blended.mean())


def _setting(config: Any, module: torch.nn.Module, name: str, default: Any) -> Any:
    """``config.<name>``; without a model config, the module's own config's."""
    return getattr(config if config is not None else getattr(module, "config", None), name, default)


def reset_model_temporary_tensors(config: Any, model: list[torch.nn.Module]) -> None:
    """Restart what the MoE routers accumulate over one step (Megatron-Core's function of this name).

    For every module of every chunk: the token counts behind the expert bias (``local_tokens_per_expert``,
    with ``moe_router_enable_expert_bias``), the global-batch counts of ``global_aux_loss`` (with that
    load-balancing type) and the quantile accumulators (``qb_beta_accum`` / ``qb_beta_count``). Called by
    :func:`finalize_model_grads` once the step's updates are made, and by code that discards a step.
    ``config`` is the model's ``TransformerConfig``; ``None`` reads each module's own.
    """
    with torch.no_grad():
        for chunk in model:
            for module in submodules_with_attribute(unwrap_model(chunk), "expert_bias", "qb_beta_accum",
                                                    "reset_global_aux_loss_tracker"):
                counts = getattr(module, "local_tokens_per_expert", None)
                if (_setting(config, module, "moe_router_enable_expert_bias", False) and hasattr(module, "expert_bias")
                        and counts is not None):
                    counts.zero_()
                balancing = _setting(config, module, "moe_router_load_balancing_type", "")
                if "global_aux_loss" in balancing and hasattr(module, "reset_global_aux_loss_tracker"):
                    module.reset_global_aux_loss_tracker()
                if getattr(module, "qb_beta_accum", None) is not None:
                    module.qb_beta_accum.zero_()
                    module.qb_beta_count.zero_()


def finalize_model_grads(model: list[torch.nn.Module], num_tokens: torch.Tensor | None = None,
                         pg_collection: Any = None, force_all_reduce: bool = False) -> None:
    """Finish every gradient reduction of one iteration across DP, TP and PP (see module docstring).

    ``model`` is the list of model chunks (usually DDP-wrapped). ``num_tokens`` (a tensor on the
    last PP stage) switches on per-token loss normalisation.
    """
    groups = _groups(pg_collection)
    config = _model_config(model[0])

    for chunk in model:
        if hasattr(chunk, "finish_grad_sync"):
            chunk.finish_grad_sync(force_all_reduce=force_all_reduce)

    if _in_group(groups["tp"]):
        summed, averaged = _tp_replicated_params(model, config)
        _allreduce_grads(summed, groups["tp"])
        _average_grads(averaged, groups["tp"])

    if _in_group(groups["embd"]):
        _allreduce_grads(_tied_embedding_params(model, groups["pp"]), groups["embd"])
    if _in_group(groups["pos_embd"]) and get_pg_rank(groups["pp"]) == 0:
        _allreduce_grads(_position_embedding_params(model), groups["pos_embd"])

    _update_router_expert_bias(model)
    _update_router_qb_beta(model, groups["dp_cp"])
    reset_model_temporary_tensors(config, model)

    if num_tokens is not None:
        pp_group = groups["pp"]
        last = get_pg_size(pp_group) - 1
        num_tokens = num_tokens.clone()
        collectives.broadcast(num_tokens, last, pp_group)
        collectives.all_reduce(num_tokens, groups["dp_cp"])
        if num_tokens.item() <= 0:
            raise ValueError(f"num_tokens must be positive across the global batch, got {num_tokens.item()}")
        for chunk in model:
            if hasattr(chunk, "scale_gradients"):
                chunk.scale_gradients(1.0 / num_tokens.item())
            else:
                for p in chunk.parameters():
                    grad = _main_grad(p)
                    if grad is not None:
                        grad.div_(num_tokens)
