"""FP8 parameters (``fp8_param``) with the distributed optimizer, on CPU (fp32 emulation of the float8 GEMMs).

A tiny llama-like GPT (``fp8_recipe='tensorwise'``) trains with Adam under DDP + the distributed optimizer.

* DP=2 against one process on the concatenated batch (3 steps). The input / output-gradient amaxes are
  max-reduced over the DP group (``amax_reduction_group``), so both quantize every GEMM operand with the
  same scales (the output gradient's differ by exactly 2, the loss being a mean over twice the tokens);
  the weight scales are agreed over DP by construction. Gradients then differ by fp32 summation order
  only (~1e-7): losses agree within 1e-5 relative (measured 6e-8), the weight scales within 1e-6
  (measured: equal) and the FP8 bytes exactly, but for a value on an e4m3 rounding boundary, which may
  flip by one step (at most 0.1% of the bytes, each within one e4m3 step; measured 1 of 18432). Such a
  flip, and fp32 noise on a near-zero gradient, can change the sign of an early Adam update (about
  ``lr * sign(g)``), so the fp32 main weights are compared element-wise: at most 1% of them more than
  1e-6 apart, none more than ``0.1 * lr`` (measured 123 of 22688, largest 4.2e-4 = 0.042 lr).
* fp8_param against fp8_param=False (torchao's tensorwise recipe, the weight cast from the fp32 model
  parameter in every forward), both with each rank's own amaxes. As Megatron-Core, the main weights are
  cast to the parameter's high-precision dtype before quantization and the FP8 parameter starts from
  its high-precision initial value, so both quantize the same values with the same per-tensor scale:
  with an fp32 (or bf16, the cast being the same) model the runs differ only by the GEMMs' summation
  order (ours pads the weight-gradient GEMM's token dimension to 16), not by a second rounding. Same
  bounds as above (measured: equal losses, main weights within 3e-6 relative: with FP8 parameters the MLP's
  ``linear_fc1`` computes SwiGLU's gradient itself, the same products in another order than autograd's).
* The param buffer of the FP8 weights is ``uint8`` and the parameter all-gather moves exactly its bytes;
  the forward feeds the stored FP8 tensor to the GEMM without casting it; the checkpoint holds the
  dequantized weights and loads DP=2 -> DP=1 (re-quantized, then set exactly from the loaded main
  weights); unsupported combinations raise ``ValueError`` naming the fields.
"""

from __future__ import annotations

import gc

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
    collectives,
    finalize_model_grads,
)
from megatron_core.distributed.fp8_params import dequantize_fp8_tensor, is_fp8_param, make_fp8_param
from megatron_core.fp8 import check_fp8_config, convert_to_float8, fp8_param_linear
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.training.checkpointing import load_checkpoint, save_checkpoint
from tests.cuda_process_group import one_rank_nccl_group
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import batch, build, llama_like

SPEC = llama_like(fp8="e4m3", fp8_recipe="tensorwise")
STEPS = 3
LR = 1e-2
TOL = 1e-5
SCALE_RTOL = 1e-6
FLIP_FRACTION = 1e-3
MAIN_ATOL, MAIN_OFF_FRACTION, MAIN_MAX_ABS = 1e-6, 1e-2, 0.1 * LR
E4M3_STEP = 2.0 ** -2  # one e4m3 step, relative: 2**-3 of the binade's start, at most 2**-2 of a value in it


def _batches(rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch, or (``None``) both ranks' concatenated."""
    parts = [batch(3), batch(4)]
    chosen = parts if rank is None else [parts[rank]]
    return torch.cat([p[0] for p in chosen]), torch.cat([p[2] for p in chosen])


def _build(fp8_param: bool, amax_group=None, seed: int = 0):
    torch.manual_seed(seed)
    model = build(SPEC, fp8_param=fp8_param)
    convert_to_float8(model, emulate=True, amax_reduction_group=amax_group)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, fp8_param_gather=fp8_param), model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, use_distributed_optimizer=True), [ddp])
    return model, ddp, opt


