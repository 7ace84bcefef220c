"""One data-parallel training step of a tiny GPT under DDP + a Megatron optimizer (test helper)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import parallel_state


def dp_train_step(ddp, opt, tokens: torch.Tensor) -> float:
    """Train on this rank's share of ``tokens`` ``[B, S + 1]`` (inputs and shifted labels); the DP-mean loss."""
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    tokens = tokens.chunk(dp)[rank]
    seq = tokens.shape[1] - 1
    ddp.zero_grad_buffer()
    opt.zero_grad()
    positions = torch.arange(seq).unsqueeze(0).expand(tokens.shape[0], seq)
    loss = ddp(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    success, _, _ = opt.step()
    assert success
    reduced = loss.detach().reshape(1)
    dist.all_reduce(reduced, group=parallel_state.get_data_parallel_group())
    return reduced.item() / dp
