"""Upcycling: initialise a MoE model from a trained dense model (``megatron.core.transformer.moe.upcycling_utils``).

Every routed expert starts as a slice of the dense MLP. With ``granularity = ffn_hidden_size //
moe_ffn_hidden_size`` the dense MLP's hidden units are cut into ``granularity`` slices and the experts are
``expansion_rate = num_moe_experts // granularity`` copies of that set: expert ``e`` holds slice
``e % granularity``. Router rows are tied within each block of ``granularity`` consecutive experts, so a block's
slices are scored alike and, when routed together, rebuild the whole dense MLP ("virtual group" upcycling,
arXiv:2410.07524). Expert weights are scaled so that the routed output matches the dense output under
Megatron-Core's probability assumptions (see :func:`expert_weight_scale`).

Everything else that both models share (embeddings, attention, norms, the output layer) is copied; the router,
its expert bias and any shared experts keep the MoE model's own initialisation. The conversion works on
each rank's local (tensor- and expert-parallel) shards, with ``expert_tensor_parallel_size`` equal to the
tensor-parallel size of the dense model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from megatron_core._ground import get_pg_rank, unwrap_model
from megatron_core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron_core.transformer.moe.moe_layer import BaseMoELayer

__all__ = [
    "ActivationFuncName",
    "ExpertsType",
    "UpcyclingPlan",
    "expert_weight_scale",
    "load_and_upcycle_model",
    "upcycle_state_dict",
]

ExpertsType = Enum("ExpertsType", ("SequentialMLP", "TEGroupedMLP"))
ActivationFuncName = Enum("ActivationFuncName", ("gelu", "silu", "squared_relu"))

# An expert parameter's key: (layer prefix, fc1|fc2, weight|bias, local expert index), in either layout.
_SEQUENTIAL_KEY = re.compile(r"^(?P<prefix>.*)mlp\.experts\.local_experts\.(?P<idx>\d+)\."
                             r"(?P<fc>linear_fc[12])\.(?P<param>weight|bias)$")
_GROUPED_KEY = re.compile(r"^(?P<prefix>.*)mlp\.experts\.(?P<fc>linear_fc[12])\.(?P<param>weight|bias)(?P<idx>\d+)$")
_ROUTER_KEY = re.compile(r"^(?P<prefix>.*)mlp\.router\.weight$")
_PRE_MLP_NORM_KEY = re.compile(r"^(?P<prefix>.*)pre_mlp_layernorm\.(?P<param>weight|bias)$")


@dataclass(frozen=True)
class UpcyclingPlan:
    """What the conversion needs to know of the two models (read off the MoE model's first MoE layer)."""

    num_local_experts: int
    num_experts: int
    topk: int
    granularity: int
    expansion_rate: int
    experts_type: ExpertsType
    gated_linear_unit: bool
    activation: ActivationFuncName
    pre_softmax: bool
    ep_rank: int

    @classmethod
    def from_models(cls, moe_model: torch.nn.Module, dense_model: torch.nn.Module) -> UpcyclingPlan:
        """Read the plan off ``moe_model``'s first MoE layer and ``dense_model``'s config; ValueError if they
        cannot be upcycled (no MoE layer, other experts, widths or expert counts that do not divide)."""
        moe_layer = next((m for m in moe_model.modules() if isinstance(m, BaseMoELayer)), None)
        if moe_layer is None:
            raise ValueError(f"upcycling needs a MoE model: {type(moe_model).__name__} has no MoE layer")
        config = moe_layer.config
        experts = moe_layer.experts
        if isinstance(experts, SequentialMLP):
            experts_type = ExpertsType.SequentialMLP
        elif isinstance(experts, TEGroupedMLP):
            experts_type = ExpertsType.TEGroupedMLP
        else:
            raise ValueError(f"upcycling supports SequentialMLP and TEGroupedMLP experts, not {type(experts).__name__}")
        func_name = getattr(config.activation_func, "__name__", repr(config.activation_func))
        if func_name not in ActivationFuncName.__members__:
            raise ValueError(f"upcycling supports activation_func in {list(ActivationFuncName.__members__)}; "
                             f"got {func_name}")
        dense_ffn, moe_ffn = dense_model.config.ffn_hidden_size, config.moe_ffn_hidden_size
        if dense_ffn % moe_ffn:
            raise ValueError(f"upcycling needs the dense ffn_hidden_size ({dense_ffn}) to be a multiple of "
                             f"moe_ffn_hidden_size ({moe_ffn})")
        granularity = dense_ffn // moe_ffn
        if config.num_moe_experts % granularity:
            raise ValueError(f"upcycling needs num_moe_experts ({config.num_moe_experts}) to be a multiple of the "
                             f"granularity ffn_hidden_size // moe_ffn_hidden_size = {granularity}")
        return cls(
            num_local_experts=moe_layer.num_local_experts, num_experts=config.num_moe_experts,
            topk=config.moe_router_topk, granularity=granularity,
            expansion_rate=config.num_moe_experts // granularity, experts_type=experts_type,
            gated_linear_unit=config.gated_linear_unit, activation=ActivationFuncName[func_name],
            pre_softmax=config.moe_router_pre_softmax, ep_rank=get_pg_rank(moe_layer.ep_group),
        )


def expert_weight_scale(plan: UpcyclingPlan) -> float:
    """The factor applied to every expert's fc1 and fc2 weights (and fc1 bias).

    The routed output is scaled by ``granularity`` when the top-k probabilities are renormalised (softmax after
    top-k: a block of ``granularity`` slices shares a probability of one), and by ``num_experts * granularity /
    topk`` with ``moe_router_pre_softmax`` (uniform probabilities over all experts). The expert's output grows as
    the cube of its weights for gated and squared-ReLU experts, as the square otherwise.
    """
    if plan.pre_softmax:
        activation_scale = plan.expansion_rate * plan.granularity ** 2 / plan.topk
    else:
        activation_scale = plan.granularity
    cubic = plan.gated_linear_unit or plan.activation is ActivationFuncName.squared_relu
    return activation_scale ** (1 / 3 if cubic else 1 / 2)


def _fc1_slice(value: torch.Tensor, plan: UpcyclingPlan, slice_idx: int) -> torch.Tensor:
    """Slice ``slice_idx`` of a dense fc1 weight or bias (output rows); a gated fc1's gate and up halves are
    sliced alike and stacked back as ``[gate_slice; up_slice]``."""
    value = value * expert_weight_scale(plan)
    if plan.gated_linear_unit:
        gate, up = torch.chunk(value, 2, dim=0)
        return torch.cat([torch.tensor_split(gate, plan.granularity, dim=0)[slice_idx],
                          torch.tensor_split(up, plan.granularity, dim=0)[slice_idx]], dim=0)
    return torch.tensor_split(value, plan.granularity, dim=0)[slice_idx]


def _fc2_slice(value: torch.Tensor, plan: UpcyclingPlan, slice_idx: int, param: str) -> torch.Tensor:
    """Slice ``slice_idx`` of a dense fc2 weight (input columns); the bias is copied whole, unscaled."""
    if param == "bias":
        return value.clone()
    return torch.tensor_split(value * expert_weight_scale(plan), plan.granularity, dim=1)[slice_idx]


def _tied_router_weight(weight: torch.Tensor, granularity: int) -> torch.Tensor:
    """Rows of the first ``num_experts // granularity`` router rows, each repeated ``granularity`` times."""
    first_block = torch.tensor_split(weight, granularity, dim=0)[0]
    return first_block.repeat_interleave(granularity, dim=0)


def _expert_value(match: re.Match, dense_state: dict[str, Any], plan: UpcyclingPlan, key: str) -> torch.Tensor:
    source = f"{match['prefix']}mlp.{match['fc']}.{match['param']}"
    if source not in dense_state:
        raise KeyError(f"upcycling {key}: the dense model has no {source}")
    slice_idx = (plan.ep_rank * plan.num_local_experts + int(match["idx"])) % plan.granularity
    value = dense_state[source]
    if match["fc"] == "linear_fc1":
        return _fc1_slice(value, plan, slice_idx)
    return _fc2_slice(value, plan, slice_idx, match["param"])


def _converted_value(key: str, moe_value: Any, dense_state: dict[str, Any], plan: UpcyclingPlan) -> Any:
    """The upcycled value of ``key`` in the MoE model's state dict."""
    expert = _SEQUENTIAL_KEY.match(key) or _GROUPED_KEY.match(key)
    if expert is not None:
        return _expert_value(expert, dense_state, plan, key)
    if _ROUTER_KEY.match(key):
        return _tied_router_weight(moe_value, plan.granularity)
    if key in dense_state:
        return dense_state[key]
    norm = _PRE_MLP_NORM_KEY.match(key)
    if norm is not None:
        # A dense layer built with the norm fused into fc1 (Transformer Engine's layout) keeps it there.
        fused = f"{norm['prefix']}mlp.linear_fc1.layer_norm_{norm['param']}"
        if fused in dense_state:
            return dense_state[fused]
    return moe_value  # the router's expert bias, shared experts, extra state: the MoE model's own


def _convert_to_moe_state_dict(moe_model: torch.nn.Module, dense_model: torch.nn.Module) -> dict[str, Any]:
    """The MoE model's state dict with every value that the dense model determines taken from it."""
    plan = UpcyclingPlan.from_models(moe_model, dense_model)
    dense_state = dense_model.state_dict()
    converted: dict[str, Any] = {}
    for key, moe_value in moe_model.state_dict().items():
        value = _converted_value(key, moe_value, dense_state, plan)
        if isinstance(value, torch.Tensor):
            if isinstance(moe_value, torch.Tensor) and value.shape != moe_value.shape:
                raise ValueError(f"upcycling {key}: the dense model gives shape {tuple(value.shape)}, the MoE model "
                                 f"holds {tuple(moe_value.shape)} (expert_tensor_parallel_size must equal the "
                                 "dense model's tensor_model_parallel_size)")
            value = value.detach().clone()
        converted[key] = value
    return converted


def _chunks(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    return [unwrap_model(chunk) for chunk in chunks]


def upcycle_state_dict(moe_model: torch.nn.Module | Sequence[torch.nn.Module],
                       dense_model: torch.nn.Module | Sequence[torch.nn.Module]) -> dict[str, dict[str, Any]]:
    """The MoE model's state dict initialised from the dense model, as Megatron-Core's checkpoints nest it.

    Both arguments are model chunks (a module or a list of them, one per virtual pipeline stage; DDP and
    Float16Module wrappers are looked through). Returns ``{"model": ...}`` for one chunk and
    ``{"model0": ..., "model1": ...}`` for several.
    """
    moe_chunks, dense_chunks = _chunks(moe_model), _chunks(dense_model)
    if len(moe_chunks) != len(dense_chunks):
        raise ValueError(f"upcycling needs as many dense model chunks ({len(dense_chunks)}) as MoE model chunks "
                         f"({len(moe_chunks)})")
    if len(moe_chunks) == 1:
        return {"model": _convert_to_moe_state_dict(moe_chunks[0], dense_chunks[0])}
    return {f"model{i}": _convert_to_moe_state_dict(moe, dense)
            for i, (moe, dense) in enumerate(zip(moe_chunks, dense_chunks))}


def load_and_upcycle_model(load_dense_ckpt_func: Callable[..., tuple[int, float]],
                           moe_model: torch.nn.Module | Sequence[torch.nn.Module],
                           dense_model: torch.nn.Module | Sequence[torch.nn.Module], strict: bool = True,
                           load_args: tuple = (), load_kwargs: dict | None = None) -> tuple[int, float]:
    """Load a dense checkpoint with ``load_dense_ckpt_func(*load_args, **load_kwargs)`` (which fills
    ``dense_model`` and returns ``(iteration, num_floating_point_operations_so_far)``), then load its upcycled
    weights into ``moe_model``. Returns what the load function returned."""
    iteration, num_floating_point_operations_so_far = load_dense_ckpt_func(*load_args, **(load_kwargs or {}))
    state_dict = upcycle_state_dict(moe_model, dense_model)
    moe_chunks = _chunks(moe_model)
    if len(moe_chunks) == 1:
        moe_chunks[0].load_state_dict(state_dict["model"], strict=strict)
    else:
        for i, chunk in enumerate(moe_chunks):
            chunk.load_state_dict(state_dict[f"model{i}"], strict=strict)
    return iteration, num_floating_point_operations_so_far
