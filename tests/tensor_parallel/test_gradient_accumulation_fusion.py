"""``gradient_accumulation_fusion``: weight gradients (linear layers and the embedding lookup) go straight into DDP's
``main_grad`` buffers.

A tiny GPT wrapped in ``DistributedDataParallel`` accumulates two micro-batches with the fusion on and
off, on the same weights and data; every parameter's ``main_grad`` must agree (fp32 within 1e-5; bf16
params with fp32 gradient buffers within bf16 rounding), for TP=1 and TP=2 on 2 gloo ranks.
"""

from __future__ import annotations

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.transformer import Float16Module
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import batch, build, gpt2_like, llama_like


def _main_grads(tp: int, fusion: bool, bf16: bool, compiled: bool = False, spec=llama_like) -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    overrides = dict(gradient_accumulation_fusion=fusion, tensor_model_parallel_size=tp)
    if bf16:
        overrides.update(bf16=True, params_dtype=torch.bfloat16)
    model = build(spec(), **overrides)
    module = Float16Module(model.config, model) if bf16 else model
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module)
    if compiled:
        for layer in model.decoder.layers:
            layer.compile()
    ddp.zero_grad_buffer()
    for seed, sync in ((3, False), (4, True)):
        ids, pos, labels = batch(seed)
        if sync:
            ddp(ids, pos, None, labels=labels).float().mean().backward()
        else:
            with ddp.no_sync():
                ddp(ids, pos, None, labels=labels).float().mean().backward()
    ddp.finish_grad_sync()
    return {name: p.main_grad.detach().clone() for name, p in model.named_parameters()}


def _compare_fused_and_unfused() -> list[str]:
    checked = []
    for tp in (1, 2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            for bf16 in (False, True):
                fused, unfused = _main_grads(tp, True, bf16), _main_grads(tp, False, bf16)
                assert fused.keys() == unfused.keys()
                tol = dict(rtol=2e-2, atol=1e-3) if bf16 else dict(rtol=1e-5, atol=1e-6)
                for name in fused:
                    assert fused[name].dtype == torch.float32
                    assert fused[name].abs().sum() > 0, f"{name}: no gradient reached main_grad"
                    torch.testing.assert_close(fused[name], unfused[name], **tol, msg=lambda m, n=name: f"{n}: {m}")
                checked.append(f"tp{tp}-{'bf16' if bf16 else 'fp32'}")
        finally:
            parallel_state.destroy_model_parallel()
    return checked


def test_fused_weight_gradients_equal_the_unfused_ones() -> None:
    results = run_on_ranks(2, _compare_fused_and_unfused)
    assert results == [["tp1-fp32", "tp1-bf16", "tp2-fp32", "tp2-bf16"]] * 2


def _compare_tied(tp: int) -> bool:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        fused, unfused = _main_grads(tp, True, False, spec=gpt2_like), _main_grads(tp, False, False, spec=gpt2_like)
        for name in fused:
            assert fused[name].abs().sum() > 0, f"{name}: no gradient reached main_grad"
            torch.testing.assert_close(fused[name], unfused[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")
        return True
    finally:
        parallel_state.destroy_model_parallel()


def test_fused_gradients_of_a_tied_embedding_equal_the_unfused_ones() -> None:
    # The shared weight gets the lookup's gradient (accumulated by the embedding) and the output layer's (the
    # fused GEMM) in the same main_grad.
    for tp in (1, 2):
        assert run_on_ranks(2, _compare_tied, tp) == [True, True]


def _compiled_fused_against_eager_unfused() -> dict[str, int]:
    from torch._dynamo.utils import counters

    parallel_state.initialize_model_parallel()
    try:
        # fp32 only: the op's bf16 arithmetic is the eager one (checked above at TP=1 and 2); compiling is about
        # the graph (no break) and the main_grad it writes into, the same in both precisions.
        torch._dynamo.reset()
        counters.clear()
        fused = _main_grads(1, fusion=True, bf16=False, compiled=True)
        breaks = sum(counters["graph_break"].values())
        assert breaks == 0, dict(counters["graph_break"])  # the fused wgrad stays inside the compiled layer
        unfused = _main_grads(1, fusion=False, bf16=False)
        for name in fused:
            assert fused[name].abs().sum() > 0, f"{name}: no gradient reached main_grad"
            torch.testing.assert_close(fused[name], unfused[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")
        return {"checked": len(fused)}
    finally:
        parallel_state.destroy_model_parallel()


def test_fused_weight_gradients_inside_compiled_layers() -> None:
    """Compiled layers keep the fused wgrad in their graph (custom op, no graph break) and get the same main_grad."""
    (result,) = run_on_ranks(1, _compiled_fused_against_eager_unfused)
    assert result["checked"] >= 10  # every fused weight of the 2-layer model, the embedding and output layer


def _norm_parameters_add_their_own_gradients(spec_name: str) -> list[str]:
    spec = {"llama_like": llama_like, "gpt2_like": gpt2_like}[spec_name]
    parallel_state.initialize_model_parallel()
    try:
        torch.manual_seed(1234)
        model = build(spec(), gradient_accumulation_fusion=True)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        ddp.zero_grad_buffer()
        ids, pos, labels = batch(3)
        ddp(ids, pos, None, labels=labels).float().mean().backward()
        norms = [(n, p) for n, p in model.named_parameters() if "layernorm" in n]
        assert norms, "the spec has no norm parameters"
        for name, param in norms:
            # The norm's backward wrote main_grad and set Megatron's flag; DDP's hook added nothing more.
            assert param.grad_added_to_main_grad, f"{name}: the gradient went through DDP's hook"
            assert param.grad is None and param.main_grad.abs().sum() > 0, name
        return sorted({n.rsplit(".", 1)[-1] for n, _ in norms})
    finally:
        parallel_state.destroy_model_parallel()


def test_norm_parameters_add_their_own_gradients_to_main_grad() -> None:
    """RMSNorm's weight and LayerNorm's weight and bias skip DDP's hook (values: the fused/unfused tests above)."""
    assert run_on_ranks(1, _norm_parameters_add_their_own_gradients, "llama_like") == [["weight"]]
    assert run_on_ranks(1, _norm_parameters_add_their_own_gradients, "gpt2_like") == [["bias", "weight"]]
