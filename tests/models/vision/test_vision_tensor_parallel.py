"""``CLIPViTModel`` and ``MultimodalProjector`` at TP=2 equal one process on the same weights (fp32, gloo).

Each rank loads its shard of the TP=1 weights (column-parallel rows, row-parallel columns, the rest
replicated); the outputs and every gradient, gathered back to the TP=1 layout, must match.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from tests.dist_harness import run_on_ranks
from tests.models.vision.test_clip_vit_model import _config, _images, _model, _randomize
from tests.models.vision.test_multimodal_projector import VISION, _projector

TP = 2
COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias", "encoder.weight",
          "encoder.bias")
ROW = ("linear_proj.weight", "linear_fc2.weight")
TOL = dict(rtol=1e-5, atol=1e-5)


def _split_dim(name: str) -> int | None:
    return 0 if name.endswith(COLUMN) else 1 if name.endswith(ROW) else None


def _builders() -> dict:
    """Each case: a function of the TP size that builds the module, and its input."""
    return {
        "clip_vit": (lambda tp: _model(_config(tensor_model_parallel_size=tp), class_token_len=2), _images()),
        "projector_mlp": (lambda tp: _projector("mlp", tensor_model_parallel_size=tp),
                          torch.randn(6, 2, VISION, generator=torch.Generator().manual_seed(7))),
        "projector_affine": (lambda tp: _projector("affine", tensor_model_parallel_size=tp),
                             torch.randn(6, 2, VISION, generator=torch.Generator().manual_seed(8))),
    }


def _run(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    out = module(x)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * weights).sum().backward()
    return out.detach(), {k: v.grad.detach().clone() for k, v in module.named_parameters()}


def _check_tp() -> list[str]:
    references = {}
    for case, (build, x) in _builders().items():
        module = build(1)
        _randomize(module, seed=10)
        references[case] = ({k: v.detach().clone() for k, v in module.named_parameters()}, *_run(module, x))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    checked = []
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        rank = parallel_state.get_tensor_model_parallel_rank()
        group = parallel_state.get_tensor_model_parallel_group()
        for case, (build, x) in _builders().items():
            ref_state, ref_out, ref_grads = references[case]
            module = build(TP)
            with torch.no_grad():
                for name, param in module.named_parameters():
                    dim = _split_dim(name)
                    full = ref_state[name]
                    param.copy_(full if dim is None else full.chunk(TP, dim=dim)[rank])
            out, grads = _run(module, x)
            torch.testing.assert_close(out, ref_out, **TOL)
            for name, grad in grads.items():
                dim = _split_dim(name)
                if dim is not None:
                    pieces = [torch.empty_like(grad) for _ in range(TP)]
                    dist.all_gather(pieces, grad.contiguous(), group=group)
                    grad = torch.cat(pieces, dim=dim)
                # Gradients summed over every token and layer (class token, conv) are large: the absolute
                # tolerance is 1e-5 of the largest entry.
                ref = ref_grads[name]
                torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()),
                                           msg=lambda m, n=name, c=case: f"{c} {n}: {m}")
            checked.append(case)
    finally:
        parallel_state.destroy_model_parallel()
    return checked


def test_tp2_matches_single_process():
    results = run_on_ranks(TP, _check_tp)
    assert results == [["clip_vit", "projector_mlp", "projector_affine"]] * TP
