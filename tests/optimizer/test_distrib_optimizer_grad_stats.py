"""The distributed optimizer reduces gradient statistics over its model's own groups, not over WORLD.

Four CPU ranks hold two independent 2-rank data-parallel jobs (ranks {0, 1} and {2, 3}, explicit
``pg_collection``, nothing in ``parallel_state``), trained on different data. Each job's gradient
norm must equal the single-process norm of that job's gradient; reduced over WORLD it would mix in
the other job's gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.process_groups_config import ProcessGroupCollection
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.transformer_config import TransformerConfig
from tests.dist_harness import run_on_ranks


class _Net(MegatronModule):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        torch.manual_seed(7)
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _data(job: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + job)
    return torch.randn(4, 8, generator=g) * (1 + 3 * job), torch.randn(4, 4, generator=g)


def _reference_norm(job: int) -> float:
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    net = _Net(config)
    x, y = _data(job)
    torch.nn.functional.mse_loss(net(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()]).norm().item()


def _job_norm() -> tuple[float, float, float]:
    rank = dist.get_rank()
    mine = None
    for ranks in ([0, 1], [2, 3]):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    job = rank // 2
    pgs = ProcessGroupCollection()
    pgs.dp = pgs.dp_cp = pgs.expt_dp = mine
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    model = _Net(config)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model,
                                  pg_collection=pgs)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.1, use_distributed_optimizer=True), [ddp],
                                       pg_collection=pgs)
    x, y = _data(job)
    ddp.zero_grad_buffer()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    ddp.finish_grad_sync()
    optimizer.prepare_grads()
    norm = optimizer.get_grad_norm()
    dist.destroy_process_group(mine)
    return norm, _reference_norm(job), _reference_norm(1 - job)


def test_grad_norm_is_reduced_over_the_jobs_own_groups_only():
    for rank, (norm, own, other) in enumerate(run_on_ranks(4, _job_norm)):
        assert abs(norm - own) <= 1e-5 * own, f"rank {rank}: grad norm {norm}, this job's {own}"
        assert abs(norm - (own ** 2 + other ** 2) ** 0.5) > 1e-3, f"rank {rank}: the norm mixes both jobs"
