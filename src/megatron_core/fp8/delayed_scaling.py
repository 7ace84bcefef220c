"""FP8 delayed scaling state without Transformer Engine (Megatron-Core's default ``fp8_recipe='delayed'``).

Mirrors Transformer Engine's ``DelayedScaling`` recipe, which Megatron-Core builds from ``fp8``,
``fp8_margin``, ``fp8_amax_history_len``, ``fp8_amax_compute_algo`` and ``fp8_wgrad``. Every FP8 linear
layer quantizes three GEMM operands, each with its own per-tensor scale: the input and the weight in
the forward pass (e4m3) and the output gradient in the backward pass (e4m3, or e5m2 with
``fp8='hybrid'``). Each operand keeps an amax history of ``fp8_amax_history_len`` steps:

* step ``t`` quantizes with the scale derived from the steps before ``t`` (the first step uses 1);
* after the GEMM the tensor's amax (max ``|x|``, max-reduced over the amax reduction group: as in
  Megatron-Core, the tensor x data x context parallel group, or the layer's tensor-parallel group when
  ``parallel_state`` is not initialized) is recorded in the history, and the scale for step ``t + 1``
  is computed at once:
  ``amax = max(history)`` (``'max'``) or the amax just recorded (``'most_recent'``), then
  ``scale = (fp8_max / amax) / 2**margin`` (at most the largest fp32); an amax of 0 or not finite
  keeps the previous scale;
* the history is a ring of the last ``fp8_amax_history_len`` amaxes (slot 0 takes the next one);
* activation recompute reuses the first pass's scales and records nothing (a FIFO ``fp8_recompute_stash``
  of at most :data:`RECOMPUTE_STASH_LEN` scale vectors, see :func:`megatron_core.fp8.delayed_linear.delayed_float8_matmul`).

The state lives in two non-persistent buffers of the layer (``fp8_amax_history [len, 3]`` and
``fp8_scale [3]``, columns: input, weight, output gradient; a third, ``fp8_limits``, holds the
float8 maxima), so it follows ``.to()``/``.cuda()`` and its update needs no host-device copy;
checkpoints carry it as the layer's ``_extra_state`` (:func:`pack_extra_state` /
:func:`unpack_extra_state`), as Transformer Engine's modules do.
"""

from __future__ import annotations

import io
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from megatron_core.distributed.fp8_params import fp8_max

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
FORWARD_COLUMNS = slice(INPUT, WEIGHT + 1)
BACKWARD_COLUMNS = slice(GRAD_OUTPUT, GRAD_OUTPUT + 1)
ALL_COLUMNS = slice(INPUT, GRAD_OUTPUT + 1)
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
EXTRA_STATE_VERSION = 1
RECOMPUTE_STASH_LEN = 1024


@dataclass(frozen=True)
class DelayedScalingRecipe:
    """The delayed-scaling settings of a model (from its config; see :meth:`from_config`)."""

    fp8_format: str = "e4m3"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True

    @classmethod
    def from_config(cls, config: Any) -> DelayedScalingRecipe:
        """The recipe of ``config`` (``fp8``, ``fp8_margin``, ``fp8_amax_history_len``, ...)."""
        return cls(fp8_format=config.fp8, margin=int(config.fp8_margin),
                   amax_history_len=int(config.fp8_amax_history_len),
                   amax_compute_algo=config.fp8_amax_compute_algo, fp8_wgrad=bool(getattr(config, "fp8_wgrad", True)))

    @property
    def forward_dtype(self) -> torch.dtype:
        """The float8 dtype of the input and the weight (e4m3)."""
        return torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        """The float8 dtype of the output gradient (e5m2 with ``fp8='hybrid'``, else e4m3)."""
        return torch.float8_e5m2 if self.fp8_format == "hybrid" else torch.float8_e4m3fn

    def dtype_of(self, column: int) -> torch.dtype:
        """The float8 dtype of operand ``column`` (:data:`INPUT`, :data:`WEIGHT`, :data:`GRAD_OUTPUT`)."""
        return self.backward_dtype if column == GRAD_OUTPUT else self.forward_dtype


def check_delayed_config(config: Any) -> None:
    """Reject delayed-scaling settings this library cannot honour (``ValueError`` naming the field)."""
    if config.fp8_amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(f"fp8_amax_compute_algo ({config.fp8_amax_compute_algo!r}) must be one of "
                         f"{AMAX_COMPUTE_ALGOS}")
    if config.fp8_amax_history_len < 1 or config.fp8_margin < 0:
        raise ValueError(f"fp8_amax_history_len ({config.fp8_amax_history_len}) must be >= 1 and fp8_margin "
                         f"({config.fp8_margin}) >= 0")
    if config.fp8_interval != 1:
        raise ValueError(f"fp8_interval ({config.fp8_interval}) must be 1: scales are updated after every step "
                         "(Transformer Engine deprecated the interval and ignores it)")


