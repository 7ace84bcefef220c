"""MoE on one CUDA GPU in bf16 (skipped without a GPU): the grouped GEMM kernel against per-expert matmuls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.transformer.moe.grouped_linear import _use_grouped_mm, grouped_gemm
from megatron_core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
from tests.transformer.moe.moe_parallel_utils import batches, build

pytestmark = pytest.mark.gpu


def test_grouped_mm_matches_per_expert_matmuls_with_uneven_and_empty_groups():
    torch.manual_seed(0)
    counts = [37, 0, 128, 5, 200, 1, 0, 141]
    x = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(8, 512, 256, device="cuda", dtype=torch.bfloat16) / 16).requires_grad_()
    assert _use_grouped_mm(x, w)
    out = grouped_gemm(x, w, counts)
    grad = torch.randn_like(out)
    out.backward(grad)
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = torch.cat([F.linear(p, wr[e]) for e, p in enumerate(torch.split(xr, counts))])
    ref.backward(grad.float())
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad.float(), xr.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad.float(), wr.grad, rtol=2e-2, atol=5e-2)


def test_moe_gpt_bf16_step_on_gpu_matches_fp32_cpu():
    torch.manual_seed(0)
    cpu = build("mixtral", moe_grouped_gemm=True)
    gpu = build("mixtral", moe_grouped_gemm=True, bf16=True, params_dtype=torch.bfloat16).cuda()
    gpu.load_state_dict({k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                         for k, v in cpu.state_dict().items()}, strict=False)
    ids, pos, labels = batches(1)[0]
    want = cpu(ids, pos, None, labels=labels).mean()
    got = gpu(ids.cuda(), pos.cuda(), None, labels=labels.cuda()).mean()
    got.backward()
    torch.testing.assert_close(got.float().cpu(), want.detach(), rtol=3e-2, atol=3e-2)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gpu.parameters())


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_layer_runs_without_host_sync_when_one_rank_holds_every_expert(dispatcher):
    """EP=1, no capacity: the counts stay on the GPU, so forward and backward never wait for the host."""
    torch.manual_seed(0)
    destroy_moe_metrics_tracker()  # earlier tests may have left metrics on the CPU
    model = build("mixtral", moe_grouped_gemm=True, bf16=True, params_dtype=torch.bfloat16,
                  moe_token_dispatcher_type=dispatcher).cuda()
    moe = model.decoder.layers[0].mlp
    x = torch.randn(8, 2, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x)  # warm-up: lazy initialisation may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = moe(x)
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = build("mixtral", moe_grouped_gemm=True, moe_token_dispatcher_type=dispatcher)
    ref.load_state_dict({k: v.float().cpu() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                         for k, v in model.state_dict().items()})
    want, _ = ref.decoder.layers[0].mlp(x.detach().float().cpu())
    torch.testing.assert_close(out.float().cpu(), want.detach(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("num_tokens", [512, 4096])
def test_counting_permutation_compiles_on_cuda_with_the_routing_map_as_input(num_tokens: int):
    # Inductor (torch 2.11) failed to generate code when one graph summed the map over the tokens and scanned it.
    from megatron_core.transformer.moe.token_permutation import _counted_rows, permute

    torch.manual_seed(0)
    idx = torch.randn(num_tokens, 8, device="cuda").topk(2, dim=1).indices
    routing_map = torch.zeros(num_tokens, 8, dtype=torch.bool, device="cuda").scatter(1, idx, True)
    tokens = torch.randn(num_tokens, 64, device="cuda")
    for fn in (lambda m: _counted_rows(m, num_tokens * 2)[:2], lambda m: _counted_rows(m, num_tokens * 2, 16)[:2],
               lambda m: permute(tokens, m, num_out_tokens=num_tokens * 2)[::2]):
        torch._dynamo.reset()
        for got, want in zip(torch.compile(fn)(routing_map), fn(routing_map)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("overrides", [dict(moe_router_force_load_balancing=True), dict(moe_router_force_biased=-0.3),
                                       dict(fp8="e4m3", moe_router_padding_for_quantization=True)])
def test_routing_overrides_run_in_compiled_layers_on_cuda(overrides: dict):
    from megatron_core import tensor_parallel

    destroy_moe_metrics_tracker()
    losses = []
    for compiled in (False, True):
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        model = build("mixtral", moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall", **overrides).cuda()
        if compiled:
            for layer in model.decoder.layers:
                layer.compile()
        ids, pos, labels = (t.cuda() for t in batches(1)[0])
        loss = model(ids, pos, None, labels=labels).mean()
        loss.backward()
        router = [p.grad for n, p in model.named_parameters() if n.endswith("router.weight")]
        assert router and all(g is not None and g.abs().sum() > 0 for g in router)
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)


def test_moe_act_recompute_on_cuda_keeps_loss_and_gradients():
    # The grouped experts' fused weighted SwiGLU (a GPU kernel) under "moe_act" recompute.
    results = []
    for modules in (None, ["moe_act"]):
        torch.manual_seed(0)
        extra = {} if modules is None else dict(recompute_granularity="selective", recompute_modules=modules)
        model = build("mixtral", moe_grouped_gemm=True, bf16=True, params_dtype=torch.bfloat16, **extra).cuda()
        ids, pos, labels = (t.cuda() for t in batches(1)[0])
        loss = model(ids, pos, None, labels=labels).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (want_loss, want), (loss, grads) = results
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    for name, grad in want.items():  # the same kernels rerun; only scatter-add order may differ
        torch.testing.assert_close(grads[name], grad, rtol=1e-2, atol=1e-3, msg=lambda m, n=name: f"{n}: {m}")
