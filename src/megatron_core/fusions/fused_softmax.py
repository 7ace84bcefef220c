"""Scale, mask and softmax of attention scores (Megatron-Core's ``fusions.fused_softmax``), in PyTorch.

:class:`FusedScaleMaskSoftmax` turns scores ``[b, np, sq, sk]`` into probabilities: optionally in fp32 for
half-precision scores, times ``scale``, masked by ``mask_func`` (Megatron's fills masked scores with -10000,
not -inf, so a row with every key masked comes out uniform), then a softmax over the keys. A causal mask type
without a mask tensor builds the causal mask; ``window_size`` builds a sliding-window mask. With a
``softmax_offset`` (one logit per head, an attention sink) :class:`SoftmaxOne` adds ``exp(offset[h])`` to every
row's denominator.

Megatron-Core routes half-precision scores of suitable shapes to three CUDA kernels. None ships with this
library: :meth:`FusedScaleMaskSoftmax.is_kernel_available` is always False and the PyTorch path computes the
same values. The three kernels' autograd functions (:class:`ScaledUpperTriangMaskedSoftmax`,
:class:`ScaledMaskedSoftmax`, :class:`ScaledSoftmax`) are here as PyTorch functions with the kernels' contract:
fp32 arithmetic, the result in the input's dtype, only the probabilities saved for the backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_core._ground.attention_masks import get_default_causal_mask, get_sliding_window_causal_mask
from megatron_core.enums import AttnMaskType

__all__ = [
    "FusedScaleMaskSoftmax",
    "ScaledMaskedSoftmax",
    "ScaledSoftmax",
    "ScaledUpperTriangMaskedSoftmax",
    "SoftmaxOne",
]

_MASKED_SCORE = -10000.0  # the score Megatron's kernels and attention_mask_func give masked positions
_WARP_SIZE = 32
_THREADS_PER_BLOCK = 128


def _softmax_forward(inputs: torch.Tensor, scale: float, mask: torch.Tensor | None, fill: float) -> torch.Tensor:
    """``softmax(inputs * scale)`` over the last dim, ``fill`` at ``mask`` (True = masked); fp32 inside."""
    scores = inputs.float() * scale
    if mask is not None:
        scores = scores.masked_fill(mask, fill)
    return torch.softmax(scores, dim=-1).to(inputs.dtype)


def _softmax_backward(grad: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    """Gradient of the scaled softmax from its output: ``scale * p * (g - sum(g * p))``, in ``grad``'s dtype."""
    g, p = grad.float(), probs.float()
    return (scale * p * (g - (g * p).sum(dim=-1, keepdim=True))).to(grad.dtype)


class ScaledUpperTriangMaskedSoftmax(torch.autograd.Function):
    """Causal softmax of ``inputs * scale`` for scores ``[attn_batches, sq, sk]`` (key ``j > i`` hidden)."""

    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, scale: float) -> torch.Tensor:
        """Probabilities in ``inputs``' dtype; masked keys get exactly 0."""
        if inputs.dim() != 3:
            raise ValueError(f"ScaledUpperTriangMaskedSoftmax needs scores [attn_batches, sq, sk], got "
                             f"{tuple(inputs.shape)}")
        sq, sk = inputs.shape[1:]
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=inputs.device).triu(diagonal=1)
        probs = _softmax_forward(inputs, scale, hidden, float("-inf"))
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx: Any, output_grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Gradient with respect to the scores (masked positions get 0: their probability is 0)."""
        (probs,) = ctx.saved_tensors
        return _softmax_backward(output_grads, probs, ctx.scale), None


class ScaledMaskedSoftmax(torch.autograd.Function):
    """Softmax of ``inputs * scale`` for scores ``[b, np, sq, sk]``, -10000 where ``mask`` (bool, broadcastable)."""

    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """Probabilities in ``inputs``' dtype."""
        probs = _softmax_forward(inputs, scale, mask.bool(), _MASKED_SCORE)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx: Any, output_grads: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        """Gradient with respect to the scores."""
        (probs,) = ctx.saved_tensors
        return _softmax_backward(output_grads, probs, ctx.scale), None, None


class ScaledSoftmax(torch.autograd.Function):
    """Softmax of ``inputs * scale`` over the last dimension (no mask)."""

    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, scale: float) -> torch.Tensor:
        """Probabilities in ``inputs``' dtype."""
        probs = _softmax_forward(inputs, scale, None, _MASKED_SCORE)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx: Any, output_grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Gradient with respect to the scores."""
        (probs,) = ctx.saved_tensors
        return _softmax_backward(output_grads, probs, ctx.scale), None


class SoftmaxOne(torch.nn.Module):
    """Softmax over the last dimension of ``[b, np, sq, sk]`` with one extra logit per head: an attention sink.

    ``denominator_offset`` is that logit, per head (``[np]``) or one number for all heads: every row's
    denominator grows by ``exp(denominator_offset[h])``, and the probabilities sum to less than 1. A zero offset
    is the "off-by-one" softmax (``+1`` in the denominator). ``dim`` is kept for Megatron-Core's signature; the
    softmax always runs over the last dimension.
    """

    def __init__(self, dim: int | None = None, denominator_offset: torch.Tensor | float = 1.0) -> None:
        super().__init__()
        if dim not in (None, -1, 3):
            raise ValueError(f"SoftmaxOne: dim ({dim}) must be the last dimension (-1 or 3) of [b, np, sq, sk]")
        self.dim = dim
        self.denominator_offset = denominator_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Probabilities ``[b, np, sq, sk]`` in ``x``'s dtype."""
        if x.dim() != 4:
            raise ValueError(f"SoftmaxOne needs scores [b, np, sq, sk], got {tuple(x.shape)}")
        offset = torch.as_tensor(self.denominator_offset, dtype=x.dtype, device=x.device).reshape(1, -1, 1, 1)
        if offset.shape[1] not in (1, x.shape[1]):
            raise ValueError(f"SoftmaxOne: denominator_offset has {offset.shape[1]} values for {x.shape[1]} heads")
        sink = offset.expand(x.shape[0], x.shape[1], x.shape[2], 1)
        return torch.softmax(torch.cat((x, sink), dim=-1), dim=-1)[..., :-1]


