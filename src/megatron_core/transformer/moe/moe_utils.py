"""Routing maths and process-group lookup of the mixture-of-experts layer (Megatron-Core's ``moe_utils``).

Shapes: ``logits``/``probs``/``routing_map`` are ``[num_tokens, num_experts]`` (tokens flattened
from ``[s, b]``); ``routing_map`` is boolean. ``probs`` is zero outside the routing map.

The auxiliary losses are attached to the graph with :class:`MoEAuxLossAutoScaler`: the forward
returns the activation unchanged, the backward feeds the loss a gradient equal to the main loss's
backward scale (set by the pipeline schedules to ``loss_scale / num_microbatches``), so the aux loss
is optimised without being added to the returned loss. The token permutation helpers live in
:mod:`megatron_core.transformer.moe.token_permutation`, the random-logit and routing-padding overrides in
:mod:`megatron_core.transformer.moe.routing_overrides`; both are re-exported here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_size
from megatron_core.process_groups_config import ProcessGroupCollection, resolve_process_group
from megatron_core.transformer.loss_auto_scaler import LossAutoScaler
from megatron_core.transformer.moe.routing_overrides import (
    RandomSTE,
    RandomSTEShared,
    apply_biased_logits,
    apply_random_logits,
    get_align_size_for_quantization,
    pad_routing_map,
)
from megatron_core.transformer.moe.token_permutation import permute, sort_chunks_by_idxs, unpermute

__all__ = [
    "MoEAuxLossAutoScaler",
    "RandomSTE",
    "RandomSTEShared",
    "RouterGatingLinearFunction",
    "apply_biased_logits",
    "apply_random_logits",
    "get_align_size_for_quantization",
    "pad_routing_map",
    "clear_aux_losses_tracker",
    "get_moe_layer_wise_logging_tracker",
    "reduce_aux_losses_tracker_across_ranks",
    "save_to_aux_losses_tracker",
    "track_moe_metrics",
    "apply_router_token_dropping",
    "compute_routing_scores_for_aux_loss",
    "get_capacity",
    "get_default_pg_collection",
    "get_tokens_per_expert_and_token_count",
    "get_updated_expert_bias",
    "group_limited_topk",
    "padded_expert_capacity",
    "permute",
    "qb_dual_update",
    "router_gating_linear",
    "sinkhorn",
    "sort_chunks_by_idxs",
    "switch_load_balancing_loss_func",
    "topk_routing_with_score_function",
    "unpermute",
    "z_loss_func",
]

_MOE_ROLES = ("tp", "cp", "tp_cp", "tp_dp_cp", "ep", "expt_tp", "tp_ep", "expt_dp")


def get_default_pg_collection(pg_collection: ProcessGroupCollection | None = None) -> ProcessGroupCollection:
    """The MoE layer's groups through the package resolver: ``pg_collection``'s fields, else ``parallel_state``.

    A role with no group (unset in ``pg_collection``, or nothing initialised) is ``None`` and
    behaves as a group of one process, so a single process runs the layer unchanged.
    """
    out = ProcessGroupCollection()
    for role in _MOE_ROLES:
        setattr(out, role, resolve_process_group(role, pg_collection))
    return out


def all_reduce_sum_(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """In-place sum over ``group`` (no-op for a group of one); not differentiable."""
    if get_pg_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


def switch_load_balancing_loss_func(probs: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: Any,
                                    topk: int, num_experts: int, moe_aux_loss_coeff: float, fused: bool = False,
                                    padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer balance loss ``E * sum_i f_i * P_i`` times ``moe_aux_loss_coeff``.

    ``f_i = tokens_per_expert_i / (T * topk)`` (counts over the whole reduction group) and
    ``P_i = sum(probs[:, i]) / T`` over this rank's tokens, ``T = total_num_tokens``.
    """
    if padding_mask is not None:
        probs = probs * padding_mask.unsqueeze(-1)
    aggregated = probs.sum(dim=0)
    scale = num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    return torch.sum(aggregated * tokens_per_expert) * scale


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE router z-loss: ``mean(logsumexp(logits)^2) * z_loss_coeff`` (padding rows excluded)."""
    values = torch.square(torch.logsumexp(logits, dim=-1))
    if padding_mask is None:
        return values.mean() * z_loss_coeff
    valid = ~padding_mask
    return (values * valid).sum() / torch.clamp(valid.sum(), min=1.0) * z_loss_coeff


_SINKHORN_EPS = 1e-8


def sinkhorn(cost: torch.Tensor, tol: float = 0.0001) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of ``exp(cost)`` ``[num_tokens, num_experts]`` (S-BASE routing).

    Alternately rescales the rows to sum to ``1 / num_tokens`` and the columns to ``1 / num_experts``
    until the mean change of the column scales drops to ``tol``; returns the rescaled matrix, whose
    per-row top-k gives a balanced assignment.
    """
    kernel = torch.exp(cost)
    num_rows, num_cols = kernel.shape
    col_scale = torch.ones(num_cols, device=kernel.device, dtype=kernel.dtype)
    row_scale = torch.ones(num_rows, device=kernel.device, dtype=kernel.dtype)
    change = math.inf
    while change > tol:
        row_scale = (1.0 / num_rows) / ((kernel * col_scale).sum(dim=1) + _SINKHORN_EPS)
        new_col_scale = (1.0 / num_cols) / ((kernel * row_scale.unsqueeze(1)).sum(dim=0) + _SINKHORN_EPS)
        change = (new_col_scale - col_scale).abs().mean().item()
        col_scale = new_col_scale
    return kernel * row_scale.unsqueeze(1) * col_scale


