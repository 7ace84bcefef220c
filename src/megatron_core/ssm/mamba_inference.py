"""The Mamba mixer under the dynamic inference context (the inference path of Megatron-Core's ``MambaMixer``:
its ``step`` and the state-returning prefill, written here in plain PyTorch).

A request's state is its *convolution state* ``[channels, d_conv]`` (the last ``d_conv`` inputs of the
depthwise convolution, oldest first) and its *SSM state* ``[heads, head_dim, d_state]``. Prefill runs the
causal convolution over the chunk with the stored inputs in front of it and the chunked SSD scan from
the stored SSM state, and returns the new states; decode advances every state by one token:

* convolution: shift the window left by one, append the token's ``x, B, C``, ``silu(bias + sum(window * w))``;
* SSM: ``h = exp(dt * A) * h + dt * x B^T``, ``y = h C + D * x``.

Everything is computed in fp32 (or wider); the states come back in fp32 and are stored in the slots' dtype.
:func:`mixer_inference` runs a whole step of the flattened continuous batch for one mixer. Its prefill scan
uses the serving config's ``MambaInferenceStateConfig.mamba_chunk_size`` (Megatron-Core's chunk size of the
inference SSD kernels; ``from_model`` copies the mixer's own), which changes the rounding only, not the result.
On CUDA with Triton, prefill runs the Triton scan from the stored state (:mod:`megatron_core.ssm.ssd_scan_triton`,
in its own chunk length) and decode the two fused kernels of :mod:`megatron_core.ssm.mamba_decode_triton`; the
functions here stay the CPU path and the reference. On that path the prefill chunks of a step are convolved and
scanned together as one padded batch (one Triton call) where the padding stays within
:data:`~megatron_core.ssm.mamba_prefill_batch.MAX_PADDING_RATIO`, else one at a time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_core.ssm.causal_conv1d import causal_conv1d_silu
from megatron_core.ssm.gated_rmsnorm_triton import gated_rmsnorm, gated_rmsnorm_supported
from megatron_core.ssm.mamba_decode_triton import mamba_decode_step, mamba_decode_supported
from megatron_core.ssm.mamba_prefill_batch import PrefillBatchPlan, prefill_batch_plan
from megatron_core.ssm.ssd_scan import ssd_chunk_scan
from megatron_core.ssm.ssd_scan_triton import ssd_chunk_scan_triton, ssd_scan_triton_supported

__all__ = ["conv_prefill", "conv_step", "mixer_inference", "ssm_prefill", "ssm_step"]

_TRITON_MAX_DIM = 256  # the Triton kernels' largest d_state


def conv_prefill(conv_state: torch.Tensor, xBC: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(silu(conv(xBC)) [1, n, ch], new conv state [ch, K])`` of one sequence's chunk ``xBC`` ``[1, n, ch]``.

    ``conv_state`` ``[ch, K]`` holds the inputs before the chunk (zeros for a fresh sequence); its last
    ``K - 1`` columns are the window the chunk's first outputs see.
    """
    kernel = weight.shape[-1]
    history = conv_state[:, 1:].t().unsqueeze(0).to(xBC.dtype)  # [1, K-1, ch]
    full = torch.cat([history, xBC], dim=1)
    out = causal_conv1d_silu(full, weight, bias)[:, kernel - 1:]
    return out, full[0, -kernel:].t().float()


def conv_step(conv_state: torch.Tensor, xBC: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: ``xBC`` ``[b, ch]``, ``conv_state`` ``[b, ch, K]`` -> ``(out [b, ch], new state)``."""
    window = torch.cat([conv_state[..., 1:].float(), xBC.float().unsqueeze(-1)], dim=-1)
    w = weight.reshape(weight.shape[0], -1).float()
    out = F.silu((window * w).sum(-1) + bias.float())
    return out.to(xBC.dtype), window


def ssm_prefill(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan of one sequence's chunk from ``ssm_state`` ``[h, p, n]``: ``(y [1, n, h, p], new state)``.

    On CUDA with Triton the Triton scan runs forward from the state (in its own chunks, ``SCAN_BLOCKS["chunk"]``,
    as in training); elsewhere the PyTorch scan in chunks of ``chunk_size``.
    """
    if ssd_scan_triton_supported(x, ssm_state, True) and B.shape[-1] <= _TRITON_MAX_DIM:
        y, state = ssd_chunk_scan_triton(x, dt, A, B, C, D, initial_state=ssm_state.unsqueeze(0),
                                         return_final_state=True)
    else:
        y, state = ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=D, initial_state=ssm_state.unsqueeze(0),
                                  return_final_state=True)
    return y, state[0]