def _step(ddp, opt, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    ddp.zero_grad_buffer()
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    loss = ddp(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    finalize_model_grads([ddp])
    assert opt.step()[0]
    loss = loss.detach().clone()
    group = parallel_state.get_data_parallel_group()
    if torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(loss, group=group)
        loss /= torch.distributed.get_world_size(group)
    return loss


def _fp8_state(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (bytes, scale)}`` of every FP8 parameter."""
    return {n: (p.detach().view(torch.uint8).clone(), p.fp8_scale.clone())
            for n, p in model.named_parameters() if is_fp8_param(p)}


def _main_weights(model, opt) -> dict[str, torch.Tensor]:
    """The full fp32 main weights (each rank's slices assembled over the DP group)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for e in opt._entries():
        out[names[id(e.model_param)]] = (e.param_range.start, e.main_param.detach().clone())
    full = {}
    group = parallel_state.get_data_parallel_group()
    for name, p in model.named_parameters():
        flat = torch.zeros(p.numel())
        if name in out:
            start, value = out[name]
            flat[start:start + value.numel()] = value
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(flat, group=group)
        full[name] = flat
    return full


def _train(fp8_param: bool, rank: int | None, steps: int = STEPS, reduce_amax: bool = True) -> dict:
    """``steps`` steps; losses, FP8 state, main weights, and (FP8 params) the param buffers and every all-gather."""
    group = parallel_state.get_data_parallel_group()
    model, ddp, opt = _build(fp8_param, group if (fp8_param and reduce_amax) else None)
    ids, labels = _batches(rank)
    gathered = []
    original = collectives.all_gather

    def spy(output, input_, group, async_op=False):
        gathered.append((output.dtype, output.numel() * output.element_size(), input_.dtype))
        return original(output, input_, group, async_op=async_op)

    collectives.all_gather = spy
    try:
        losses = [_step(ddp, opt, ids, labels) for _ in range(steps)]
    finally:
        collectives.all_gather = original
    weights = [p for p in model.parameters() if is_fp8_param(p)]
    fp8 = [b for b in ddp.buffers if b.param_dtype == torch.uint8]
    gather = dict(buffers=[(b.param_data.dtype, b.param_data.element_size(), b.param_data.numel(), b.grad_data.dtype)
                           for b in fp8],
                  in_buffer=all(any(b.param_data.data_ptr() <= p.data_ptr() < b.param_data.data_ptr() + b.numel
                                    for b in fp8) for p in weights),
                  fp8_numel=sum(p.numel() for p in weights), gathered=gathered,
                  weight_dtypes={p.dtype for p in weights})
    return dict(losses=torch.stack(losses), fp8=_fp8_state(model), main=_main_weights(model, opt), gather=gather)


def _save_dp2(ckpt: str) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        model, ddp, opt = _build(True, parallel_state.get_data_parallel_group())
        ids, labels = _batches(torch.distributed.get_rank())
        for _ in range(STEPS - 1):
            _step(ddp, opt, ids, labels)
        state = model.state_dict()
        dequantized = all(state[n].dtype == torch.float32 and torch.equal(state[n], dequantize_fp8_tensor(p))
                          for n, p in model.named_parameters() if is_fp8_param(p))
        save_checkpoint(ckpt, STEPS - 1, [ddp], opt, None)
        saved = _fp8_state(model)
        last = _step(ddp, opt, ids, labels)
        return dict(dequantized=dequantized, saved=saved, last=last, fp8=_fp8_state(model),
                    main=_main_weights(model, opt))
    finally:
        parallel_state.destroy_model_parallel()


def _load_dp1(ckpt: str) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        model, ddp, opt = _build(True, parallel_state.get_data_parallel_group(), seed=7)
        load_checkpoint(ckpt, [ddp], None, None, load_rng=False, strict=True)
        requantized = _fp8_state(model)
        model, ddp, opt = _build(True, parallel_state.get_data_parallel_group(), seed=7)
        load_checkpoint(ckpt, [ddp], opt, None, load_rng=False)
        loaded = _fp8_state(model)
        last = _step(ddp, opt, *_batches(None))
        return dict(requantized=requantized, loaded=loaded, last=last, fp8=_fp8_state(model),
                    main=_main_weights(model, opt))
    finally:
        parallel_state.destroy_model_parallel()


def _dp2_checks(ckpt: str) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        out = dict(dp2=_train(True, torch.distributed.get_rank()),
                   vs_hp=[_train(flag, torch.distributed.get_rank(), reduce_amax=False) for flag in (True, False)],
                   refusals=_refusals())
    finally:
        parallel_state.destroy_model_parallel()
    out["ckpt"] = _save_dp2(ckpt)
    return out


def _dp1_checks(ckpt: str) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        ref = _train(True, None)
    finally:
        parallel_state.destroy_model_parallel()
    return dict(ref=ref, ckpt=_load_dp1(ckpt))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _byte_flips(got: dict, want: dict) -> tuple[int, int]:
    """(elements whose FP8 bytes differ, total); every differing element must be within one e4m3 step."""
    flips = total = 0
    for name, (bits, scale) in want.items():
        other_bits, other_scale = got[name]
        a = other_bits.view(torch.float8_e4m3fn).float() / other_scale
        b = bits.view(torch.float8_e4m3fn).float() / scale
        assert ((a - b).abs() <= E4M3_STEP * b.abs() + 1e-12).all(), name
        flips += int((other_bits != bits).sum())
        total += bits.numel()
    return flips, total


def _assert_main_close(got: dict, want: dict) -> None:
    off = total = 0
    for name, value in want.items():
        diff = (got[name] - value).abs()
        assert diff.max() <= MAIN_MAX_ABS, (name, diff.max())
        off += int((diff > MAIN_ATOL).sum())
        total += value.numel()
    assert off <= MAIN_OFF_FRACTION * total, (off, total)


def _assert_fp8_match(got: dict, want: dict, rtol: float, flip_fraction: float) -> int:
    for name, (_, scale) in want.items():
        torch.testing.assert_close(got[name][1], scale, rtol=rtol, atol=0, msg=name)
    flips, total = _byte_flips(got, want)
    assert flips <= flip_fraction * total, (flips, total)
    return flips


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One DP=2 pool call and one DP=1 pool call covering every distributed check."""
    ckpt = str(tmp_path_factory.mktemp("fp8_param_ckpt"))
    dp2 = run_on_ranks(2, _dp2_checks, ckpt, timeout=280)
    dp1 = run_on_ranks(1, _dp1_checks, ckpt, timeout=280)[0]
    return dp2, dp1


def test_fp8_param_dp2_equals_one_process(runs):
    dp2, dp1 = runs
    ref = dp1["ref"]
    for rank in dp2:
        got = rank["dp2"]
        assert _rel(got["losses"], ref["losses"]) < TOL, (got["losses"], ref["losses"])
        _assert_main_close(got["main"], ref["main"])
        _assert_fp8_match(got["fp8"], ref["fp8"], SCALE_RTOL, FLIP_FRACTION)
    assert ref["losses"][-1] < ref["losses"][0]  # it trains
    assert len(ref["fp8"]) == 8  # qkv, proj, fc1, fc2 of both layers


def test_fp8_param_tracks_high_precision_weights(runs):
    dp2, _ = runs
    for rank in dp2:
        fp8_param, hp = rank["vs_hp"]
        assert _rel(fp8_param["losses"], hp["losses"]) < TOL, (fp8_param["losses"], hp["losses"])
        _assert_main_close(fp8_param["main"], hp["main"])


def test_fp8_param_buffer_is_one_byte_and_gathered_as_bytes(runs):
    dp2, _ = runs
    for rank in dp2:
        g = rank["dp2"]["gather"]
        assert g["weight_dtypes"] == {torch.float8_e4m3fn}
        assert [b[:2] for b in g["buffers"]] == [(torch.uint8, 1)]
        (_, _, numel, grad_dtype), = g["buffers"]
        assert grad_dtype == torch.float32 and g["in_buffer"]
        assert numel >= g["fp8_numel"]
        # Every step all-gathers the FP8 buffer as bytes, 1 per element (and the fp32 buffer of the other params).
        assert g["gathered"].count((torch.uint8, numel, torch.uint8)) == STEPS, g["gathered"]


def test_fp8_param_forward_uses_stored_weight():
    torch.manual_seed(0)
    model = build(SPEC, fp8_param=True)
    convert_to_float8(model, emulate=True)
    weights = {p.data_ptr(): p for p in model.parameters() if is_fp8_param(p)}
    casts, operands = [], []
    quantize, fp8_mm = fp8_param_linear.quantize, fp8_param_linear.fp8_mm_nt

    def count_quantize(t, scale, dtype):
        casts.append(tuple(t.shape))
        return quantize(t, scale, dtype)

    def record_mm(a, a_scale, b_t, b_scale, out_dtype, emulate, fast_accum=False):
        operands.append((b_t.data_ptr(), b_t.dtype, b_scale))
        return fp8_mm(a, a_scale, b_t, b_scale, out_dtype, emulate, fast_accum)

    fp8_param_linear.quantize, fp8_param_linear.fp8_mm_nt = count_quantize, record_mm
    try:
        ids, pos, _ = batch()
        with torch.no_grad():
            model(ids, pos, None)
    finally:
        fp8_param_linear.quantize, fp8_param_linear.fp8_mm_nt = quantize, fp8_mm
    assert len(operands) == len(casts) == len(weights) == 8  # one cast per GEMM: the input's
    assert all(shape[0] == ids.numel() for shape in casts)  # [tokens, in]: activations, never a weight
    for ptr, dtype, scale in operands:
        assert dtype == torch.float8_e4m3fn and ptr in weights
        assert torch.equal(scale, weights[ptr].fp8_scale)


def test_fp8_param_keeps_its_bytes_through_a_dtype_cast():
    """``Float16Module`` (``.to(bfloat16)``) after the conversion leaves the FP8 bytes and scale as they are and makes
    bf16 the weights' high-precision dtype (of their gradients and checkpointed values), as for a bf16 model."""
    from megatron_core.transformer.module import Float16Module

    model = build(SPEC, fp8_param=True, bf16=True)
    convert_to_float8(model, emulate=True)
    before = _fp8_state(model)
    names = [n for n, _ in model.named_parameters()]
    wrapped = Float16Module(model.config, model)
    assert [n for n, _ in model.named_parameters()] == names  # same order (DDP's buffer layout)
    for name, (bits, scale) in _fp8_state(model).items():
        assert torch.equal(bits, before[name][0]) and torch.equal(scale, before[name][1]), name
        assert model.get_parameter(name).fp8_hp_dtype == torch.bfloat16
    assert model.decoder.final_layernorm.weight.dtype == torch.bfloat16
    state = wrapped.state_dict()
    fp8 = [k for k in state if k.endswith(tuple(n for n in before))]
    assert len(fp8) == len(before) and all(state[k].dtype == torch.bfloat16 for k in fp8)


@pytest.mark.parametrize("grad_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_param_scaled_mm_path_matches_emulation(grad_dtype):
    """The ``torch._scaled_mm`` code of the GPU (PyTorch's CPU kernel here; 20 tokens, so the weight-gradient GEMM
    pads) equals the fp32 emulation: output, input gradient and ``main_grad`` within 1e-5 (measured 3e-7)."""
    torch.manual_seed(0)
    weight = make_fp8_param(torch.nn.Parameter(torch.randn(32, 48) * 0.05))
    x = torch.randn(2, 10, 48)
    results = []
    for emulate in (True, False):
        weight.main_grad, weight.grad_added_to_main_grad, weight.grad = torch.zeros(32, 48), False, None
        xx = x.clone().requires_grad_()
        y = fp8_param_linear.Float8ParamMatmul.apply(xx, weight, grad_dtype, None, emulate)
        y.square().sum().backward()
        assert weight.grad_added_to_main_grad and weight.grad.dtype == torch.float8_e4m3fn  # a placeholder
        results.append((y.detach(), xx.grad, weight.main_grad))
    for emulated, scaled_mm in zip(*results):
        assert scaled_mm.abs().max() > 0 and _rel(scaled_mm, emulated) < TOL


def test_fp8_param_checkpoint_round_trip_dp2_to_dp1(runs):
    dp2, dp1 = runs
    saved, load = dp2[0]["ckpt"], dp1["ckpt"]
    assert all(rank["ckpt"]["dequantized"] for rank in dp2)  # the state dict holds dequantized fp32 weights
    # The model weights alone re-quantize from their dequantized values (a scale one fp32 rounding away).
    _assert_fp8_match(load["requantized"], saved["saved"], SCALE_RTOL, FLIP_FRACTION)
    # With the optimizer the bytes are those the main weights give, exactly as at saving.
    for name, (bits, scale) in saved["saved"].items():
        assert torch.equal(load["loaded"][name][0], bits) and torch.equal(load["loaded"][name][1], scale), name
    # The next step (DP=1 on both batches) continues the DP=2 run.
    assert _rel(load["last"], saved["last"]) < TOL
    _assert_main_close(load["main"], saved["main"])
    _assert_fp8_match(load["fp8"], saved["fp8"], SCALE_RTOL, FLIP_FRACTION)


def _config(**kwargs):
    from megatron_core.transformer import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, **{"fp8": "e4m3", **kwargs})


@pytest.mark.parametrize("recipe", ["delayed", "rowwise"])
def test_fp8_param_refuses_other_recipes(recipe):
    with pytest.raises(ValueError, match=rf"fp8_param.*fp8_recipe='{recipe}'"):
        check_fp8_config(_config(fp8_recipe=recipe, fp8_param=True))


def _refusals() -> list[str]:
    """The messages of DDP without the distributed optimizer / fp8_param_gather, and of FSDP2, on FP8 params."""
    model = build(SPEC, fp8_param=True)
    convert_to_float8(model, emulate=True)
    messages = []
    attempts = [lambda: DistributedDataParallel(model.config, DistributedDataParallelConfig(), model),
                lambda: DistributedDataParallel(model.config, DistributedDataParallelConfig(
                    use_distributed_optimizer=True), model),
                lambda: TorchFullyShardedDataParallel(model.config, DistributedDataParallelConfig(), model)]
    for attempt in attempts:
        try:
            attempt()
            messages.append("accepted")
        except ValueError as err:
            messages.append(str(err))
    return messages


def test_fp8_param_refuses_unsupported_wrappers(runs):
    with pytest.raises(ValueError, match="fp8_param_gather.*use_distributed_optimizer"):
        DistributedDataParallelConfig(fp8_param_gather=True)
    ddp, ddp_no_gather, fsdp = runs[0][0]["refusals"]
    for message in (ddp, ddp_no_gather):
        assert "fp8_param" in message and "use_distributed_optimizer" in message and "fp8_param_gather" in message
    assert "fp8_param" in fsdp and "TorchFullyShardedDataParallel" in fsdp


CUDA_STEPS = 5
CUDA_LR = 1e-3
CUDA_LOSS_RTOL = 1e-2
CUDA_MAIN_RTOL = 2e-2


def _requested_bytes() -> int:
    """The bytes the live CUDA tensors asked for: the caching allocator's ``memory_allocated`` counts whole blocks,
    which round up a tensor by up to 1 MiB (a 7.5 MiB tensor in a fresh 8 MiB segment takes all of it)."""
    return torch.cuda.memory_stats()["requested_bytes.all.current"]


def _cuda_run(fp8_param: bool, fp8: bool = True) -> dict:
    """A bf16 llama-like GPT on CUDA, FP8 tensorwise (hybrid) unless not ``fp8``, 5 Adam steps; losses, main
    weights, bytes."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = _requested_bytes()  # what an earlier run left allocated (cuBLAS workspaces)
    torch.manual_seed(0)
    fp8_fields = dict(fp8="hybrid", fp8_recipe="tensorwise") if fp8 else {}
    spec = llama_like(**fp8_fields, hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=1024,
                      bf16=True, params_dtype=torch.bfloat16)
    model = build(spec, fp8_param=fp8_param).cuda()
    if fp8:
        convert_to_float8(model)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, fp8_param_gather=fp8_param), model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=CUDA_LR, bf16=True, use_distributed_optimizer=True), [ddp])
    torch.cuda.synchronize()
    static = _requested_bytes() - base  # weights, DDP buffers, fp32 main weights (no Adam moments yet)
    ids, _, labels = batch(3)
    losses = [_step(ddp, opt, ids.cuda(), labels.cuda()) for _ in range(CUDA_STEPS)]
    torch.cuda.synchronize()
    return dict(losses=torch.stack(losses).cpu(), main=_main_weights(model, opt),
                param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                buffer_bytes=sum(b.param_data.numel() * b.param_data.element_size() for b in ddp.buffers),
                fp8_numel=sum(p.numel() for p in model.parameters() if is_fp8_param(p)),
                static=static, peak=torch.cuda.max_memory_allocated())


@pytest.mark.gpu
def test_fp8_param_on_cuda_tracks_fp8_training_and_halves_weight_bytes(tmp_path):
    """bf16 on an FP8 GPU (torch._scaled_mm), fp8_param against fp8_param=False (torchao's tensorwise recipe).

    Both quantize bf16(main weights) with the same per-tensor scale and run the forward GEMM with fast
    accumulation; they differ by the GEMM kernels' output rounding and the weight gradient's accumulation (ours adds
    the ``_scaled_mm`` result to ``main_grad``, torchao returns a bf16 gradient that DDP adds). The first loss (identical weights) agrees within 1e-3; over the 5 steps on one batch Adam turns that
    rounding into diverging updates, so the yardstick is a bf16 run of the same model: fp8_param stays at most as
    far from torchao's FP8 (losses, main weights) as torchao's FP8 is from bf16, or within 1% / 2%.
    The allocated GPU memory before the first step is smaller by (at least 90% of) one byte per FP8 weight element."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability >= 8.9)")
    pytest.importorskip("torchao.float8")
    with one_rank_nccl_group(tmp_path):
        runs = {flag: _cuda_run(flag) for flag in (False, True)}
        bf16 = _cuda_run(False, fp8=False)
    hp, fp8 = runs[False], runs[True]
    losses = (fp8["losses"], hp["losses"], bf16["losses"])
    assert abs(fp8["losses"][0] - hp["losses"][0]) / hp["losses"][0] < 1e-3, losses
    spread = ((hp["losses"] - bf16["losses"]).abs() / bf16["losses"]).max().item()
    assert ((fp8["losses"] - hp["losses"]).abs() / hp["losses"]).max() < max(CUDA_LOSS_RTOL, spread), losses
    assert fp8["losses"][-1] < fp8["losses"][0]
    for name, want in hp["main"].items():
        yardstick = ((want - bf16["main"][name]).norm() / bf16["main"][name].norm()).item()
        err = ((fp8["main"][name] - want).norm() / want.norm()).item()
        assert err < max(CUDA_MAIN_RTOL, yardstick), (name, err, yardstick)
    # Every FP8 weight holds 1 byte per element instead of 2, in the model and in the DDP param buffers.
    assert fp8["param_bytes"] == hp["param_bytes"] - fp8["fp8_numel"]
    assert fp8["buffer_bytes"] < hp["buffer_bytes"]
    # The GPU memory of the model, DDP and the optimizer before the first step shrinks by those bytes too.
    assert hp["static"] - fp8["static"] >= 0.9 * fp8["fp8_numel"], (hp["static"], fp8["static"], fp8["fp8_numel"],
                                                                   "peaks", hp["peak"], fp8["peak"])
