"""``AudioProjection`` at TP=2 (gloo, CPU): on the single-process weights split across the ranks, the stacked
projection's output, mask and (gathered) gradients equal the single-process ones (fp32, 1e-5)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import parallel_state, tensor_parallel
from megatron_core.models.audio import AudioProjection
from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.mlp import MLPSubmodules
from tests.dist_harness import run_on_ranks

TP, AUDIO, HIDDEN, FFN, STACK = 2, 6, 8, 12, 2
SPLIT = {"projector.encoder.linear_fc1.weight": 0, "projector.encoder.linear_fc1.bias": 0,
         "projector.encoder.linear_fc2.weight": 1, "projector.encoder.weight": 0, "projector.encoder.bias": 0}


def _build(projector_type: str, tp: int) -> AudioProjection:
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=2,
                               add_bias_linear=True, activation_func=F.gelu, bias_activation_fusion=False,
                               use_cpu_initialization=True, tensor_model_parallel_size=tp)
    return AudioProjection(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                           projector_type, AUDIO, stack_factor=STACK)


def _run(module: AudioProjection):
    x = torch.randn(2, 7, AUDIO, generator=torch.Generator().manual_seed(3))
    mask = torch.arange(7)[None, :] < torch.tensor([7, 3])[:, None]
    out, out_mask = module(x, mask)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(4))).sum().backward()
    return out.detach(), out_mask, {k: p.grad.detach().clone() for k, p in module.named_parameters()}


def _check() -> list[str]:
    checked = []
    references = {}
    for kind in ("mlp", "affine"):
        torch.manual_seed(0)
        module = _build(kind, 1)
        with torch.no_grad():
            for param in module.parameters():
                param.normal_()
        references[kind] = ({k: v.detach().clone() for k, v in module.named_parameters()}, *_run(module))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        rank = parallel_state.get_tensor_model_parallel_rank()
        group = parallel_state.get_tensor_model_parallel_group()
        for kind, (state, ref_out, ref_mask, ref_grads) in references.items():
            module = _build(kind, TP)
            with torch.no_grad():
                for name, param in module.named_parameters():
                    dim = SPLIT.get(name)
                    param.copy_(state[name] if dim is None else state[name].chunk(TP, dim=dim)[rank])
            out, out_mask, grads = _run(module)
            torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
            assert torch.equal(out_mask, ref_mask)
            for name, grad in grads.items():
                dim = SPLIT.get(name)
                if dim is not None:
                    pieces = [torch.empty_like(grad) for _ in range(TP)]
                    dist.all_gather(pieces, grad.contiguous(), group=group)
                    grad = torch.cat(pieces, dim=dim)
                torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-5)
            checked.append(kind)
    finally:
        parallel_state.destroy_model_parallel()
    return checked


def test_tp2_matches_single_process():
    assert run_on_ranks(TP, _check) == [["mlp", "affine"]] * TP
