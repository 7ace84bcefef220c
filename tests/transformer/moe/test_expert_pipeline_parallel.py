"""MoE GPT under EP=2 x PP=2 through the pipeline schedule matches a single process (fp32, gloo, 4 ranks).

Each data-parallel rank runs two micro-batches through the 1F1B schedule, which sets the aux-loss
backward scale to ``1 / num_microbatches``; ``finalize_model_grads`` (config hook) reduces dense,
expert and tied-embedding gradients and updates the routers' expert biases. One clipped SGD step
(lr 1) then makes every parameter's change its gradient, compared with the single-process reference.
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
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.transformer.moe import MoEAuxLossAutoScaler
from tests.dist_harness import run_on_ranks
from tests.transformer.moe.moe_parallel_utils import (
    SEQ,
    batches,
    build,
    global_tensors,
    load_globals,
    local_vs_global,
)

WORLD, PP, EP, MICRO = 4, 2, 2, 2
CLIP = 0.05


def _reference(flavour: str, dp: int) -> tuple[dict, list[torch.Tensor], dict, list[torch.Tensor]]:
    torch.manual_seed(1234)
    model = build(flavour)
    before = global_tensors(model)
    total = dp * MICRO
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / total))
    losses = []
    for ids, pos, labels in batches(total):
        loss = model(ids, pos, None, labels=labels).mean()
        (loss / total).backward()
        losses.append(loss.detach())
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters())).item()
    scale = min(1.0, CLIP / (norm + 1e-6))
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(scale * p.grad)
    biases = [m.expert_bias + torch.sign(m.local_tokens_per_expert.mean() - m.local_tokens_per_expert)
              * m.config.moe_router_bias_update_rate
              for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    return before, losses, global_tensors(model), biases


def _forward_step(data_iterator, model):
    ids, pos, labels = next(data_iterator)
    output = model(ids, pos, None, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _check(flavour: str, dispatcher: str, dist_opt: bool) -> str:
    dp = WORLD // PP
    before, ref_losses, after, ref_biases = _reference(flavour, dp)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=PP, expert_model_parallel_size=EP)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = build(flavour, pre_process=parallel_state.is_pipeline_first_stage(),
                      post_process=parallel_state.is_pipeline_last_stage(), pipeline_model_parallel_size=PP,
                      pipeline_dtype=torch.float32, expert_model_parallel_size=EP,
                      moe_token_dispatcher_type=dispatcher, finalize_model_grads_func=finalize_model_grads)
        load_globals(model, before)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=dist_opt, grad_reduce_in_fp32=True), model)
        model.config.no_sync_func = ddp.no_sync
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0,
                                                     clip_grad=CLIP, use_distributed_optimizer=dist_opt), [ddp])
        ddp.zero_grad_buffer()
        opt.zero_grad()
        dp_rank = parallel_state.get_data_parallel_rank()
        mine = batches(dp * MICRO)[dp_rank * MICRO:(dp_rank + 1) * MICRO]
        logs = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter(mine), model=[ddp], num_microbatches=MICRO,
            seq_length=SEQ, micro_batch_size=1, forward_only=False)
        opt.step()
        tag = f"{flavour} ep={EP} pp={PP} {dispatcher} dist_opt={dist_opt}"
        if parallel_state.is_pipeline_last_stage():
            got = torch.stack([d["lm loss"] for d in logs])
            want = torch.stack(ref_losses[dp_rank * MICRO:(dp_rank + 1) * MICRO])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{tag} losses: {m}")
        for key, local, ref in local_vs_global(model, after):
            if not key.endswith("expert_bias"):
                torch.testing.assert_close(local, ref, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{tag} {k}: {m}")
        offset = 0 if parallel_state.is_pipeline_first_stage() else 1  # one MoE layer per stage
        for m in model.modules():
            if getattr(m, "expert_bias", None) is not None:
                torch.testing.assert_close(m.expert_bias, ref_biases[offset], rtol=0, atol=1e-7,
                                           msg=lambda msg: f"{tag} expert_bias: {msg}")
        return tag
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("flavour,dispatcher,dist_opt", [("mixtral", "alltoall", True), ("deepseek", "allgather", False)])
def test_expert_and_pipeline_parallel_matches_single_process(flavour: str, dispatcher: str, dist_opt: bool):
    results = run_on_ranks(WORLD, _check, flavour, dispatcher, dist_opt)
    assert len(set(results)) == 1
