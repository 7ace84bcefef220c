"""The flat fused Adam step of the precision-aware distributed optimizer (``optimizer/flat_adam.py``).

On 2 CPU ranks, with the flat step forced on, training equals the per-tensor ``PrecisionAwareAdam``
path (fp32 and bf16 moments, AdamW and L2, clipping folded into the step), a checkpoint taken mid-run
resumes exactly, plain Adam under the distributed optimizer (the flat step's default on CUDA) equals
torch's Adam and shares its checkpoints both ways, and the kernel itself (eager and ``torch.compile``d) matches a reference on random
shards, including the skipped update of a non-finite gradient norm.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron_core.optimizer.flat_adam import flat_adam_update
from megatron_core.transformer import Float16Module
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import SEQ, VOCAB, build, llama_like
from tests.optimizer.dp_step import dp_train_step

BATCH = 8


def _tokens(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)


def _setup(flat: bool, opt_overrides: dict):
    opt_overrides = {"use_precision_aware_optimizer": True, **opt_overrides}
    per_piece_norm = opt_overrides.pop("per_piece_norm", False)
    tp = opt_overrides.pop("tp", 1)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    bf16 = bool(opt_overrides.get("bf16"))
    model = build(llama_like(), tensor_model_parallel_size=tp,
                  **(dict(bf16=True, params_dtype=torch.bfloat16) if bf16 else {}))
    module = Float16Module(model.config, model) if bf16 else model
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=bf16), module)
    previous = DistributedOptimizer.flat_shard_step
    DistributedOptimizer.flat_shard_step = flat
    try:
        opt = get_megatron_optimizer(OptimizerConfig(
            lr=3e-3, weight_decay=0.05, clip_grad=opt_overrides.pop("clip_grad", 0.05), use_distributed_optimizer=True,
            **opt_overrides), [ddp])
    finally:
        DistributedOptimizer.flat_shard_step = previous
    assert (opt._flat is not None) == flat
    # Every piece counts towards the norm, except TP-replicated params (the norms' weights) off TP rank 0.
    assert opt._norm_over_flat_shards == (flat and parallel_state.get_tensor_model_parallel_rank() == 0)
    if per_piece_norm:  # the reference's summation order for the norm (bf16 moments round its last bits apart)
        opt._norm_over_flat_shards = False
    return model, ddp, opt


def _step(ddp, opt, step: int) -> float:
    return dp_train_step(ddp, opt, _tokens(step))


def _train(flat: bool, steps: int, opt_overrides: dict, resume_at: int | None = None,
           resume_flat: bool | None = None) -> dict:
    """Train ``steps`` steps; at ``resume_at`` continue in a fresh model and optimizer (flat or not per
    ``resume_flat``, default ``flat``) loaded from this one's state."""
    parallel_state.initialize_model_parallel()
    try:
        model, ddp, opt = _setup(flat, dict(opt_overrides))
        losses = []
        for step in range(steps):
            if step == resume_at:  # a fresh model and optimizer from the state of this one
                saved_model = {k: v.detach().clone() for k, v in model.named_parameters()}
                saved_opt = opt.state_dict()
                model, ddp, opt = _setup(flat if resume_flat is None else resume_flat, dict(opt_overrides))
                with torch.no_grad():
                    for name, param in model.named_parameters():
                        param.copy_(saved_model[name])
                opt.load_state_dict(saved_opt)
            losses.append(_step(ddp, opt, step))
        state = opt.optimizer.state
        return {
            "losses": losses,
            "weights": {k: v.detach().clone() for k, v in model.named_parameters()},
            "steps": sorted({int(s["step"]) for s in state.values()}),
            "moments": [s["exp_avg_sq"].detach().float().clone() for s in state.values()],
            "views": opt._flat is not None and all(  # the state lives in the flat buffers
                {s["exp_avg"].untyped_storage().data_ptr(), s["exp_avg_sq"].untyped_storage().data_ptr()}
                <= {t.untyped_storage().data_ptr() for shard in opt._flat.shards
                    for t in (shard.exp_avg, shard.exp_avg_sq)} for s in state.values()),
        }
    finally:
        parallel_state.destroy_model_parallel()


def _close(a: dict, b: dict, tol: float) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=tol, atol=tol)
    for name, value in a["weights"].items():
        torch.testing.assert_close(value, b["weights"][name], rtol=tol, atol=tol, msg=name)
    assert a["steps"] == b["steps"]


