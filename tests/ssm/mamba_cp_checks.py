"""Rank-side checks of Mamba context and sequence parallelism (module level so the rank pool can import them).

:func:`check_hybrid_parallel` loads the weights of a single-process hybrid model (``M*M-``: Mamba, attention,
Mamba, MLP) into a TP x CP model, feeds this rank's load-balanced part of the batch and compares logits,
per-token losses and every gradient with the single-process run. Gradients are reduced as the DDP and
``finalize_model_grads`` would: summed over the CP group, sequence-parallel (norm) gradients summed over the
TP group; TP shards are reassembled from each parameter's ``partition_dim`` / ``partition_sizes``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron_core.ssm.mamba_context_parallel import (
    MambaContextParallel,
    _all_to_all_cp2hp,
    _all_to_all_hp2cp,
    _redo_attention_load_balancing,
    _undo_attention_load_balancing,
)
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.context_parallel_batch import get_batch_on_this_cp_rank

PATTERN = "M*M-"
VOCAB, S, B = 64, 16, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def zigzag(cp: int, rank: int, s: int = S) -> list[int]:
    """The global positions CP rank ``rank`` holds (chunks ``rank`` and ``2cp-1-rank`` of ``2cp``)."""
    c = s // (2 * cp)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))


def hybrid_config(**overrides) -> TransformerConfig:
    """Hidden 32, 4 attention heads, 8 Mamba heads of 8 in 2 groups (state 8), fp32, no dropout."""
    cfg = dict(num_layers=len(PATTERN), hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
               normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
               use_cpu_initialization=True, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2,
               layernorm_epsilon=1e-5)
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def build(**overrides) -> HybridModel:
    """The test's hybrid model (rotary positions, so the attention layers see CP-sliced rotations)."""
    return HybridModel(hybrid_config(**overrides), hybrid_stack_spec, VOCAB, S, hybrid_layer_pattern=PATTERN,
                       position_embedding_type="rope")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (B, S), generator=gen), torch.randint(0, VOCAB, (B, S), generator=gen)


def _reference() -> tuple[dict, torch.Tensor, torch.Tensor, dict]:
    """Weights, logits ``[b, s, V]``, per-token loss ``[b, s]`` and gradients of the single-process model."""
    torch.manual_seed(1234)
    model = build()
    ids, labels = _data()
    positions = torch.arange(S).expand(B, S)
    logits = model(ids, positions, None).detach()
    loss = model(ids, positions, None, labels=labels)
    loss.sum().backward()
    return ({k: v.detach().clone() for k, v in model.named_parameters()}, logits, loss.detach(),
            {k: v.grad.detach().clone() for k, v in model.named_parameters()})


def _tp_sections(param: torch.nn.Parameter, tp: int, full_dim: int) -> list[int]:
    """Full sizes of the separately sharded blocks along the TP dim (one block unless ``partition_sizes``)."""
    local = getattr(param, "partition_sizes", None)
    return [size * tp for size in local] if local is not None else [full_dim]


