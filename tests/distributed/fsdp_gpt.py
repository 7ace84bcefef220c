"""A tiny Llama-like GPT trained under TorchFullyShardedDataParallel, and its single-process reference (test helper).

Both sides start from the same TP=1 weights (seed 1234) and train 3 AdamW steps with the library's
scheduler and gradient clipping on the same global batches (8 sequences a step). The FSDP side
runs each DP rank's share through the no-pipelining schedule in two microbatches (``no_sync`` on
the first), with ``finalize_model_grads``; the reference runs the whole batch at once with
``torch.optim.AdamW`` and ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import (
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron_core.pipeline_parallel import get_forward_backward_func
from tests.models.gpt_test_utils import SEQ, VOCAB, build, llama_like, shard, unshard

GLOBAL_BATCH, NUM_MICROBATCHES, STEPS = 8, 2, 3
LR, WD, CLIP = 1e-2, 0.1, 0.5


def scheduler(optimizer) -> OptimizerParamScheduler:
    """Warmup 2 steps from 1e-3, then linear decay: the same on both sides."""
    return OptimizerParamScheduler(optimizer, init_lr=1e-3, max_lr=LR, min_lr=1e-3, lr_warmup_steps=2,
                                   lr_decay_steps=10, lr_decay_style="linear", start_wd=WD, end_wd=WD,
                                   wd_incr_steps=10, wd_incr_style="constant")


def global_batch(step: int) -> torch.Tensor:
    """``[GLOBAL_BATCH, SEQ + 1]`` tokens of step ``step``."""
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)


def _positions(n: int) -> torch.Tensor:
    return torch.arange(SEQ).unsqueeze(0).expand(n, SEQ)


def reference(steps: int = STEPS, **overrides) -> tuple[dict, list[float], dict]:
    """``(initial TP=1 weights, per-step losses, final weights)`` of single-process training."""
    torch.manual_seed(1234)
    model = build(llama_like(**overrides))
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
                            lr=LR, weight_decay=WD, betas=(0.9, 0.999), eps=1e-8)
    sched = scheduler(opt)
    losses = []
    for step in range(steps):
        tokens = global_batch(step)
        opt.zero_grad()
        loss = model(tokens[:, :-1], _positions(GLOBAL_BATCH), None, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step(increment=1)
        losses.append(loss.item())
    return initial, losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def build_fsdp(initial: dict, tp: int, fsdp_config: dict | None = None, **overrides):
    """``(fsdp model, optimizer, scheduler)`` on this rank, loaded from the TP=1 weights ``initial``."""
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    spec = llama_like(**overrides)
    model = build(spec, tensor_model_parallel_size=tp)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard(name, initial[name], tp, tp_rank, True))
    config = model.config
    fsdp = TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(**(fsdp_config or {})), model)
    config.no_sync_func = fsdp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP), [fsdp])
    return fsdp, opt, scheduler(opt)


def train_step(model, opt, sched, step: int) -> float:
    """One step on this DP rank's share of global batch ``step``; returns the DP-averaged loss."""
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    local = GLOBAL_BATCH // dp
    mine = global_batch(step)[dp_rank * local:(dp_rank + 1) * local]
    batches = iter(mine.chunk(NUM_MICROBATCHES))

    def forward_step(data_iterator, chunk):
        tokens = next(data_iterator)
        output = chunk(tokens[:, :-1], _positions(tokens.shape[0]), None, labels=tokens[:, 1:])

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    model.zero_grad_buffer()
    opt.zero_grad()
    out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=batches, model=model,
                                      num_microbatches=NUM_MICROBATCHES, seq_length=SEQ,
                                      micro_batch_size=local // NUM_MICROBATCHES)
    success, _, _ = opt.step()
    assert success
    sched.step(increment=1)
    loss = torch.stack([d["lm loss"] for d in out]).mean().reshape(1)
    dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return loss.item() / dp


def full_weights(model, tp: int) -> dict[str, torch.Tensor]:
    """Every parameter gathered over DP (FSDP) and TP, in the TP=1 layout."""
    group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for name, param in model.module.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
        pieces = [torch.empty_like(full) for _ in range(tp)]
        dist.all_gather(pieces, full.contiguous(), group=group)
        out[name] = unshard(name, pieces, True)
    return out


def build_ddp(tp: int, seed: int = 4321, **overrides):
    """``(DDP model with the distributed optimizer, optimizer, scheduler)`` from fresh weights (seed ``seed``)."""
    from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = build(llama_like(**overrides), tensor_model_parallel_size=tp)
    config = model.config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP,
                                                 use_distributed_optimizer=True), [ddp])
    return ddp, opt, scheduler(opt)
