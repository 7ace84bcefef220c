"""FP8 delayed scaling (``fp8_recipe='delayed'``) on one process: the scale sequence, numerics, checkpoints, config.

The scaling rule is checked on one converted layer driven with tensors of chosen amaxes (powers of two, so
every scale is exact) against scales worked out by hand from Transformer Engine's rule
``scale = (fp8_max / amax) / 2**margin`` over a history of 4 steps; each step's output and input
gradient are checked against the quantize-dequantize product with the scale the step must use. The
model runs on CPU through the fp32 emulation of the float8 rounding. The ``torch._scaled_mm`` path is
checked against that emulation with PyTorch's CPU ``_scaled_mm`` (same code: operand layouts, inverse
scales, padded weight gradient; 1e-5) and by the ``gpu`` tests on Hopper's kernels (1e-2, bf16).
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.fp8 import DelayedFloat8Matmul, check_fp8_config, convert_to_float8
from megatron_core.fp8.delayed_scaling import GRAD_OUTPUT, INPUT, WEIGHT
from megatron_core.transformer import TransformerConfig
from tests.models.gpt_test_utils import batch, build, llama_like

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# Step t's input amax X[t] and output-gradient amax G[t]; the weight's amax is 0.5 throughout.
X = [2.0, 8.0, 1.0, 4.0, 0.5, 0.25, 2.0]
G = [4.0, 0.125, 0.5, 1.0, 2.0, 0.0, 1.0]
# Scales used at steps 0..6 and after step 6, by hand: history_len=4, margin=1, e4m3 max 448, e5m2 max 57344;
# 'max' takes the largest of the last 4 amaxes, 'most_recent' the last one; an amax of 0 keeps the scale.
HAND = {
    "max": dict(x=[1, 112, 28, 28, 28, 28, 56, 56], g=[1, 7168, 7168, 7168, 7168, 14336, 14336, 14336]),
    "most_recent": dict(x=[1, 112, 28, 224, 56, 448, 896, 112],
                        g=[1, 7168, 229376, 57344, 28672, 14336, 14336, 28672]),
}
WEIGHT_SCALES = [1] + [448] * 7


def _delayed(**overrides) -> dict:
    return llama_like(**{"fp8": "e4m3", "fp8_recipe": "delayed", **overrides})


def _with_amax(shape: tuple[int, ...], amax: float, seed: int) -> torch.Tensor:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return t / t.abs().max() * amax


def _qdq(t: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (t * scale).clamp(-limit, limit).to(dtype).float() / scale


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_scale_follows_the_amax_history(algo):
    torch.manual_seed(0)
    model = build(_delayed(fp8="hybrid", fp8_amax_history_len=4, fp8_margin=1, fp8_amax_compute_algo=algo))
    convert_to_float8(model, emulate=True)
    layer = model.decoder.layers[0].mlp.linear_fc1
    with torch.no_grad():
        layer.weight.copy_(_with_amax(tuple(layer.weight.shape), 0.5, seed=1))
    hand = HAND[algo]
    for step, (x_amax, g_amax) in enumerate(zip(X, G)):
        assert layer.fp8_scale.tolist() == [hand["x"][step], WEIGHT_SCALES[step], hand["g"][step]], step
        x = _with_amax((8, 2, 32), x_amax, seed=10 + step).requires_grad_()
        grad = _with_amax((8, 2, layer.weight.shape[0]), g_amax, seed=20 + step)
        out, _ = layer(x)
        w_q = _qdq(layer.weight.detach(), WEIGHT_SCALES[step], E4M3)
        torch.testing.assert_close(out, _qdq(x.detach(), hand["x"][step], E4M3) @ w_q.t(), rtol=1e-6, atol=0)
        out.backward(grad)
        torch.testing.assert_close(x.grad, _qdq(grad, hand["g"][step], E5M2) @ w_q, rtol=1e-6, atol=1e-12)
    assert layer.fp8_scale.tolist() == [hand["x"][-1], WEIGHT_SCALES[-1], hand["g"][-1]]
    # The ring holds the last 4 amaxes, slot 0 empty for the next one.
    history = layer.fp8_amax_history
    assert history[0].tolist() == [0, 0, 0]
    assert sorted(history[1:, INPUT].tolist()) == sorted(X[-3:])
    assert sorted(history[1:, GRAD_OUTPUT].tolist()) == sorted(G[-3:])
    assert history[1:, WEIGHT].tolist() == [0.5] * 3


def test_eval_forward_uses_but_does_not_move_the_scales():
    model = build(_delayed(fp8_amax_history_len=2))
    convert_to_float8(model, emulate=True)
    ids, pos, _ = batch()
    model(ids, pos, None).sum().backward()
    layer = model.decoder.layers[1].self_attention.linear_proj
    state = {k: v.clone() for k, v in layer.get_extra_state().items() if isinstance(v, torch.Tensor)}
    model.eval()
    with torch.no_grad():
        model(*batch(5)[:2], None)
    assert torch.equal(layer.fp8_amax_history.cpu(), state["amax_history"])
    assert torch.equal(layer.fp8_scale.cpu(), state["scale"])


def _two_steps(model) -> tuple[torch.Tensor, dict]:
    """Loss and gradients of the second step on one batch (step one fills the histories; no update in between)."""
    ids, pos, labels = batch()
    for _ in range(2):
        model.zero_grad()
        loss = model(ids, pos, None, labels=labels).float().mean()
        loss.backward()
    return loss.detach(), {k: v.grad.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_emulated_delayed_fp8_is_close_to_fp32(fmt):
    torch.manual_seed(0)
    model = build(_delayed(fp8=fmt, fp8_amax_history_len=16, fp8_amax_compute_algo="max"))
    reference = build(llama_like())
    reference.load_state_dict(model.state_dict())
    names = convert_to_float8(model, emulate=True)
    assert len(names) == 8 and type(model.output_layer).__name__ == "ColumnParallelLinear"
    loss, grads = _two_steps(model)
    ref_loss, ref_grads = _two_steps(reference)
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    key = "decoder.layers.0.mlp.linear_fc1.weight"
    assert not torch.equal(grads[key], ref_grads[key])  # really float8-rounded
    for name, value in grads.items():
        err = (value - ref_grads[name]).abs().max() / ref_grads[name].abs().max()
        assert err < 0.25, f"{name}: relative error {err:.3f}"


def test_fp8_wgrad_false_keeps_the_weight_gradient_in_high_precision():
    torch.manual_seed(0)
    model = build(_delayed(fp8_wgrad=False))
    layer_input = {}
    convert_to_float8(model, emulate=True)
    fc2 = model.decoder.layers[0].mlp.linear_fc2

    def capture(mod, args, out):
        layer_input.update(x=args[0].detach())
        out[0].register_hook(lambda grad: layer_input.update(dy=grad.detach()))

    fc2.register_forward_hook(capture)
    ids, pos, labels = batch()
    model(ids, pos, None, labels=labels).float().mean().backward()
    x, dy = layer_input["x"].reshape(-1, fc2.weight.shape[1]), layer_input["dy"].reshape(-1, fc2.weight.shape[0])
    torch.testing.assert_close(fc2.weight.grad, dy.t() @ x, rtol=1e-5, atol=1e-7)


def test_checkpoint_round_trip_restores_the_scaling_state():
    torch.manual_seed(0)
    spec = _delayed(fp8_amax_history_len=4, fp8_amax_compute_algo="max")
    model = build(spec)
    convert_to_float8(model, emulate=True)
    for seed in (3, 4, 5):
        model(*batch(seed)[:2], None).sum().backward()
    state = model.state_dict()
    extra = [k for k in state if k.endswith("_extra_state") and state[k] is not None]
    assert len(extra) == 8 and all(".layers." in k for k in extra)
    fresh = build(spec)
    convert_to_float8(fresh, emulate=True)
    fresh.load_state_dict(state)
    for (name, a), b in zip(model.named_modules(), fresh.modules()):
        if hasattr(a, "fp8_amax_history"):
            assert torch.equal(a.fp8_amax_history, b.fp8_amax_history), name
            assert torch.equal(a.fp8_scale, b.fp8_scale), name
            assert a.fp8_amax_history[1:].gt(0).all(), name  # three steps recorded
    torch.testing.assert_close(fresh(*batch(6)[:2], None), model(*batch(6)[:2], None), rtol=0, atol=0)
    # A high-precision model loads the FP8 checkpoint (scaling state ignored) and vice versa (state reset).
    plain = build(llama_like())
    plain.load_state_dict(state)
    model.load_state_dict(plain.state_dict())
    assert all(m.fp8_amax_history.eq(0).all() and m.fp8_scale.eq(1).all()
               for m in model.modules() if hasattr(m, "fp8_scale"))
    # Transformer Engine's serialized state (pickled bytes in a uint8 tensor) cannot be read: fresh state.
    te_like = dict(state, **{k: torch.frombuffer(bytearray(b"te-fp8-meta"), dtype=torch.uint8) for k in extra})
    with pytest.warns(UserWarning, match="Transformer Engine's serialized FP8 state"):
        fresh.load_state_dict(te_like)
    assert all(m.fp8_amax_history.eq(0).all() and m.fp8_scale.eq(1).all()
               for m in fresh.modules() if hasattr(m, "fp8_scale"))
    with pytest.raises(ValueError, match="not FP8 delayed-scaling state"):
        model.load_state_dict(dict(state, **{extra[0]: {"fp8_recipe": "blockwise"}}))
    longer = build(_delayed(fp8_amax_history_len=8))
    convert_to_float8(longer, emulate=True)
    with pytest.raises(ValueError, match="amax history has 4 steps, fp8_amax_history_len is 8"):
        longer.load_state_dict(state)


@pytest.mark.parametrize("kwargs, field", [
    (dict(fp8_amax_compute_algo="mean"), "fp8_amax_compute_algo"),
    (dict(fp8_interval=2), "fp8_interval"),
    (dict(fp8_param=True), "fp8_param"),
    (dict(fp8_recipe="mxfp8"), "fp8_recipe"),
])
def test_delayed_config_rules(kwargs, field):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               **{"fp8": "e4m3", "fp8_recipe": "delayed", **kwargs})
    with pytest.raises(ValueError, match=field):
        check_fp8_config(config)


@pytest.mark.parametrize("kwargs, field", [
    (dict(fp8_amax_history_len=0), "fp8_amax_history_len"),
    (dict(fp8_margin=-1), "fp8_margin"),
    (dict(first_last_layers_bf16=True), "first_last_layers_bf16"),
])
def test_delayed_config_rules_of_megatron_core(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, fp8="e4m3", fp8_recipe="delayed",
                          **kwargs)


def test_valid_delayed_configs_pass():
    for fmt in ("e4m3", "hybrid"):
        for algo in ("max", "most_recent"):
            check_fp8_config(TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, fp8=fmt,
                                               fp8_recipe="delayed", fp8_amax_history_len=1024, fp8_margin=2,
                                               fp8_amax_compute_algo=algo, fp8_wgrad=False))


@pytest.mark.gpu
def test_delayed_fp8_model_on_gpu_tracks_bf16():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    torch.manual_seed(0)
    kwargs = dict(hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=512, bf16=True,
                  params_dtype=torch.bfloat16, use_cpu_initialization=True)
    model = build(_delayed(fp8="hybrid", fp8_amax_history_len=16, fp8_amax_compute_algo="max", **kwargs)).cuda()
    reference = build(llama_like(**kwargs)).cuda()
    reference.load_state_dict(model.state_dict())
    convert_to_float8(model)
    ids, pos, labels = (t.cuda() for t in batch())
    for _ in range(3):  # the first step runs with unit scales
        model.zero_grad()
        loss = model(ids, pos, None, labels=labels).float().mean()
        loss.backward()
    ref_loss = reference(ids, pos, None, labels=labels).float().mean()
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 2e-2
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    scales = [m.fp8_scale for m in model.modules() if hasattr(m, "fp8_scale")]
    assert len(scales) == 8 and all(s.is_cuda and s.ne(1).all() for s in scales)


class _Probe(torch.nn.Module):
    """The state :class:`DelayedFloat8Matmul` needs, on one layer: recipe, history, scales, no amax group."""

    def __init__(self, fmt: str, device: str, fp8_wgrad: bool = True) -> None:
        from megatron_core.fp8.delayed_scaling import DelayedScalingRecipe, init_state

        super().__init__()
        recipe = DelayedScalingRecipe(fp8_format=fmt, amax_history_len=4, fp8_wgrad=fp8_wgrad)
        init_state(self, recipe, torch.device(device))


def _scaled_mm_against_emulation(device: str, dtype: torch.dtype, fmt: str, fp8_wgrad: bool) -> dict:
    """Both paths of :class:`DelayedFloat8Matmul` over two steps: output, gradients and scales of each."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 37, 256, generator=gen).to(device, dtype)  # 148 tokens: the wgrad is padded
    w = (torch.randn(512, 256, generator=gen) * 0.02).to(device, dtype)
    dy = (torch.randn(4, 37, 512, generator=gen) * 1e-3).to(device, dtype)
    results = {}
    for emulate in (False, True):
        probe = _Probe(fmt, device, fp8_wgrad)
        for _ in range(2):  # the second step runs with scales from the first step's amaxes
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = DelayedFloat8Matmul.apply(xi, wi, probe, True, emulate, None)
            out.backward(dy)
        results[emulate] = (out.float(), xi.grad.float(), wi.grad.float(), probe.fp8_scale.clone())
    return results