def shard(param: torch.nn.Parameter, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's piece of the single-process tensor ``full``: its chunk of each block along the TP dim."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = param.partition_dim
    blocks = full.split(_tp_sections(param, tp, full.shape[dim]), dim=dim)
    return torch.cat([block.chunk(tp, dim=dim)[rank] for block in blocks], dim=dim)


def unshard(param: torch.nn.Parameter, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The single-process layout of the per-TP-rank ``pieces`` of ``param`` (replicated: the first piece)."""
    tp = len(pieces)
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return pieces[0]
    dim = param.partition_dim
    local = getattr(param, "partition_sizes", None) or [pieces[0].shape[dim]]
    per_rank = [piece.split(local, dim=dim) for piece in pieces]
    return torch.cat([torch.cat([blocks[i] for blocks in per_rank], dim=dim) for i in range(len(local))], dim=dim)


def _gather_tp(tensor: torch.Tensor, tp: int) -> list[torch.Tensor]:
    pieces = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(pieces, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return pieces


def _full_grads(model: torch.nn.Module, tp: int) -> dict:
    """Gradients as the DDP leaves them (summed over CP; sequence-parallel ones also over TP), TP reassembled."""
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        out[name] = unshard(param, _gather_tp(grad, tp))
    return out


def compare_with_reference(build_fn: Callable[..., torch.nn.Module], data: tuple[torch.Tensor, torch.Tensor],
                           reference: tuple[dict, torch.Tensor, torch.Tensor, dict], tp: int, cp: int,
                           sp: bool) -> tuple[torch.nn.Module, dict]:
    """Build the TP x CP (x SP) model (model parallel already set up), load the single-process weights, and check
    logits, per-token loss and every gradient against ``reference`` (``_reference()``'s tuple) on ``data``
    (ids, labels ``[B, S]``); returns the model and its reassembled gradients."""
    state, ref_logits, ref_loss, ref_grads = reference
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = build_fn(tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard(param, state[name], tp, tp_rank))
    ids, labels = data
    batch_size, seq = ids.shape
    batch = get_batch_on_this_cp_rank({"tokens": ids, "labels": labels,
                                       "position_ids": torch.arange(seq).expand(batch_size, seq).contiguous()})
    here = zigzag(cp, parallel_state.get_context_parallel_rank())
    logits = model(batch["tokens"], batch["position_ids"], None).detach()
    torch.testing.assert_close(torch.cat(_gather_tp(logits, tp), dim=-1), ref_logits[:, here], **TOL)
    loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    torch.testing.assert_close(loss, ref_loss[:, here], **TOL)
    loss.sum().backward()
    grads = _full_grads(model, tp)
    if set(grads) != set(ref_grads):
        raise AssertionError(f"parameter names differ: {sorted(set(grads) ^ set(ref_grads))}")
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return model, grads


def check_hybrid_parallel(tp: int, cp: int, sp: bool) -> dict:
    """TP x CP (x SP) hybrid model == the single-process one: logits, per-token loss, every gradient."""
    reference = _reference()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    try:
        model, grads = compare_with_reference(build, _data(), reference, tp, cp, sp)
        mixers = [layer.mixer for layer in model.decoder.layers if hasattr(layer, "mixer")]
        return {"grads": len(grads), "mamba_layers": len(mixers), "heads_here": mixers[0].cp.nheads_local_tpcp,
                "group_repeat": mixers[0].cp.group_repeat_count}
    finally:
        parallel_state.destroy_model_parallel()


def _global(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check_all_to_all(cp: int) -> int:
    """The CP all-to-alls and the load-balancing reorder against the global tensor, and their round trip
    (values and gradient)."""
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    try:
        group = parallel_state.get_context_parallel_group()
        rank = parallel_state.get_context_parallel_rank()
        hidden = 3 * cp
        full = _global((4 * cp, 2, hidden), seed=7)  # [l, b, h], natural order
        local = full[zigzag(cp, rank, full.shape[0])].clone().requires_grad_(True)
        heads_side = _undo_attention_load_balancing(_all_to_all_cp2hp(local, group), cp)
        width = hidden // cp
        torch.testing.assert_close(heads_side, full[..., rank * width:(rank + 1) * width], rtol=0, atol=0)
        back = _all_to_all_hp2cp(_redo_attention_load_balancing(heads_side, cp), group)
        torch.testing.assert_close(back, local.detach(), rtol=0, atol=0)
        upstream = _global(tuple(back.shape), seed=11 + rank)
        back.backward(upstream)
        torch.testing.assert_close(local.grad, upstream, rtol=0, atol=0)
        return rank
    finally:
        parallel_state.destroy_model_parallel()


def check_pre_conv_ssm(cp: int, ngroups: int) -> dict:
    """``pre_conv_ssm`` gives this CP rank the full sequence of its heads' ``z, x, dt`` and its groups' ``B, C``;
    the parameter getters cut the matching slices."""
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    try:
        rank = parallel_state.get_context_parallel_rank()
        nheads, headdim, d_state, d_conv = 4 * cp, 2, 3, 4
        d_inner = nheads * headdim
        bc = ngroups * d_state
        conv_weight = _global((d_inner + 2 * bc, 1, d_conv), seed=1)
        conv_bias, per_head = _global((d_inner + 2 * bc,), seed=2), _global((nheads,), seed=3)
        mcp = MambaContextParallel(parallel_state.get_context_parallel_group(), d_inner, nheads, ngroups, d_state,
                                   conv_weight, conv_bias, d_conv - 1, per_head, per_head + 1, per_head + 2, False)
        full = _global((4 * cp, 2, 2 * d_inner + 2 * bc + nheads), seed=4)
        got = mcp.pre_conv_ssm(full[zigzag(cp, rank, full.shape[0])])
        z, x, B, C, dt = full.split([d_inner, d_inner, bc, bc, nheads], dim=-1)
        heads = slice(rank * nheads // cp, (rank + 1) * nheads // cp)
        channels = slice(heads.start * headdim, heads.stop * headdim)
        group = heads.start // (nheads // ngroups)
        groups = slice(group * d_state, (group + mcp.ngroups_local_tpcp) * d_state)
        want = torch.cat([z[..., channels], x[..., channels], B[..., groups], C[..., groups], dt[..., heads]], -1)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        weight_rows = torch.cat([torch.arange(d_inner)[channels], d_inner + torch.arange(bc)[groups],
                                 d_inner + bc + torch.arange(bc)[groups]])
        torch.testing.assert_close(mcp.get_conv1d_weight(), conv_weight[weight_rows], rtol=0, atol=0)
        torch.testing.assert_close(mcp.get_conv1d_bias(), conv_bias[weight_rows], rtol=0, atol=0)
        for getter, offset in ((mcp.get_dt_bias, 0), (mcp.get_A_log, 1), (mcp.get_D, 2)):
            torch.testing.assert_close(getter(), per_head[heads] + offset, rtol=0, atol=0)
        signal = _global((2, mcp.conv1d_channels(), 6), seed=5)
        conv = torch.nn.functional.conv1d(signal, conv_weight[weight_rows], conv_bias[weight_rows],
                                          padding=d_conv - 1, groups=len(weight_rows))
        torch.testing.assert_close(mcp.conv1d(signal), conv, rtol=0, atol=0)
        return {"rank": rank, "group_repeat": mcp.group_repeat_count}
    finally:
        parallel_state.destroy_model_parallel()


def _error(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"{fn} did not raise ValueError")


def check_bad_configs(cp: int) -> list[str]:
    """Head, group and sequence-length splits the CP group cannot take, and a config CP size without a group."""
    messages = [_error(lambda: build(context_parallel_size=2))]
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    try:
        heads = dict(mamba_head_dim=8, context_parallel_size=cp)
        # Heads not divisible by CP; groups >= CP but not divisible; (cp=4) fewer groups than CP, not dividing it.
        messages.append(_error(lambda: build(mamba_num_heads=cp + 1, mamba_num_groups=1, **heads)))
        messages.append(_error(lambda: build(mamba_num_heads=(cp + 1) * cp, mamba_num_groups=cp + 1, **heads)))
        if cp == 4:
            messages.append(_error(lambda: build(mamba_num_heads=12, mamba_num_groups=3, **heads)))
        model = build(context_parallel_size=cp)
        odd = torch.zeros(B, 3, dtype=torch.long)
        messages.append(_error(lambda: model(odd, torch.arange(3).expand(B, 3), None)))
    finally:
        parallel_state.destroy_model_parallel()
    return messages
