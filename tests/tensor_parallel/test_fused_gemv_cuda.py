"""The single-row GEMV kernel (tensor_parallel/fused_gemv.py) against the unfused chain, and its use in a decode layer (GPU)."""

from __future__ import annotations

import pytest
import torch

from megatron_core.tensor_parallel.fused_gemv import fused_gemv, fused_gemv_reference, fused_gemv_supported

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")


def _close_to_truth(out: torch.Tensor, args: dict, **kwargs) -> None:
    """``out`` (bf16) is as close to the fp32 result as the unfused bf16 chain is, up to one bf16 rounding more."""
    truth = fused_gemv_reference(**{k: v.float() if torch.is_tensor(v) else v for k, v in args.items()}, **kwargs)
    unfused = fused_gemv_reference(**args, **kwargs).float()
    scale = truth.abs().max().item()
    err, err_unfused = (out.float() - truth).abs().max().item(), (unfused - truth).abs().max().item()
    assert err <= 2 * err_unfused + 2 ** -8 * scale, (err, err_unfused, scale)


@pytest.mark.parametrize("n,k", [(256, 2048), (94, 1000), (2560, 5632)])
@pytest.mark.parametrize("variant", ["plain", "bias", "norm", "gated", "residual", "all"])
def test_kernel_matches_reference(n, k, variant):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    dev, dtype = "cuda", torch.bfloat16
    gated = variant in ("gated", "all")
    out_n = n // 2 if gated else n
    args = dict(x=torch.randn(1, 1, k, device=dev, dtype=dtype, generator=gen),
                weight=torch.randn(n, k, device=dev, dtype=dtype, generator=gen) * k ** -0.5)
    kwargs = {"gated_silu": gated}
    if variant in ("bias", "all"):
        args["bias"] = torch.randn(n, device=dev, dtype=dtype, generator=gen)
    if variant in ("norm", "all"):
        args["norm_weight"] = 1 + 0.1 * torch.randn(k, device=dev, dtype=dtype, generator=gen)
        kwargs["norm_eps"] = 1e-5
    if variant in ("residual", "all"):
        args["residual"] = torch.randn(1, 1, out_n, device=dev, dtype=dtype, generator=gen)
    assert fused_gemv_supported(args["x"], args["weight"])
    out = fused_gemv(**args, **kwargs)
    assert out.shape == (1, 1, out_n) and out.dtype == dtype
    _close_to_truth(out, args, **kwargs)


def test_compiled_custom_op_and_linear_route():
    """Under torch.compile the kernel is an opaque op; the parallel linear's op routes one row without grad to it."""
    from megatron_core.tensor_parallel.linear_function import (
        linear_with_grad_accumulation_and_async_allreduce,
    )

    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    compiled = torch.compile(lambda a, b: fused_gemv(a, b), fullgraph=True)
    torch.testing.assert_close(compiled(x, w), fused_gemv(x, w), rtol=0, atol=0)
    with torch.no_grad():
        routed = linear_with_grad_accumulation_and_async_allreduce(x, w, None, False, False, False)
    torch.testing.assert_close(routed, fused_gemv(x, w), rtol=0, atol=0)
    w.requires_grad_(True)
    assert not fused_gemv_supported(x, w)  # with grad, cuBLAS as before
    assert fused_gemv_supported(x, w.detach()) and not fused_gemv_supported(torch.randn(2, 4096, device="cuda",
                                                                                        dtype=torch.bfloat16), w.detach())


def test_fused_decode_layer_bf16_matches_normal_forward(monkeypatch):
    from megatron_core.transformer import fused_decode
    from tests.inference.test_fused_decode import SingleTokenContext, _layer

    calls = []
    real = fused_decode.fused_decode_forward
    monkeypatch.setattr(fused_decode, "fused_decode_forward", lambda *a: calls.append(1) or real(*a))
    layer = _layer(hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_query_groups=2,
                   add_bias_linear=True).cuda().to(torch.bfloat16)
    hidden = torch.randn(1, 1, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fused, _ = layer(hidden, inference_context=SingleTokenContext())
        monkeypatch.setattr(fused_decode, "enabled", False)
        normal, _ = layer(hidden, inference_context=SingleTokenContext())
        truth, _ = layer.float()(hidden.float(), inference_context=SingleTokenContext())
    assert calls == [1]
    err, err_normal = (fused.float() - truth).abs().max().item(), (normal.float() - truth).abs().max().item()
    assert err <= 2 * err_normal + 1e-2, (err, err_normal)
