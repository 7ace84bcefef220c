"""MoE GPT under expert parallelism matches a single process: loss, every gradient and the step, fp32 on gloo.

Layouts on 4 ranks: EP=2, EP=4, EP=2 x TP=2 with expert-TP 1 and 2 (sequence parallel), each with
the all-gather or the all-to-all dispatcher, with and without the distributed optimizer. Every
data-parallel rank trains its own micro-batch; the reference runs the same micro-batches in one
process with the aux-loss scale ``1 / DP``. The library's SGD step (lr 1, clipping by the global
norm over dense and expert parameters together) makes ``param_before - param_after`` the clipped
gradient, so comparing parameters after the step checks every gradient. Routers' expert biases
(aux-loss-free balancing) must match after ``finalize_model_grads``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.transformer.moe import MoEAuxLossAutoScaler
from tests.dist_harness import run_on_ranks
from tests.transformer.moe.moe_parallel_utils import (
    batches,
    build,
    global_tensors,
    load_globals,
    local_vs_global,
)

WORLD = 4
CLIP = 0.05

# (flavour, tp, ep, etp, dispatcher, distributed optimizer)
CASES = [
    ("mixtral", 1, 2, 1, "allgather", False),
    ("deepseek", 1, 2, 1, "alltoall", True),
    ("mixtral", 1, 4, 1, "alltoall", False),
    ("deepseek", 1, 4, 1, "allgather", True),
    ("mixtral", 2, 2, 1, "alltoall", True),
    ("deepseek", 2, 2, 1, "allgather", False),
    ("mixtral", 2, 2, 2, "allgather", True),
    ("deepseek", 2, 2, 2, "alltoall", False),
]


def _expert_biases(model: torch.nn.Module) -> list[torch.Tensor]:
    return [m.expert_bias.clone() for m in model.modules() if getattr(m, "expert_bias", None) is not None]


# Capacity padding where each expert's capacity, ceil(T * top-k / E * 8), exceeds a micro-batch's T tokens: every
# expert then holds all T rows (``moe_utils.padded_expert_capacity``) and nothing is dropped.
CAPACITY_OVER_TOKENS = dict(moe_expert_capacity_factor=8.0, moe_pad_expert_input_to_capacity=True)
CAPACITY_CASES = [
    ("mixtral", 1, 2, 1, "alltoall", False, CAPACITY_OVER_TOKENS),
    ("mixtral", 1, 4, 1, "alltoall", True, CAPACITY_OVER_TOKENS),
]


def _reference(flavour: str, dp: int, **overrides) -> tuple[dict, list[torch.Tensor], dict, list[torch.Tensor]]:
    """Initial globals, per-micro-batch losses, globals after one clipped SGD step, expert biases after."""
    torch.manual_seed(1234)
    model = build(flavour, **overrides)
    before = global_tensors(model)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / dp))
    losses = []
    for ids, pos, labels in batches(dp):
        loss = model(ids, pos, None, labels=labels).mean()
        (loss / dp).backward()
        losses.append(loss.detach())
    params = [p for p in model.parameters()]
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params)).item()
    scale = min(1.0, CLIP / (norm + 1e-6))
    with torch.no_grad():
        for p in params:
            p.sub_(scale * p.grad)
    router_bias = []
    for m in model.modules():
        if getattr(m, "expert_bias", None) is not None:
            counts = m.local_tokens_per_expert
            router_bias.append(m.expert_bias + torch.sign(counts.mean() - counts) * m.config.moe_router_bias_update_rate)
    return before, losses, global_tensors(model), router_bias


def _check(cases: list) -> list[str]:
    done = []
    for flavour, tp, ep, etp, dispatcher, dist_opt, *extra in cases:
        overrides = extra[0] if extra else {}
        dp = WORLD // tp
        before, ref_losses, after, ref_bias = _reference(flavour, dp, **overrides)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=etp)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            model = build(flavour, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                          expert_tensor_parallel_size=etp, sequence_parallel=tp > 1,
                          moe_token_dispatcher_type=dispatcher, **overrides)
            load_globals(model, before)
            ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
                use_distributed_optimizer=dist_opt, grad_reduce_in_fp32=True), model)
            opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0,
                                                         clip_grad=CLIP, use_distributed_optimizer=dist_opt), [ddp])
            ddp.zero_grad_buffer()
            opt.zero_grad()
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
            ids, pos, labels = batches(dp)[parallel_state.get_data_parallel_rank()]
            loss = ddp(ids, pos, None, labels=labels).mean()
            loss.backward()
            finalize_model_grads([ddp])
            opt.step()
            tag = f"{flavour} tp={tp} ep={ep} etp={etp} {dispatcher} dist_opt={dist_opt} {overrides}"
            torch.testing.assert_close(loss.detach(), ref_losses[parallel_state.get_data_parallel_rank()],
                                       rtol=1e-5, atol=1e-5, msg=lambda m, t=tag: f"{t} loss: {m}")
            for key, local, ref in local_vs_global(model, after):
                if key.endswith("expert_bias"):  # a buffer, checked below against the reference's update
                    continue
                torch.testing.assert_close(local, ref, rtol=1e-5, atol=1e-5, msg=lambda m, k=key, t=tag: f"{t} {k}: {m}")
            for got, want in zip(_expert_biases(model), ref_bias, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-7, msg=lambda m, t=tag: f"{t} expert_bias: {m}")
            done.append(tag)
        finally:
            parallel_state.destroy_model_parallel()
    return done


@pytest.mark.parametrize("start", range(0, len(CASES), 2))
def test_expert_parallel_matches_single_process(start: int):
    cases = CASES[start:start + 2]
    results = run_on_ranks(WORLD, _check, cases)
    assert all(len(r) == len(cases) for r in results)


def test_alltoall_capacity_padding_beyond_the_tokens_matches_single_process():
    # The all-to-all's split sizes must use the router's padded capacity (every token), not the raw capacity.
    results = run_on_ranks(WORLD, _check, CAPACITY_CASES)
    assert all(len(r) == len(CAPACITY_CASES) for r in results)


def _capacity_rows_from_shapes(layouts: list[tuple[int, int]]) -> list[bool]:
    """The all-gather dispatcher padded to capacity: rows from the shapes equal rows from the host counts."""
    import dataclasses

    same = []
    for tp, ep in layouts:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            model = build("mixtral", tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                          sequence_parallel=tp > 1, moe_token_dispatcher_type="allgather",
                          moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
            ids, pos, labels = batches(WORLD)[torch.distributed.get_rank()]
            with torch.no_grad():
                static = model(ids, pos, None, labels=labels)
                for layer in model.decoder.layers:  # the dispatcher's other path: counts read on the host
                    dispatcher = layer.mlp.token_dispatcher
                    dispatcher.config = dataclasses.replace(dispatcher.config, moe_pad_expert_input_to_capacity=False)
                read = model(ids, pos, None, labels=labels)
            same.append(torch.equal(static, read))
        finally:
            parallel_state.destroy_model_parallel()
    return same


def test_allgather_capacity_padding_takes_its_row_count_from_the_shapes():
    assert run_on_ranks(WORLD, _capacity_rows_from_shapes, [(1, 2), (1, 4), (2, 2)]) == [[True] * 3] * WORLD