def _assert_paths_agree(results: dict, tol: float) -> None:
    (out, gx, gw, scale), (e_out, e_gx, e_gw, e_scale) = results[False], results[True]
    assert torch.equal(scale, e_scale) and scale.gt(1).all()
    for name, got, want in (("output", out, e_out), ("dgrad", gx, e_gx), ("wgrad", gw, e_gw)):
        err = ((got - want).norm() / want.norm()).item()
        assert err < tol, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_scaled_mm_code_path_on_cpu_matches_the_emulation(fmt):
    """PyTorch's CPU ``_scaled_mm`` runs the GPU path's code (operand layouts, inverse scales, wgrad padding)."""
    try:
        torch._scaled_mm(torch.zeros(16, 16).to(E4M3), torch.zeros(16, 16).to(E4M3).t(),
                         scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"no CPU _scaled_mm in this PyTorch build: {err}")
    _assert_paths_agree(_scaled_mm_against_emulation("cpu", torch.float32, fmt, True), 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, fp8_wgrad", [("e4m3", True), ("hybrid", True), ("hybrid", False)])
def test_scaled_mm_path_matches_the_emulation(fmt, fp8_wgrad):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    _assert_paths_agree(_scaled_mm_against_emulation("cuda", torch.bfloat16, fmt, fp8_wgrad), 1e-2)


def test_activation_recompute_reuses_the_first_pass_scales():
    torch.manual_seed(0)
    spec = _delayed(fp8="hybrid", fp8_amax_history_len=4, fp8_amax_compute_algo="most_recent")
    plain = build(spec)
    recomputed = build(spec, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    recomputed.load_state_dict(plain.state_dict())
    for model in (plain, recomputed):
        convert_to_float8(model, emulate=True)
    for seed in (3, 4, 5):  # another batch each step, so every step moves the scales
        ids, pos, labels = batch(seed)
        losses = []
        for model in (plain, recomputed):
            model.zero_grad()
            loss = model(ids, pos, None, labels=labels).float().mean()
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), seed
        for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=f"step {seed}: {name}")
        for (name, a), b in zip(plain.named_modules(), recomputed.modules()):
            if hasattr(a, "fp8_scale"):
                assert torch.equal(a.fp8_amax_history, b.fp8_amax_history), name
                assert torch.equal(a.fp8_scale, b.fp8_scale), name
                assert len(b.fp8_recompute_stash) == 0, name