def ssm_step(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: ``x`` ``[b, h, p]``, ``dt`` ``[b, h]`` (after softplus), ``B``/``C`` ``[b, g, n]``,
    ``ssm_state`` ``[b, h, p, n]``, ``D`` ``[h]`` or ``[h, p]`` -> ``(y [b, h, p], new state)``."""
    heads = x.shape[1]
    per_group = heads // B.shape[1]
    Bh = B.float().repeat_interleave(per_group, dim=1)  # [b, h, n]
    Ch = C.float().repeat_interleave(per_group, dim=1)
    xf, dtf = x.float(), dt.float()
    decay = torch.exp(dtf * A.float())  # [b, h]
    state = ssm_state.float() * decay[..., None, None] + (dtf[..., None] * xf)[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", state, Ch)
    Df = D.float()
    y = y + xf * (Df if Df.dim() == 2 else Df[:, None])
    return y.to(x.dtype), state


def _scan_inputs(mixer: Any, xBC: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``x, dt, A, B, C, D`` of the scan from the convolution's output ``[b, l, ch]`` and the raw ``dt`` ``[b, l, h]``."""
    batch, length = xBC.shape[:2]
    heads, groups, state = mixer.nheads_local_tp, mixer.ngroups_local_tp, mixer.d_state
    x, B, C = torch.split(xBC, [mixer.d_inner_local_tp, groups * state, groups * state], dim=-1)
    dt = F.softplus(dt.float() + mixer.dt_bias.float())
    A = -torch.exp(mixer.A_log.float())
    D = mixer.D.float().view(heads, mixer.headdim) if mixer.D_has_hdim else mixer.D
    return (x.reshape(batch, length, heads, mixer.headdim), dt, A, B.reshape(batch, length, groups, state),
            C.reshape(batch, length, groups, state), D)


def _is_plain_extended_rmsnorm(norm: Any) -> bool:
    """Whether ``norm`` is exactly ``mamba_mixer.ExtendedRMSNorm`` (not a subclass), named rather than imported:
    ``mamba_mixer`` imports this module."""
    kind = type(norm)
    return kind.__module__ == "megatron_core.ssm.mamba_mixer" and kind.__qualname__ == "ExtendedRMSNorm"


def _gate_norm(mixer: Any, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The scan's output ``[..., d_inner local]`` gated by ``silu(z)`` and group-normalised as in training (the
    mixer's ``ExtendedRMSNorm`` as one Triton kernel on CUDA, :mod:`megatron_core.ssm.gated_rmsnorm_triton`)."""
    if mixer.rmsnorm:
        norm = mixer.norm
        if _is_plain_extended_rmsnorm(norm) and gated_rmsnorm_supported(y, z, norm.group_size):
            return gated_rmsnorm(y, z, norm.weight, norm.eps, norm.group_size, norm.norm_before_gate)
        return norm(y, z)
    return (y.float() * F.silu(z.float())).to(y.dtype)


def _batched_prefill(mixer: Any, plan: PrefillBatchPlan, xBC_in: torch.Tensor, dt: torch.Tensor, z: torch.Tensor,
                     conv_states: torch.Tensor, ssm_states: torch.Tensor, out: torch.Tensor) -> None:
    """Every prefill chunk of the step as one padded batch (:mod:`~megatron_core.ssm.mamba_prefill_batch`): one
    convolution behind the stored inputs, one Triton scan from the stored states; states and ``out`` written."""
    S, L = plan.chunks, plan.longest
    kernel = mixer.conv1d_weight.shape[-1]
    padded = torch.cat([xBC_in, xBC_in.new_zeros(1, xBC_in.shape[1])]).index_select(0, plan.gather).view(S, L, -1)
    history = conv_states.index_select(0, plan.slots)[:, :, 1:].transpose(1, 2).to(padded.dtype)  # [S, K-1, ch]
    full = torch.cat([history, padded], dim=1)
    xBC = causal_conv1d_silu(full, mixer.conv1d_weight, mixer.conv1d_bias)[:, kernel - 1:]
    new_conv = torch.gather(full, 1, plan.tail[:, :, None].expand(S, kernel, full.shape[2]))  # [S, K, ch]
    conv_states.index_copy_(0, plan.slots, new_conv.transpose(1, 2).to(conv_states.dtype))
    dt_padded = torch.cat([dt, dt.new_zeros(1, dt.shape[1])]).index_select(0, plan.gather).view(S, L, -1)
    xs, dts, A, Bs, Cs, D = _scan_inputs(mixer, xBC, dt_padded)
    y, final = ssd_chunk_scan_triton(xs, dts * plan.valid, A, Bs, Cs, D,
                                     initial_state=ssm_states.index_select(0, plan.slots), return_final_state=True)
    ssm_states.index_copy_(0, plan.slots, final.to(ssm_states.dtype))
    y = y.reshape(S * L, -1).index_select(0, plan.src)
    out.index_copy_(0, plan.dest, _gate_norm(mixer, y, z.index_select(0, plan.dest)).to(out.dtype))


def mixer_inference(mixer: Any, zxBCdt: torch.Tensor, context: Any) -> torch.Tensor:
    """One step of ``mixer`` (a ``MambaMixer``): ``in_proj``'s output ``[T, 1, .]`` -> ``[T, 1, d_inner local]``.

    ``context.mamba_states_cache(layer_number)`` gives the layer's state slots and
    ``context.mamba_step_layout()`` the slots of the decode rows (the first ``nd`` rows, one token each,
    advanced together by :func:`conv_step` and :func:`ssm_step`, or on CUDA with Triton by the fused kernels of
    :mod:`megatron_core.ssm.mamba_decode_triton`, which update the slots in place) and ``(first row, rows, slot)``
    of each prefill chunk (:func:`conv_prefill` behind its stored inputs, :func:`ssm_prefill` from its stored
    state, scanned in chunks of the context's ``mamba_chunk_size`` on the PyTorch path; on the Triton path two or
    more chunks go as one padded batch, :mod:`megatron_core.ssm.mamba_prefill_batch`, where padding stays within
    its bound). The new states are written back into the slots. Rows after the last prefill chunk (a
    sequence-parallel step's padding) belong to no request: they read and write no state and come out as zeros.
    """
    if getattr(getattr(mixer, "cp", None), "cp_size", 1) > 1:
        raise ValueError(f"MambaMixer inference with context parallelism (cp_size={mixer.cp.cp_size}) is not supported")
    conv_states, ssm_states = context.mamba_states_cache(mixer.layer_number)
    decode_slots, prefill = context.mamba_step_layout()
    covered = sum(prefill[-1][:2]) if prefill else decode_slots.numel()  # rows past these: padding
    slots = getattr(context, "mamba_slots", None)
    chunk_size = slots.chunk_size if slots is not None else mixer.chunk_size
    rows = zxBCdt[:, 0]
    bc = mixer.ngroups_local_tp * mixer.d_state
    d_inner = mixer.d_inner_local_tp
    z, x, B, C, dt = torch.split(rows, [d_inner, d_inner, bc, bc, mixer.nheads_local_tp], dim=-1)
    xBC_in = rows[:, d_inner:2 * d_inner + 2 * bc]  # x, B, C: adjacent columns of in_proj's output [T, channels]
    weight, bias = mixer.conv1d_weight, mixer.conv1d_bias
    out = rows.new_empty(rows.shape[0], d_inner)
    nd = decode_slots.numel()
    if nd and mamba_decode_supported(rows, conv_states, ssm_states):
        # x, B, C and dt read in place from in_proj's rows; the slots updated in place.
        y = mamba_decode_step(rows[:nd, d_inner:], rows[:nd, 2 * d_inner + 2 * bc:], decode_slots, conv_states,
                              ssm_states, weight, bias, mixer.dt_bias, mixer.A_log, mixer.D, mixer.ngroups_local_tp)
        out[:nd] = _gate_norm(mixer, y.reshape(nd, d_inner), z[:nd])
    elif nd:
        xBC, conv = conv_step(conv_states[decode_slots], xBC_in[:nd], weight, bias)
        xs, dts, A, Bs, Cs, D = _scan_inputs(mixer, xBC[:, None], dt[:nd, None])
        y, ssm = ssm_step(ssm_states[decode_slots], xs[:, 0], dts[:, 0], A, Bs[:, 0], Cs[:, 0], D)
        conv_states.index_copy_(0, decode_slots, conv.to(conv_states.dtype))
        ssm_states.index_copy_(0, decode_slots, ssm.to(ssm_states.dtype))
        out[:nd] = _gate_norm(mixer, y.reshape(nd, d_inner), z[:nd])
    plan = None
    if prefill and mixer.d_state <= _TRITON_MAX_DIM and ssd_scan_triton_supported(
            x.unflatten(-1, (mixer.nheads_local_tp, mixer.headdim)), ssm_states, True):
        plan = prefill_batch_plan(context, prefill, rows.shape[0], weight.shape[-1], rows.device)
    if plan is not None:
        _batched_prefill(mixer, plan, xBC_in, dt, z, conv_states, ssm_states, out)
        prefill = []
    for first, count, slot in prefill:
        seg = slice(first, first + count)
        xBC, conv = conv_prefill(conv_states[slot], xBC_in[None, seg], weight, bias)
        xs, dts, A, Bs, Cs, D = _scan_inputs(mixer, xBC, dt[None, seg])
        y, ssm = ssm_prefill(ssm_states[slot], xs, dts, A, Bs, Cs, D, chunk_size)
        conv_states[slot] = conv.to(conv_states.dtype)
        ssm_states[slot] = ssm.to(ssm_states.dtype)
        out[seg] = _gate_norm(mixer, y.reshape(count, d_inner), z[seg])
    if covered < out.shape[0]:  # a sequence-parallel step's padding rows: no request's state, zeros out
        out[covered:] = 0
    return out.unsqueeze(1)
