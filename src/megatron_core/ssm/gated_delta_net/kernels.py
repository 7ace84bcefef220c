"""The kernels of the gated delta net: the one place the optional flash-linear-attention (``fla``) package is loaded.

``chunk_gated_delta_rule`` and ``causal_conv1d`` have flash-linear-attention's signatures. They run its Triton
kernels when ``fla`` is installed and the tensors are on an accelerator, and the pure-PyTorch code of this package
otherwise (:func:`~megatron_core.ssm.gated_delta_net.gated_delta_rule.torch_chunk_gated_delta_rule`, a depthwise
``F.conv1d``). Megatron-Core binds these names to ``fla``'s functions (``None`` without it); here they always work.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from megatron_core.ssm.gated_delta_net.gated_delta_rule import l2norm, torch_chunk_gated_delta_rule

__all__ = ["HAVE_FLA", "causal_conv1d", "chunk_gated_delta_rule", "l2norm"]

HAVE_FLA: bool = importlib.util.find_spec("fla") is not None
"""Whether flash-linear-attention is installed (found on the path; imported only when first used)."""


@cache
def _fla() -> SimpleNamespace:
    """flash-linear-attention's chunked rule and causal convolution (imported once)."""
    rule = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    conv = importlib.import_module("fla.modules.convolution").causal_conv1d
    return SimpleNamespace(chunk_gated_delta_rule=rule, causal_conv1d=conv)


def _use_fla(x: torch.Tensor) -> bool:
    return HAVE_FLA and x.device.type != "cpu"


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked gated delta rule (flash-linear-attention's signature): its kernel on an accelerator when
    installed, else :func:`torch_chunk_gated_delta_rule` (which takes no extra ``kwargs``)."""
    if _use_fla(q):
        return _fla().chunk_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                             output_final_state=output_final_state,
                                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                             cu_seqlens=cu_seqlens, **kwargs)
    if kwargs:
        raise ValueError(f"chunk_gated_delta_rule: the PyTorch path takes no extra arguments, got {sorted(kwargs)}")
    return torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                        output_final_state=output_final_state,
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                                        scale=scale)


def _torch_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str | None) -> torch.Tensor:
    """Depthwise causal convolution of ``x`` ``[b, s, d]`` with ``weight`` ``[d, w]``."""
    width = weight.shape[-1]
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[-1])
    out = out[..., :x.shape[1]].transpose(1, 2)
    if activation in ("silu", "swish"):
        return F.silu(out)
    if activation is not None:
        raise ValueError(f"causal_conv1d: activation ({activation!r}) must be None, 'silu' or 'swish'")
    return out


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution of ``x`` ``[b, s, d]`` by ``weight`` ``[d, w]`` (flash-linear-attention's
    signature; returns ``(y, final_state)``). With ``cu_seqlens`` (``b == 1``) each packed sequence starts from zeros.
    The PyTorch path keeps no convolution state: ``initial_state`` and ``output_final_state`` need ``fla``."""
    if _use_fla(x):
        return _fla().causal_conv1d(x=x, weight=weight, bias=bias, activation=activation,
                                    initial_state=initial_state, output_final_state=output_final_state,
                                    cu_seqlens=cu_seqlens, **kwargs)
    if initial_state is not None or output_final_state or kwargs:
        raise ValueError("causal_conv1d: initial_state / output_final_state / extra arguments need "
                         "flash-linear-attention on an accelerator; the PyTorch path keeps no convolution state")
    if cu_seqlens is None:
        return _torch_causal_conv1d(x, weight, bias, activation), None
    bounds = [int(b) for b in cu_seqlens.tolist()]
    parts = [_torch_causal_conv1d(x[:, a:b], weight, bias, activation) for a, b in zip(bounds, bounds[1:])]
    return torch.cat(parts, dim=1), None