def qb_dual_update(scores: torch.Tensor, k: int, beta: torch.Tensor, update_beta: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantile balancing: each token's top-``k`` experts of ``scores - beta``, and the next bias.

    ``scores [m, n]`` (tokens, experts), ``beta [n]``. Returns ``(indices [m, k], b)``: ``b`` is ``beta``
    itself when ``update_beta`` is False, else the per-expert quantile that would give every expert
    ``m * k / n`` tokens: with ``alpha_t`` the ``(k + 1)``-th largest ``scores[t] - beta`` of token ``t``,
    ``b_e`` is the ``(m * k / n + 1)``-th largest of ``scores[:, e] - alpha`` over the tokens.
    """
    num_tokens, num_experts = scores.shape
    # One more than k: the (k + 1)-th best is the token's threshold alpha.
    best = (scores - beta).topk(min(k + 1, num_experts), dim=1)
    indices = best.indices[:, :k]
    if not update_beta:
        return indices, beta
    if k >= num_experts or (num_tokens * k) % num_experts != 0:
        raise ValueError(
            f"quantile balancing needs moe_router_topk ({k}) < num_moe_experts ({num_experts}) and tokens * "
            f"moe_router_topk ({num_tokens} * {k}) divisible by num_moe_experts (tokens counted over TP x CP)"
        )
    alpha = best.values[:, k:]
    per_expert = num_tokens * k // num_experts
    quantile = (scores - alpha).topk(per_expert + 1, dim=0).values[per_expert]
    return indices, quantile.contiguous()


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int | None = None) -> int:
    """Tokens each expert accepts: ``ceil(num_tokens / num_experts * capacity_factor)`` (at least ``min_capacity``)."""
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


def padded_expert_capacity(num_tokens: int, router_topk: int, num_experts: int, capacity_factor: float) -> int:
    """Rows each expert holds after :func:`apply_router_token_dropping` with ``pad_to_capacity`` on ``num_tokens``
    tokens (an extension): its capacity, or every token when the capacity reaches them."""
    return min(get_capacity(num_tokens * router_topk, num_experts, capacity_factor), num_tokens)


def get_tokens_per_expert_and_token_count(routing_map: torch.Tensor, reduce_group: Any, topk: int | None = None,
                                          with_padding_mask: bool = False) -> tuple[torch.Tensor, Any, Any]:
    """``(tokens_per_expert summed over reduce_group, local token count, total token count)``."""
    local = routing_map.sum(dim=0).to(torch.float32)
    global_counts = all_reduce_sum_(local.clone(), reduce_group)
    if with_padding_mask:
        return global_counts, local.sum() / topk, global_counts.sum() / topk
    local_num_tokens = routing_map.shape[0]
    return global_counts, local_num_tokens, local_num_tokens * get_pg_size(reduce_group)


class MoEAuxLossAutoScaler(LossAutoScaler):
    """Attach an auxiliary loss to an activation; its gradient is ``main_loss_backward_scale`` (default 1).

    Under ``torch.compile`` the scale may be read when the forward runs (the backward's product can be
    computed in the forward graph), so set it before the forward; the library's schedules do.
    """

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        """Return ``output`` unchanged and keep ``aux_loss`` for the backward (Megatron-Core's argument name)."""
        return LossAutoScaler.forward(ctx, output, aux_loss)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Set the backward scale of every aux loss (the main loss's scale / number of microbatches).

        Stored as a new 0-dim float32 tensor on ``scale``'s device, so a CPU scale multiplies as a scalar on any
        device.
        """
        scale = torch.as_tensor(scale, dtype=torch.float32).detach().reshape(()).clone()
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale


def group_limited_topk(scores: torch.Tensor, topk: int, num_tokens: int, num_experts: int, num_groups: int,
                       group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k within the ``group_topk`` best expert groups (DeepSeek device/node-limited routing).

    A group's score is the sum of its best ``topk / group_topk`` expert scores.
    """
    grouped = scores.view(num_tokens, num_groups, -1)
    group_scores = grouped.topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups)
    masked = scores.masked_fill(~score_mask.reshape(num_tokens, -1).bool(), float("-inf"))
    return torch.topk(masked, k=topk, dim=-1)


def topk_routing_with_score_function(logits: torch.Tensor, topk: int, use_pre_softmax: bool = False,
                                     num_groups: int | None = None, group_topk: int | None = None,
                                     scaling_factor: float | None = None, score_function: str = "softmax",
                                     expert_bias: torch.Tensor | None = None, fused: bool = False,
                                     router_replay: Any = None, dense_output: bool = False,
                                     precomputed_indices: torch.Tensor | None = None,
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, routing_map)`` ``[num_tokens, num_experts]`` of the top-k experts per token.

    softmax: over all experts then top-k (``use_pre_softmax``), or top-k logits then softmax over
    them. sigmoid/sqrtsoftplus: top-k of ``score + expert_bias`` (the bias only selects), probs are
    the unbiased scores renormalised over the chosen experts (when ``topk > 1``). ``scaling_factor``
    multiplies the probs. With ``dense_output`` returns ``(probs, indices)`` ``[num_tokens, topk]``.
    ``precomputed_indices [num_tokens, topk]`` replaces the top-k selection (probs are computed at
    those experts); a ``router_replay`` (:class:`.router_replay.RouterReplay`) records or replays it.
    ``fused`` (``moe_router_fusion``, Transformer Engine's kernel in Megatron-Core) computes the same
    result with the PyTorch operations above.
    """
    if fused and precomputed_indices is not None:
        raise ValueError("topk_routing_with_score_function: fused=True (moe_router_fusion) cannot take "
                         "precomputed_indices (quantile balancing), as in Megatron-Core")
    num_tokens, num_experts = logits.shape

    def default_topk(scores: torch.Tensor, k: int, groups: int | None = None, group_k: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        if group_k:
            return group_limited_topk(scores, k, num_tokens, num_experts, groups, group_k)
        return torch.topk(scores, k=k, dim=1)

    def compute_topk(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if precomputed_indices is not None:
            return scores.gather(1, precomputed_indices), precomputed_indices
        if router_replay is not None:
            return router_replay.get_replay_topk(scores, topk, num_groups, group_topk, default_topk)
        return default_topk(scores, topk, num_groups, group_topk)

    if score_function == "softmax":
        if use_pre_softmax:
            probs, top_indices = compute_topk(torch.softmax(logits, dim=-1, dtype=torch.float32))
        else:
            scores, top_indices = compute_topk(logits)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    elif score_function in ("sigmoid", "sqrtsoftplus"):
        if score_function == "sigmoid":
            scores = torch.sigmoid(logits.float())
        else:
            scores = torch.nn.functional.softplus(logits.float()).sqrt()
        if expert_bias is not None:
            _, top_indices = compute_topk(scores + expert_bias.float())
            scores = torch.gather(scores, dim=1, index=top_indices)
        else:
            scores, top_indices = compute_topk(scores)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"score_function ({score_function!r}) must be 'softmax', 'sigmoid' or 'sqrtsoftplus'")
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    if dense_output:
        return probs, top_indices
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_probs, routing_map


def compute_routing_scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str, fused: bool = False,
                                        padding_mask: torch.Tensor | None = None
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routing_map, scores)`` for the balance loss: normalised scores of all experts and their top-k."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    elif score_function == "sqrtsoftplus":
        scores = torch.nn.functional.softplus(logits.float()).sqrt()
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function ({score_function!r}) must be 'softmax', 'sigmoid' or 'sqrtsoftplus'")
    _, top_indices = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    if padding_mask is not None:
        valid = (~padding_mask).unsqueeze(-1)
        routing_map, scores = routing_map & valid, scores * valid
    return routing_map, scores


def apply_router_token_dropping(routing_probs: torch.Tensor, routing_map: torch.Tensor, router_topk: int,
                                capacity_factor: float, drop_policy: str = "probs", pad_to_capacity: bool = False,
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most ``capacity = ceil(T * topk / E * capacity_factor)`` tokens per expert.

    ``drop_policy='probs'`` keeps each expert's highest-probability tokens; ``'position'`` keeps
    the earliest tokens (lowest index). With ``pad_to_capacity`` every expert gets exactly
    ``capacity`` slots: the kept tokens plus padding tokens with probability 0.
    """
    num_tokens, num_experts = routing_probs.shape
    capacity = padded_expert_capacity(num_tokens, router_topk, num_experts, capacity_factor)
    if capacity == num_tokens:  # every token fits
        capacity_mask = torch.ones_like(routing_map)
    elif drop_policy == "probs":
        _, kept = torch.topk(routing_probs, k=capacity, dim=0, sorted=False)
        capacity_mask = torch.zeros_like(routing_map).scatter(0, kept, True)
    elif drop_policy == "position":
        # Rank of each routed token within its expert's column; unrouted entries sort last.
        order = routing_map.int() * (num_tokens - torch.arange(num_tokens, device=routing_map.device)).unsqueeze(1)
        _, kept = torch.topk(order, k=capacity, dim=0, sorted=False)
        capacity_mask = torch.zeros_like(routing_map).scatter(0, kept, True)
    else:
        raise ValueError(f"moe_token_drop_policy ({drop_policy!r}) must be 'probs' or 'position'")
    final_map = capacity_mask if pad_to_capacity else routing_map & capacity_mask
    return routing_probs * final_map, final_map


def get_updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor,
                            expert_bias_update_rate: float, tp_dp_cp_group: Any = None) -> torch.Tensor:
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower it for over-loaded ones.

    ``tokens_per_expert`` is summed over ``tp_dp_cp_group`` in place; the bias moves by
    ``rate * sign(mean - count)``.
    """
    with torch.no_grad():
        all_reduce_sum_(tokens_per_expert, tp_dp_cp_group)
        average = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
        return expert_bias + torch.sign(average - tokens_per_expert) * expert_bias_update_rate


class RouterGatingLinearFunction(torch.autograd.Function):
    """Router logits ``inp @ weight.T + bias`` in ``router_dtype`` that keeps ``inp`` and ``weight`` in their own
    dtypes for the backward (Megatron-Core 0.19's function).

    Upcasting before a plain ``linear`` would save the upcast copies: an fp32 router over a bf16 model would hold a
    second, twice as large copy of every MoE layer's input until the backward. Here the casts are redone in the
    backward; the gradients are computed in ``router_dtype`` and returned in the inputs' dtypes.
    """

    @staticmethod
    def forward(ctx, inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                router_dtype: torch.dtype) -> torch.Tensor:
        """``inp @ weight.T + bias`` in ``router_dtype``; saves ``inp``, ``weight`` and ``bias`` as they are."""
        ctx.save_for_backward(inp, weight, bias)
        ctx.router_dtype = router_dtype
        bias = bias.to(router_dtype) if bias is not None else None
        return torch.nn.functional.linear(inp.to(router_dtype), weight.to(router_dtype), bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        """Gradients of ``inp``, ``weight`` and ``bias`` computed in ``router_dtype``, returned in their dtypes."""
        inp, weight, bias = ctx.saved_tensors
        dtype = ctx.router_dtype
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1]).to(dtype)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_2d.matmul(weight.to(dtype)).to(inp.dtype).view(inp.shape)
        if ctx.needs_input_grad[1]:
            grad_weight = grad_2d.t().matmul(inp.reshape(-1, inp.shape[-1]).to(dtype)).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_2d.sum(dim=0).to(bias.dtype)
        return grad_input, grad_weight, grad_bias, None


def router_gating_linear(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         router_dtype: torch.dtype) -> torch.Tensor:
    """Router logits ``inp @ weight.T + bias`` computed in ``router_dtype`` (:class:`RouterGatingLinearFunction`
    when that means a cast; a plain ``linear`` otherwise)."""
    if inp.dtype == router_dtype and weight.dtype == router_dtype and (bias is None or bias.dtype == router_dtype):
        return torch.nn.functional.linear(inp, weight, bias)
    return RouterGatingLinearFunction.apply(inp, weight, bias, router_dtype)


# --- Megatron-Core's deprecated aux-loss tracker functions (use get_moe_metrics_tracker()) ------------------
def save_to_aux_losses_tracker(name: str, loss: torch.Tensor, layer_number: int, num_layers: int,
                               reduce_group: Any = None, avg_group: Any = None,
                               reduce_group_has_dp: bool = False) -> None:
    """Deprecated: ``get_moe_metrics_tracker().record(...)``."""
    from megatron_core.transformer.moe.moe_logging import get_moe_metrics_tracker

    get_moe_metrics_tracker().record(name, loss, layer_number, num_layers, reduce_group=reduce_group,
                                     avg_group=avg_group, needs_dp_avg=not reduce_group_has_dp)


def clear_aux_losses_tracker() -> None:
    """Deprecated: ``get_moe_metrics_tracker().clear()``."""
    from megatron_core.transformer.moe.moe_logging import get_moe_metrics_tracker

    get_moe_metrics_tracker().clear()


def reduce_aux_losses_tracker_across_ranks(track_names: list[str] | None = None, pg_collection: Any = None) -> None:
    """Deprecated: reduce the tracked values across ranks in place (as ``report`` does)."""
    from megatron_core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    tracker._sync(list(track_names) if track_names is not None else list(tracker.metrics), pg_collection)


def get_moe_layer_wise_logging_tracker() -> dict[str, dict[str, Any]]:
    """Deprecated: the tracker's entries as ``{name: {"values", "reduce_group", "avg_group", "needs_dp_avg"}}``."""
    from megatron_core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return {name: {"values": e.values, "reduce_group": e.reduce_group, "avg_group": e.avg_group,
                   "needs_dp_avg": e.needs_dp_avg} for name, e in get_moe_metrics_tracker().metrics.items()}


def track_moe_metrics(loss_scale: float, iteration: int, writer: Any = None, wandb_writer: Any = None,
                      total_loss_dict: dict | None = None, per_layer_logging: bool = False,
                      force_initialize: bool = False, track_names: list[str] | None = None,
                      num_layers: int | None = None, moe_layer_freq: Any = None, mtp_num_layers: int | None = None,
                      pg_collection: Any = None) -> str:
    """Deprecated: ``get_moe_metrics_tracker().report(...)``."""
    from megatron_core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return get_moe_metrics_tracker().report(
        loss_scale, iteration, writer, wandb_writer, per_layer_logging, force_initialize, track_names, num_layers,
        moe_layer_freq, mtp_num_layers, total_loss_dict, None, pg_collection)
