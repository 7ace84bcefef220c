"""Precision-aware distributed optimizer (bf16 moments, bf16 main params) and optimizer CPU offload.

- ``PrecisionAwareAdam`` with fp32 storage equals ``torch.optim.AdamW``/``Adam``.
- A tiny GPT (DP=2, distributed optimizer) trained 200 steps on a learnable token stream: bf16
  ``exp_avg``/``exp_avg_sq`` give a loss curve within 1% of fp32 moments at every step, and the
  optimizer state's bytes per parameter (counted tensor by tensor on every rank) drop from 8 to 4.
- CPU offload (fractions 0.5 and 1.0) keeps the offloaded main params and moments on the CPU, as
  copies separate from the model params, and gives exactly the non-offloaded losses and weights.
- Bad combinations raise ``ValueError`` naming the field.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.optimizer import OptimizerConfig, PrecisionAwareAdam, get_megatron_optimizer
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import SEQ, VOCAB, build, llama_like
from tests.optimizer.dp_step import dp_train_step

BATCH = 8


def _tokens(step: int) -> torch.Tensor:
    """A learnable stream: each next token is ``(3 t + 7) % V`` with probability 0.75, else random."""
    gen = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=gen)
    for i in range(1, SEQ + 1):
        noise = torch.randint(0, VOCAB, (BATCH,), generator=gen)
        keep = torch.rand(BATCH, generator=gen) < 0.75
        tokens[:, i] = torch.where(keep, (3 * tokens[:, i - 1] + 7) % VOCAB, noise)
    return tokens


def _train(steps: int, opt_overrides: dict) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        torch.manual_seed(1234)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = build(llama_like())
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                      model)
        opt = get_megatron_optimizer(OptimizerConfig(lr=3e-3, weight_decay=0.01, clip_grad=1.0,
                                                     use_distributed_optimizer=True, **opt_overrides), [ddp])
        losses = [dp_train_step(ddp, opt, _tokens(step)) for step in range(steps)]
        entries = opt._entries()
        state_bytes = sum(t.numel() * t.element_size() for s in opt.optimizer.state.values()
                          for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        main_bytes = sum(e.main_param.numel() * e.main_param.element_size() for e in entries
                         if e.main_param.data_ptr() != e.model_param.data_ptr() + e.param_range.start
                         * e.model_param.element_size())
        offloaded = [e for e in entries if e.offloaded]
        return {
            "losses": losses,
            "weights": {k: v.detach().clone() for k, v in model.named_parameters()},
            "state_bytes": state_bytes, "main_bytes": main_bytes,
            "num_params": sum(p.numel() for p in model.parameters()),
            "offloaded_elements": sum(e.main_param.numel() for e in offloaded),
            "shard_elements": sum(e.main_param.numel() for e in entries),
            "offload_on_cpu": all(e.main_param.device.type == "cpu" and all(
                t.device.type == "cpu" for t in opt.optimizer.state[e.main_param].values()) for e in offloaded),
            "state_dtypes": sorted({str(t.dtype) for s in opt.optimizer.state.values() for k, t in s.items()
                                    if k != "step"}),
        }
    finally:
        parallel_state.destroy_model_parallel()


def _bytes_per_param(results: list[dict]) -> float:
    return sum(r["state_bytes"] + r["main_bytes"] for r in results) / results[0]["num_params"]


BF16_MOMENTS = dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)


def test_bf16_moments_match_fp32_loss_curve_and_halve_state_bytes():
    steps = 200
    fp32 = run_on_ranks(2, _train, steps, {})
    bf16 = run_on_ranks(2, _train, steps, BF16_MOMENTS)
    ref, got = torch.tensor(fp32[0]["losses"]), torch.tensor(bf16[0]["losses"])
    assert ref[-20:].mean() < 0.6 * ref[:5].mean(), ref  # the model really learns
    rel = ((got - ref).abs() / ref).max().item()
    assert rel < 0.01, f"bf16-moment loss deviates {rel:.4f} from fp32 moments"
    assert bf16[0]["state_dtypes"] == ["torch.bfloat16"] and fp32[0]["state_dtypes"] == ["torch.float32"]
    # fp32 model: the main params are views of the params (0 bytes); Adam keeps 2 moments per element.
    assert _bytes_per_param(fp32) == 8.0
    assert _bytes_per_param(bf16) == 4.0


def test_precision_aware_optimizer_with_fp32_storage_equals_distributed_adamw():
    plain = run_on_ranks(2, _train, 4, {})
    aware = run_on_ranks(2, _train, 4, dict(use_precision_aware_optimizer=True))
    torch.testing.assert_close(torch.tensor(aware[0]["losses"]), torch.tensor(plain[0]["losses"]),
                               rtol=1e-6, atol=1e-6)
    for name, value in aware[0]["weights"].items():
        torch.testing.assert_close(value, plain[0]["weights"][name], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_cpu_offload_keeps_state_on_cpu_and_equals_the_device_run(fraction):
    base = run_on_ranks(2, _train, 4, BF16_MOMENTS)
    off = run_on_ranks(2, _train, 4, dict(BF16_MOMENTS, optimizer_cpu_offload=True,
                                          optimizer_offload_fraction=fraction))
    assert off[0]["losses"] == base[0]["losses"]
    for name, value in off[0]["weights"].items():
        assert torch.equal(value, base[0]["weights"][name]), name
    for r in off:
        assert r["offload_on_cpu"]
        assert r["offloaded_elements"] >= fraction * r["shard_elements"] > 0
        # offloaded main params are separate copies: fp32 bytes for the offloaded elements
        assert r["main_bytes"] == 4 * r["offloaded_elements"]


def test_precision_aware_adam_with_fp32_storage_equals_torch_adam():
    for decoupled in (True, False):
        torch.manual_seed(0)
        ref = torch.nn.Parameter(torch.randn(5, 7))
        mine = torch.nn.Parameter(ref.detach().clone())
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        opt_ref = cls([ref], lr=1e-2, weight_decay=0.1, foreach=False)
        opt = PrecisionAwareAdam([mine], lr=1e-2, weight_decay=0.1, adam_w_mode=decoupled)
        for _ in range(5):
            grad = torch.randn(5, 7)
            ref.grad, mine.grad = grad.clone(), grad.clone()
            opt_ref.step()
            opt.step()
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[mine]["exp_avg_sq"], opt_ref.state[ref]["exp_avg_sq"])


@pytest.mark.parametrize("kwargs, field", [
    (dict(exp_avg_dtype=torch.bfloat16), "exp_avg_dtype"),
    (dict(main_params_dtype=torch.bfloat16), "main_params_dtype"),
    (dict(use_precision_aware_optimizer=True), "use_distributed_optimizer"),
    (dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True, optimizer="sgd"), "optimizer"),
    (dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True, exp_avg_sq_dtype=torch.int8),
     "exp_avg_sq_dtype"),
    (dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True, main_grads_dtype=torch.bfloat16),
     "main_grads_dtype"),
    (dict(optimizer_cpu_offload=True, use_distributed_optimizer=True), "use_precision_aware_optimizer"),
    (dict(optimizer_offload_fraction=0.5), "optimizer_cpu_offload"),
    (dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True, optimizer_cpu_offload=True,
          optimizer_offload_fraction=1.5), "optimizer_offload_fraction"),
])
def test_bad_precision_and_offload_settings_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        OptimizerConfig(lr=1e-3, **kwargs)