def init_state(layer: torch.nn.Module, recipe: DelayedScalingRecipe, device: torch.device,
               amax_group: Any = None) -> None:
    """Give ``layer`` a fresh delayed-scaling state (zero histories, unit scales) as non-persistent buffers;
    its amaxes will be max-reduced over ``amax_group`` (None: not reduced)."""
    layer.float8_recipe = recipe
    layer.fp8_amax_group = amax_group
    layer.fp8_recompute_stash = deque(maxlen=RECOMPUTE_STASH_LEN)
    layer.register_buffer("fp8_amax_history", torch.zeros(recipe.amax_history_len, 3, device=device),
                          persistent=False)
    layer.register_buffer("fp8_scale", torch.ones(3, device=device), persistent=False)
    limits = [fp8_max(recipe.dtype_of(c)) for c in (INPUT, WEIGHT, GRAD_OUTPUT)]
    layer.register_buffer("fp8_limits", torch.tensor(limits, device=device), persistent=False)


@torch.no_grad()
def record_amax(layer: torch.nn.Module, columns: slice, amax: torch.Tensor) -> None:
    """Record ``amax`` (one per column of ``columns``) as the newest entry, compute the next scales, roll.

    Slices and the layer's ``fp8_limits`` buffer keep this free of host-to-device copies."""
    recipe: DelayedScalingRecipe = layer.float8_recipe
    history, scale = layer.fp8_amax_history, layer.fp8_scale
    window = history[:, columns].clone()
    window[0] = amax.to(window)
    current = window.amax(dim=0) if recipe.amax_compute_algo == "max" else window[0]
    candidate = (layer.fp8_limits[columns] / current) / (2.0 ** recipe.margin)
    candidate = candidate.clamp(max=torch.finfo(torch.float32).max)  # a tiny amax: the largest fp32, not inf
    keep = (current <= 0) | ~torch.isfinite(current)
    scale[columns] = torch.where(keep, scale[columns], candidate)
    window = torch.roll(window, -1, 0)
    window[0] = 0
    history[:, columns] = window


def pack_extra_state(layer: torch.nn.Module) -> dict[str, Any]:
    """The layer's delayed-scaling state as a checkpointable ``_extra_state`` (CPU tensors)."""
    return {"fp8_recipe": "delayed", "version": EXTRA_STATE_VERSION,
            "amax_history": layer.fp8_amax_history.detach().cpu().clone(),
            "scale": layer.fp8_scale.detach().cpu().clone()}


@torch.no_grad()
def unpack_extra_state(layer: torch.nn.Module, state: Any) -> None:
    """Load a :func:`pack_extra_state` dict into ``layer``. ``None`` (a high-precision or torchao-recipe
    checkpoint) resets the state (zero histories, unit scales); so does Transformer Engine's serialized FP8
    state (it needs TE's classes to read), with a warning. ``ValueError`` for a dict of another kind or
    another ``fp8_amax_history_len``."""
    if state is None or isinstance(state, (torch.Tensor, io.BytesIO)):
        size = 0 if state is None else state.numel() if isinstance(state, torch.Tensor) else len(state.getbuffer())
        if size:
            warnings.warn(f"{type(layer).__name__}: _extra_state holds Transformer Engine's serialized FP8 state, "
                          "which cannot be read without it; the delayed-scaling state starts afresh "
                          "(zero amax history, scales 1)", stacklevel=2)
        layer.fp8_amax_history.zero_()
        layer.fp8_scale.fill_(1.0)
        layer.fp8_recompute_stash.clear()
        return
    if not isinstance(state, dict) or state.get("fp8_recipe") != "delayed":
        raise ValueError(f"{type(layer).__name__}: _extra_state is not FP8 delayed-scaling state "
                         f"(got {type(state).__name__})")
    history = state["amax_history"]
    if tuple(history.shape) != tuple(layer.fp8_amax_history.shape):
        raise ValueError(f"{type(layer).__name__}: the checkpoint's amax history has {history.shape[0]} steps, "
                         f"fp8_amax_history_len is {layer.fp8_amax_history.shape[0]}")
    layer.fp8_amax_history.copy_(history)
    layer.fp8_scale.copy_(state["scale"])