@pytest.mark.parametrize("overrides", [
    {},
    {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16, "per_piece_norm": True},
    {"decoupled_weight_decay": False},
    {"clip_grad": 0.0},
], ids=["fp32", "bf16-moments", "l2", "no-clip"])
def test_flat_step_equals_per_tensor_precision_aware_adam(overrides):
    # bf16 params: see test_flat_step_equals_the_per_tensor_step_on_the_same_gradients_with_bf16_params.
    reference = run_on_ranks(2, _train, False, 4, overrides)
    flat = run_on_ranks(2, _train, True, 4, overrides)
    # bf16 moments: the flat step's clip factor is formed on the device in fp32, the reference's on the host in
    # fp64; a last-bit difference can flip one moment's bf16 rounding (seen: one element of 4096 off by 1.7e-5).
    tol = 5e-5 if overrides.get("exp_avg_dtype") == torch.bfloat16 else 1e-5
    for got, want in zip(flat, reference):
        _close(got, want, tol)
        assert got["views"] and got["steps"] == [4]


def test_flat_step_resumes_from_a_checkpoint_exactly():
    straight = run_on_ranks(2, _train, True, 5, {"exp_avg_dtype": torch.bfloat16})
    resumed = run_on_ranks(2, _train, True, 5, {"exp_avg_dtype": torch.bfloat16}, 3)
    for a, b in zip(resumed, straight):
        assert a["losses"] == b["losses"]
        for name, value in a["weights"].items():
            assert torch.equal(value, b["weights"][name]), name


PLAIN_ADAM = {"use_precision_aware_optimizer": False}


def _train_in_slices(slice_elements: int, steps: int) -> dict:
    from megatron_core.optimizer import flat_adam

    default, flat_adam.SLICE_ELEMENTS = flat_adam.SLICE_ELEMENTS, slice_elements
    try:
        return _train(True, steps, {})
    finally:
        flat_adam.SLICE_ELEMENTS = default  # the rank pool's processes serve later tests


def test_a_shard_stepped_in_slices_equals_the_whole_shard_step():
    """Slices of 97 elements (crossing parameter and group boundaries) give the whole-shard step bit for bit."""
    whole = run_on_ranks(2, _train, True, 3, {})
    sliced = run_on_ranks(2, _train_in_slices, 97, 3)
    for got, want in zip(sliced, whole):
        _close(got, want, 0.0)