class FusedScaleMaskSoftmax(torch.nn.Module):
    """Scale + mask + softmax of attention scores (see the module docstring).

    ``input_in_fp16`` / ``input_in_bf16`` say the scores' precision; with ``softmax_in_fp32`` the softmax runs
    in fp32 and the probabilities return in that precision. ``scale`` (None: 1) requires ``softmax_in_fp32``.
    ``mask_func(scores, mask)`` applies a boolean mask (``transformer.utils.attention_mask_func``).
    ``scaled_masked_softmax_fusion`` asks for the fused kernels, which this library does not have.
    """

    def __init__(
        self,
        input_in_fp16: bool,
        input_in_bf16: bool,
        attn_mask_type: AttnMaskType,
        scaled_masked_softmax_fusion: bool,
        mask_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        softmax_in_fp32: bool,
        scale: float | None,
        window_size: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if input_in_fp16 and input_in_bf16:
            raise ValueError("FusedScaleMaskSoftmax: input_in_fp16 and input_in_bf16 cannot both be True")
        if scale is not None and not softmax_in_fp32:
            raise ValueError(f"FusedScaleMaskSoftmax: scale ({scale}) needs softmax_in_fp32=True")
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        self.input_in_float16 = input_in_fp16 or input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale
        self.window_size = window_size

    def forward(self, input: torch.Tensor, mask: torch.Tensor | None,
                softmax_offset: torch.Tensor | None = None) -> torch.Tensor:
        """Probabilities ``[b, np, sq, sk]`` of scores ``input`` ``[b, np, sq, sk]``.

        ``mask`` (bool, True = masked) may be None for a causal mask type: the causal mask is built.
        ``softmax_offset`` (``[np]``) adds an attention sink per head (:class:`SoftmaxOne`).
        """
        if input.dim() != 4:
            raise ValueError(f"FusedScaleMaskSoftmax needs scores [b, np, sq, sk], got {tuple(input.shape)}")
        if softmax_offset is None and self.is_kernel_available(mask, *input.shape):
            return self.forward_fused_softmax(input, mask)
        return self.forward_torch_softmax(input, mask, softmax_offset)

    def is_kernel_available(self, mask: torch.Tensor | None, b: int, np: int, sq: int, sk: int) -> bool:
        """Whether a fused softmax kernel would run: never here (this library ships none; the PyTorch path
        computes the same probabilities)."""
        return False

    def forward_fused_softmax(self, input: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The kernels' route: the causal function for causal mask types, else the masked or plain one.

        The scores keep their dtype (no fp32 copy); the arithmetic is fp32 inside each function.
        """
        b, np, sq, sk = input.shape
        scale = self.scale if self.scale is not None else 1.0
        if self.attn_mask_type == AttnMaskType.causal:
            if sq != sk:
                raise ValueError(f"the causal softmax needs self-attention scores (sq == sk), got sq={sq}, sk={sk}")
            return ScaledUpperTriangMaskedSoftmax.apply(input.reshape(-1, sq, sk), scale).view(b, np, sq, sk)
        if mask is not None:
            return ScaledMaskedSoftmax.apply(input, mask, scale)
        return ScaledSoftmax.apply(input, scale)

    def forward_torch_softmax(self, input: torch.Tensor, mask: torch.Tensor | None,
                              softmax_offset: torch.Tensor | None = None) -> torch.Tensor:
        """The PyTorch route: fp32 upcast, scale, default masks, ``mask_func``, softmax (with a sink), cast back."""
        upcast = self.input_in_float16 and self.softmax_in_fp32
        if upcast:
            input = input.float()
        if self.scale is not None:
            input = input * self.scale
        sq, sk = input.shape[2], input.shape[3]
        if self.window_size is not None:
            mask = get_sliding_window_causal_mask(sq, sk, self.window_size, device=input.device)
        elif self.attn_mask_type == AttnMaskType.causal and mask is None and sq > 1:
            # sq == 1 is one new token against a KV cache (or a one-token prompt): it may see every key.
            if sq != sk:
                raise ValueError(f"the causal softmax needs self-attention scores (sq == sk), got sq={sq}, sk={sk}")
            mask = get_default_causal_mask(sq, device=input.device)
        scores = self.mask_func(input, mask) if mask is not None else input
        if softmax_offset is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            probs = SoftmaxOne(-1, softmax_offset)(scores)
        if upcast:
            probs = probs.half() if self.input_in_fp16 else probs.bfloat16()
        return probs

    @staticmethod
    def get_batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
        """Rows of scores one CUDA block of Megatron's masked-softmax kernel handles (its launch arithmetic).

        A row of ``sk`` keys rounds up to a power of two ``n``; one warp (at most 32 threads) takes a row, two
        rows when ``n <= 128``; a block has 128 threads. ``sq``, ``b`` and ``np`` do not enter.
        """
        padded = 1 << max(0, (sk - 1).bit_length())
        warp = min(padded, _WARP_SIZE)
        rows_per_warp = 2 if padded <= 128 else 1
        return (_THREADS_PER_BLOCK // warp) * rows_per_warp