def test_moe_experts_keep_their_rowwise_grouped_gemm_under_delayed():
    from megatron_core.fp8 import Float8ColumnParallelGroupedLinear
    from tests.transformer.moe.moe_parallel_utils import batches
    from tests.transformer.moe.moe_parallel_utils import build as build_moe

    torch.manual_seed(0)
    model = build_moe("mixtral", moe_grouped_gemm=True, fp8="e4m3", fp8_recipe="delayed")
    names = convert_to_float8(model, emulate=True)
    delayed = [n for n, m in model.named_modules() if hasattr(m, "fp8_scale")]
    assert sorted(delayed) == sorted(n for n in names if ".experts." not in n) and len(delayed) == 4  # qkv, proj
    experts = model.decoder.layers[0].mlp.experts.linear_fc1
    assert isinstance(experts, Float8ColumnParallelGroupedLinear) and not hasattr(experts, "fp8_scale")
    ids, pos, labels = batches(1)[0]
    model(ids, pos, None, labels=labels).float().mean().backward()
    assert all(model.get_submodule(n).fp8_scale.ne(1).all() for n in delayed)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_degenerate_amaxes_keep_or_bound_the_scale():
    from megatron_core.fp8.delayed_scaling import ALL_COLUMNS, DelayedScalingRecipe, init_state, record_amax

    layer = torch.nn.Module()
    init_state(layer, DelayedScalingRecipe(amax_history_len=1), torch.device("cpu"))
    record_amax(layer, ALL_COLUMNS, torch.tensor([4.0, 2.0, 1.0]))
    assert layer.fp8_scale.tolist() == [112, 224, 448]
    record_amax(layer, ALL_COLUMNS, torch.tensor([0.0, float("nan"), float("inf")]))
    assert layer.fp8_scale.tolist() == [112, 224, 448]  # kept
    record_amax(layer, slice(INPUT, INPUT + 1), torch.tensor([1e-45]))  # 448 / 1e-45 overflows fp32
    assert layer.fp8_scale[INPUT].item() == torch.finfo(torch.float32).max