@pytest.mark.parametrize("overrides", [{}, {"decoupled_weight_decay": False}], ids=["adamw", "l2"])
def test_plain_adam_as_the_flat_step_equals_torch_adam(overrides):
    # Not flat: torch's Adam/AdamW over the shards; flat: the fp32 precision-aware Adam's fused step.
    reference = run_on_ranks(2, _train, False, 4, {**PLAIN_ADAM, **overrides})
    flat = run_on_ranks(2, _train, True, 4, {**PLAIN_ADAM, **overrides})
    for got, want in zip(flat, reference):
        _close(got, want, 1e-5)
        assert got["views"] and got["steps"] == [4]


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at ``|x|`` (8 significant bits): 2 ** (floor(log2 |x|) - 7)."""
    tiny = torch.finfo(torch.bfloat16).tiny
    return torch.exp2(torch.floor(torch.log2(x.detach().float().abs().clamp_min(tiny))) - 7)


def _main_params(opt) -> list[torch.Tensor]:
    return [p.detach().float().clone() for g in opt.optimizer.param_groups for p in g["params"]]


def _same_gradients(steps: int, opt_overrides: dict) -> list[dict]:
    """A per-tensor and a flat optimizer over two identical bf16 models, stepped on the same gradients.

    Only the reference model runs forward and backward; its gradients are copied into the flat model's buffers
    before both reduce them, so any difference after a step is the two optimizer steps' own arithmetic, never amplified by a
    forward pass over weights that already differ.
    """
    parallel_state.initialize_model_parallel()
    try:
        ref_model, ref_ddp, ref_opt = _setup(False, dict(opt_overrides))
        flat_model, flat_ddp, flat_opt = _setup(True, dict(opt_overrides))
        for a, b in zip(ref_model.parameters(), flat_model.parameters()):
            assert torch.equal(a, b)
        dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        history = []
        for step in range(steps):
            tokens = _tokens(step).chunk(dp)[rank]
            for ddp, opt in ((ref_ddp, ref_opt), (flat_ddp, flat_opt)):
                ddp.zero_grad_buffer()
                opt.zero_grad()
            positions = torch.arange(SEQ).unsqueeze(0).expand(tokens.shape[0], SEQ)
            ref_ddp(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean().backward()
            with torch.no_grad():  # this rank's gradients, before the reduction that both models then run
                for a, b in zip(ref_model.parameters(), flat_model.parameters()):
                    b.main_grad.copy_(a.main_grad)
            ref_ddp.finish_grad_sync()
            flat_ddp.finish_grad_sync()
            assert ref_opt.step()[0] and flat_opt.step()[0]
            history.append({
                "main": (_main_params(ref_opt), _main_params(flat_opt)),
                "params": [(a.detach().clone(), b.detach().clone())
                           for a, b in zip(ref_model.parameters(), flat_model.parameters())],
                "lr": ref_opt.optimizer.param_groups[0]["lr"],
            })
        return history
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("overrides", [{}, PLAIN_ADAM], ids=["precision-aware", "plain-adam"])
def test_flat_step_equals_the_per_tensor_step_on_the_same_gradients_with_bf16_params(overrides):
    # Why not train both freely and compare, as the fp32 tests do: the flat kernel and the per-tensor step
    # evaluate the same Adam formula in another association (and the flat step sums the gradient norm over
    # whole bucket slices), so their fp32 main weights differ in the last bits. Rounded to bf16, such a weight
    # lands on either neighbouring bf16 value now and then, the next forward then sees weights one bf16 ulp
    # apart, and two free runs drift apart chaotically; which elements flip depends on the CPU's vector kernels
    # (AVX2 and AVX-512 differ), so no fixed tolerance on free runs is right everywhere. On the same gradients,
    # the bounds follow from the formats alone:
    # - fp32 main weights: a step adds an update of size <= lr * (1 + weight decay) per element; two
    #   evaluations of it differ by a few fp32 roundings of the weight and of the update, so after n steps by
    #   at most n * 8 * 2**-24 relative to the weight (8 roundings per step, each <= half an ulp), plus the same
    #   relative bound on the update's size for weights near zero.
    # - bf16 params: each is its main weight rounded to nearest, so two main weights that differ by less than
    #   one bf16 ulp give bf16 values at most one bf16 ulp apart.
    history = run_on_ranks(2, _same_gradients, 4, {"bf16": True, **overrides})
    eps32 = 2.0 ** -24
    for rank_history in history:
        for n, step in enumerate(rank_history, start=1):
            rtol = n * 8 * eps32
            atol = rtol * step["lr"] * 2
            for want, got in zip(*step["main"]):
                torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=f"step {n}: main weights")
            for want, got in step["params"]:
                assert got.dtype == want.dtype == torch.bfloat16
                off = (got.float() - want.float()).abs()
                assert bool((off <= torch.maximum(_bf16_ulp(got), _bf16_ulp(want))).all()), (
                    f"step {n}: a bf16 param is more than one bf16 ulp from the reference's: {off.max()}")


@pytest.mark.parametrize("first_flat", [True, False], ids=["flat-to-torch", "torch-to-flat"])
def test_plain_adam_checkpoints_load_across_the_flat_step_and_torch_adam(first_flat):
    straight = run_on_ranks(2, _train, first_flat, 5, PLAIN_ADAM)
    switched = run_on_ranks(2, _train, first_flat, 5, PLAIN_ADAM, 3, not first_flat)
    for got, want in zip(switched, straight):
        # The step count too: a ``step`` tensor shared by every param was once counted per param after the switch.
        _close(got, want, 1e-5)


def _backward_only(ddp, opt, step: int) -> None:
    """This rank's half of step ``step``'s batch forward and backward, gradients reduced; no optimizer step."""
    tokens = _tokens(step).chunk(2)[dist.get_rank()]
    ddp.zero_grad_buffer()
    opt.zero_grad()
    positions = torch.arange(SEQ).unsqueeze(0).expand(tokens.shape[0], SEQ)
    ddp(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean().backward()
    ddp.finish_grad_sync()


def _skip_non_finite(poison: str = "grad", on_device: bool = False) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        model, ddp, opt = _setup(True, {})
        for step in range(2):
            _step(ddp, opt, step)
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        _backward_only(ddp, opt, 9)
        skip = None
        if poison == "grad":
            next(p for p in model.parameters()).main_grad.view(-1)[0] = float("nan")
        else:  # finite gradients, a non-finite value handed to the step (the loop's loss)
            skip = torch.tensor(float("inf"), dtype=torch.float64)
        unread = None
        if on_device:  # the outcome comes back as unread 0-dim tensors
            success, grad_norm, _ = opt.step_on_device(skip_unless_finite=skip)
            unread = all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in (success, grad_norm))
            success, grad_norm = bool(success), float(grad_norm)
        else:
            success, grad_norm, _ = opt.step(skip_unless_finite=skip)
        unchanged = all(torch.equal(v, before[k]) for k, v in model.named_parameters())
        steps = sorted({int(s["step"]) for s in opt.optimizer.state.values()})
        loss = _step(ddp, opt, 2)  # the next finite step goes ahead as step 3
        return {"success": success, "finite": grad_norm == grad_norm, "unchanged": unchanged, "steps": steps,
                "unread": unread,
                "after": sorted({int(s["step"]) for s in opt.optimizer.state.values()}), "loss": loss}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("on_device", [False, True], ids=["step", "step_on_device"])
@pytest.mark.parametrize("poison", ["grad", "skip_unless_finite"])
def test_non_finite_gradient_or_loss_skips_the_flat_step_and_its_count(poison, on_device):
    # The step count lives on the device: a skipped update takes its count back there, read by nobody.
    for r in run_on_ranks(2, _skip_non_finite, poison, on_device):
        assert not r["success"] and r["unchanged"] and r["unread"] in ((True,) if on_device else (None,))
        assert r["finite"] == (poison != "grad")  # the norm itself is finite when only the loss is not
        assert r["steps"] == [2] and r["after"] == [3] and r["loss"] == r["loss"]


def _outcome_announced_before_update() -> dict:
    parallel_state.initialize_model_parallel()
    try:
        model, ddp, opt = _setup(True, {})
        _step(ddp, opt, 0)
        _backward_only(ddp, opt, 1)
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        announced = []

        def outcome_known(success, grad_norm):
            unchanged = all(torch.equal(v, before[k]) for k, v in model.named_parameters())
            announced.append((success, grad_norm, unchanged, float(grad_norm)))

        success, grad_norm, _ = opt.step_on_device(outcome_known=outcome_known)
        (seen_success, seen_norm, unchanged_then, norm_then), = announced
        return {"same_objects": seen_success is success and seen_norm is grad_norm,
                "unchanged_then": unchanged_then, "norm_then": norm_then, "norm": float(grad_norm),
                "success": bool(success),
                "changed_after": any(not torch.equal(v, before[k]) for k, v in model.named_parameters())}
    finally:
        parallel_state.destroy_model_parallel()


def test_step_on_device_announces_its_outcome_before_queuing_the_update():
    # The loop copies the announced values to the host there, so that a log line does not wait for the update.
    for r in run_on_ranks(2, _outcome_announced_before_update):
        assert r["same_objects"] and r["unchanged_then"] and r["changed_after"] and r["success"], r
        assert r["norm_then"] == r["norm"] > 0


def _reference(main, grad, m, v, table, ids, beta1, beta2, eps, grad_scale):
    g = grad.float() / grad_scale
    p = main.float()
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    step_size, decay, bias2 = table[0][ids], table[1][ids], table[2][ids]
    return p * decay + step_size * m / (v.sqrt() / bias2 + eps), m, v


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flat_kernel_matches_reference_and_skips_on_non_finite_norm(compiled):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    n = 1000
    main, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = 0.1 * torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    ids = (torch.arange(n) % 3 == 0).to(torch.uint8)
    table = torch.tensor([[-1e-3, -2e-3], [0.999, 1.0], [0.3, 0.5]])
    scale = torch.tensor(2.0)
    want_p, want_m, want_v = _reference(main, grad, m, v, table, ids.long(), 0.9, 0.95, 1e-8, scale)
    update = torch.compile(flat_adam_update, dynamic=True) if compiled else flat_adam_update
    p, mm, vv, out = main.clone(), m.clone(), v.clone(), torch.empty(n, dtype=torch.bfloat16)
    update(p, grad, mm, vv, out, ids, table, scale, torch.tensor(0.0), 0.9, 0.95, 1e-8, True)
    torch.testing.assert_close(p, want_p, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(mm, want_m, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(vv, want_v, rtol=1e-6, atol=1e-7)
    assert torch.equal(out, p.to(torch.bfloat16))
    before = [t.clone() for t in (p, mm, vv, out)]
    update(p, grad, mm, vv, out, ids, table, scale, torch.tensor(1.0), 0.9, 0.95, 1e-8, True)  # found_inf: skip
    for now, then in zip((p, mm, vv), before):
        assert torch.equal(now, then)


@pytest.mark.gpu
def test_compiled_flat_kernel_on_cuda_matches_eager_and_writes_bf16():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = (1 << 22) + 123
    main, grad = torch.randn(n, device="cuda", generator=gen), torch.randn(n, device="cuda", generator=gen)
    m, v = 0.1 * torch.randn(n, device="cuda", generator=gen), torch.rand(n, device="cuda", generator=gen)
    ids = (torch.arange(n, device="cuda") % 5 == 0).to(torch.uint8)
    table = torch.tensor([[-1e-3, -2e-3], [0.999, 1.0], [0.3, 0.5]], device="cuda")
    results = []
    for update in (flat_adam_update, torch.compile(flat_adam_update, dynamic=True)):
        p, mm, vv = main.clone(), m.clone(), v.clone()
        out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        update(p, grad, mm, vv, out, ids, table, None, None, 0.9, 0.95, 1e-8, True)
        results.append((p, mm, vv, out))
    (p_eager, m_eager, v_eager, _), (p_compiled, m_compiled, v_compiled, out_compiled) = results
    for eager, compiled in ((p_eager, p_compiled), (m_eager, m_compiled), (v_eager, v_compiled)):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    # fp32 results that differ in the last bit (fused multiply-adds) may round to neighbouring bf16 values, so
    # the bf16 copy is checked against the compiled kernel's own fp32 weights, bit for bit.
    assert torch.equal(out_compiled, p_compiled.to(torch.bfloat16))


def test_flat_step_serves_plain_adam_under_the_distributed_optimizer_on_cuda_only():
    from types import SimpleNamespace

    from megatron_core.optimizer import _flat_adam_serves

    def groups(device: str) -> list[dict]:
        return [{"params": [SimpleNamespace(device=torch.device(device))]}]

    def config(**overrides) -> OptimizerConfig:
        return OptimizerConfig(lr=1e-3, **{"use_distributed_optimizer": True, **overrides})

    assert _flat_adam_serves(config(), groups("cuda"), fsdp=False)
    assert not _flat_adam_serves(config(), groups("cpu"), fsdp=False)
    assert not _flat_adam_serves(config(), groups("cuda"), fsdp=True)
    assert not _flat_adam_serves(config(use_distributed_optimizer=False), groups("cuda"), fsdp=False)
    assert not _flat_adam_serves(config(optimizer="sgd"), groups("cuda"), fsdp=False)
    assert not _flat_adam_serves(config(use_precision_aware_optimizer=True), groups("cuda"), fsdp=False)  # own path
    previous = DistributedOptimizer.flat_shard_step
    try:
        DistributedOptimizer.flat_shard_step = False
        assert not _flat_adam_serves(config(), groups("cuda"), fsdp=False)
        DistributedOptimizer.flat_shard_step = True
        assert _flat_adam_serves(config(), groups("cpu"), fsdp=False)
    finally:
        DistributedOptimizer.flat_shard_step = previous


def _norms(tp: int = 1) -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        model, ddp, opt = _setup(True, {"tp": tp})
        flat_path = opt._norm_over_flat_shards
        _step(ddp, opt, 0)
        _backward_only(ddp, opt, 1)
        opt.prepare_grads()
        flat_grads = opt.get_main_grads_for_grad_norm()
        flat_norm = opt.get_grad_norm()
        opt._norm_over_flat_shards = False
        pieces = opt.get_main_grads_for_grad_norm()
        return {"flat": flat_norm, "pieces": opt.get_grad_norm(), "tensors": (len(flat_grads), len(pieces)),
                "flat_path": flat_path}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tp", [1, 2])
def test_norm_over_flat_shard_slices_equals_the_norm_over_pieces(tp):
    results = run_on_ranks(2, _norms, tp)
    for rank, r in enumerate(results):
        # TP=2: rank 1 holds replicated copies that must not count, so it reads the pieces it may count.
        assert r["flat_path"] == (tp == 1 or rank == 0), (rank, r)
        if r["flat_path"]:
            assert r["tensors"][0] < r["tensors"][1]  # one slice per bucket instead of one tensor per param
        assert math.isclose(r["flat"], r["pieces"], rel_tol=1e-6), r
