"""bf16 training of a hybrid (Mamba) model under ``Float16Module``, DDP and the distributed optimizer.

Fifty steps on a learnable token stream in bf16 (fp32 main weights, fp32 gradient reduction) end within the
run-to-run spread of the same training in fp32 (runs from different initial seeds), and the optimizer's main
copies of the Mamba parameters (``A_log``, ``D``, ``dt_bias`` among them) are fp32 shards whose bf16 rounding is
the model's weight.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.transformer.module import Float16Module
from tests.dist_harness import run_on_ranks
from tests.models.mamba.mamba_test_utils import VOCAB, config
from tests.optimizer.dp_step import dp_train_step

PATTERN = "M*M-"
STEPS, BATCH, SEQ, TAIL = 50, 8, 24, 10
SEEDS = (1, 2, 3)


def _tokens(step: int) -> torch.Tensor:
    """Each next token is ``(3 t + 7) % V`` with probability 0.75, else random (a stream the model can learn)."""
    gen = torch.Generator().manual_seed(20_000 + step)
    tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=gen)
    for i in range(1, SEQ + 1):
        keep = torch.rand(BATCH, generator=gen) < 0.75
        tokens[:, i] = torch.where(keep, (3 * tokens[:, i - 1] + 7) % VOCAB,
                                   torch.randint(0, VOCAB, (BATCH,), generator=gen))
    return tokens


def _train(seed: int, bf16: bool) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        precision = dict(bf16=True, params_dtype=torch.bfloat16) if bf16 else {}
        model = HybridModel(config(PATTERN, **precision), hybrid_stack_spec, VOCAB, SEQ,
                            hybrid_layer_pattern=PATTERN)
        module = Float16Module(model.config, model) if bf16 else model
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=bf16), module)
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0,
                                                     use_distributed_optimizer=True, **precision), [ddp])
        losses = [dp_train_step(ddp, opt, _tokens(step)) for step in range(STEPS)]
        names = {id(p): n for n, p in model.named_parameters()}
        mains = {names[id(e.model_param)]: (e.main_param.dtype, torch.equal(
            e.main_param.detach().to(e.model_param.dtype).view(-1),
            e.model_param.detach().view(-1)[e.param_range.start:e.param_range.end]))
            for e in opt._entries()}
        return {"losses": losses, "mains": mains}
    finally:
        parallel_state.destroy_model_parallel()


def _final(losses: list[float]) -> float:
    return sum(losses[-TAIL:]) / TAIL


@pytest.mark.slow  # four 50-step trainings, about 25 s on 2 cores
def test_bf16_training_ends_within_the_fp32_run_to_run_spread():
    fp32 = {seed: run_on_ranks(1, _train, seed, False)[0] for seed in SEEDS}
    bf16 = run_on_ranks(1, _train, SEEDS[0], True)[0]
    finals = [_final(r["losses"]) for r in fp32.values()]
    spread = max(finals) - min(finals)
    first = fp32[SEEDS[0]]["losses"][0]
    assert max(finals) < 0.8 * first, f"fp32 runs did not learn: {first:.3f} -> {finals}"
    got, want = _final(bf16["losses"]), _final(fp32[SEEDS[0]]["losses"])
    assert abs(got - want) <= spread, f"bf16 {got:.4f} vs fp32 {want:.4f}: outside the seeds' spread {spread:.4f}"
    mixer = {name: value for name, value in bf16["mains"].items() if ".mixer." in name}
    for piece in ("A_log", "D", "dt_bias", "conv1d_weight", "in_proj.weight"):
        assert any(name.endswith(piece) for name in mixer), piece
    for name, (dtype, rounds_to_model) in bf16["mains"].items():
        assert dtype == torch.float32, f"{name}: main param {dtype}"
        assert rounds_to_model, f"{name}: the model's bf16 weight is not its fp32 main param rounded"
