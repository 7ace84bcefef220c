"""FP8 parameters (``fp8_param``, tensorwise) under TP=2 with sequence parallelism, against one process (CPU, the
float8 GEMMs emulated in fp32).

Each TP rank's FP8 weight has the per-tensor scale of its own shard (as Transformer Engine's FP8 weights and the
distributed optimizer's ``quantize_param_shard``, which agrees scales over data-parallel ranks only), so one
process on the whole weight quantizes with another scale unless every shard holds the whole weight's amax. The
weights here are made so (each shard's largest magnitude raised to the whole tensor's): then both quantize every
weight to the same codes with the same scale, the inputs' and output gradients' amaxes are max-reduced over the
TP group (``convert_to_float8(amax_reduction_group=)``; by default each rank keeps its own, as torchao's
tensorwise recipe), and what remains is fp32 summation order and, rarely, a value on an FP8
rounding boundary. Loss, logits and every gradient (``main_grad`` of the FP8 weights, among them the MLP's
``linear_fc1`` whose backward quantizes SwiGLU's gradient itself) equal one process within 1e-5 relative to the
tensor's largest value (measured: at most 2.7e-7).
"""

from __future__ import annotations

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed.fp8_params import is_fp8_param
from megatron_core.fp8 import convert_to_float8
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import VOCAB, batch, build, llama_like, shard, unshard

SPEC = llama_like(fp8="hybrid", fp8_recipe="tensorwise")
TP = 2
TOL = 1e-5


def _with_shard_amax_of_the_whole(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each FP8-converted weight changed so that every TP shard's largest magnitude is the whole
    weight's (the first element of a shard below it is set to it)."""
    out = dict(state)
    for name, full in state.items():
        if not name.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")):
            continue
        amax = full.abs().max()
        pieces = [shard(name, full, TP, rank, True).clone() for rank in range(TP)]
        for piece in pieces:
            if piece.abs().max() < amax:
                piece.view(-1)[0] = amax
        out[name] = unshard(name, pieces, True)
        assert all(shard(name, out[name], TP, r, True).abs().max() == amax for r in range(TP)), name
    return out


def _prepare(model, amax_group=None) -> None:
    """Convert to float8 (emulated; amaxes max-reduced over ``amax_group``) and give each FP8 weight the
    ``main_grad`` its backward adds into."""
    convert_to_float8(model, emulate=True, amax_reduction_group=amax_group)
    for param in model.parameters():
        if is_fp8_param(param):
            param.main_grad = torch.zeros(param.shape, dtype=torch.float32)


def _loss_logits_grads(model, tp_group=None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    ids, pos, labels = batch()
    with torch.no_grad():
        logits = model(ids, pos, None)
    if tp_group is not None:
        pieces = [torch.empty_like(logits) for _ in range(TP)]
        torch.distributed.all_gather(pieces, logits.contiguous(), group=tp_group)
        logits = torch.cat(pieces, dim=-1)
    loss = model(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    grads = {name: (p.main_grad if is_fp8_param(p) else p.grad).detach().clone() for name, p in
             model.named_parameters()}
    return loss.detach(), logits, grads


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _tp2_sp_against_one_process() -> tuple[int, dict[str, float]]:
    torch.manual_seed(0)
    ref = build(SPEC, fp8_param=True)
    state = _with_shard_amax_of_the_whole({k: v.detach().clone() for k, v in ref.named_parameters()})
    with torch.no_grad():
        for name, param in ref.named_parameters():
            param.copy_(state[name])
    _prepare(ref)
    ref_loss, ref_logits, ref_grads = _loss_logits_grads(ref)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        group = parallel_state.get_tensor_model_parallel_group()
        rank = parallel_state.get_tensor_model_parallel_rank()
        model = build(SPEC, fp8_param=True, tensor_model_parallel_size=TP, sequence_parallel=True)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard(name, state[name], TP, rank, True))
        _prepare(model, group)
        fused = sum(layer.mlp._swiglu_in_fc1() for layer in model.decoder.layers)
        fp8_weights = 0
        for name, param in model.named_parameters():
            if is_fp8_param(param):
                fp8_weights += 1
                want = shard(name, dict(ref.named_parameters())[name].view(torch.uint8), TP, rank, True)
                assert torch.equal(param.view(torch.uint8), want), f"{name}: other FP8 codes than one process's"
                assert torch.equal(param.fp8_scale, dict(ref.named_parameters())[name].fp8_scale), name
        loss, logits, grads = _loss_logits_grads(model, group)
        assert logits.shape[-1] == VOCAB
        errors = {"loss": _relative_error(loss, ref_loss), "logits": _relative_error(logits, ref_logits)}
        for name, grad in grads.items():
            if getattr(model.get_parameter(name), "sequence_parallel", False):
                torch.distributed.all_reduce(grad, group=group)  # what DDP does for SP-replicated weights
            errors[name] = _relative_error(grad, shard(name, ref_grads[name], TP, rank, True))
        assert fp8_weights == 4 * len(model.decoder.layers), fp8_weights
        return fused, errors
    finally:
        parallel_state.destroy_model_parallel()


def test_fp8_param_tp2_sp_equals_one_process():
    results = run_on_ranks(TP, _tp2_sp_against_one_process, timeout=240)
    layers = SPEC["config"]["num_layers"]
    assert all(fused == layers for fused, _ in results), results  # every MLP quantized SwiGLU's gradient itself
    for rank, (_, errors) in enumerate(results):
        off = {what: f"{err:.2e}" for what, err in errors.items() if not err < TOL}
        assert not off, f"rank {rank}: relative errors >= {TOL}: {off}"
