"""A tensor-parallel MLP (column-parallel then row-parallel linear), checked against plain ``nn.Linear``.

Each rank holds a slice of both weights: ``fc1`` is split by output features, ``fc2`` by input
features, so the MLP needs one all-reduce in the forward pass (and one in the backward pass). With
``--sequence-parallel`` the activations outside the MLP are split along the sequence instead of
replicated, and the all-reduce becomes an all-gather plus a reduce-scatter::

    torchrun --nproc-per-node 2 examples/parallelism/tensor_parallel_mlp.py
    torchrun --nproc-per-node 4 examples/parallelism/tensor_parallel_mlp.py --sequence-parallel
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import parallel_state
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_from_sequence_parallel_region,
    model_parallel_cuda_manual_seed,
    scatter_to_sequence_parallel_region,
)
from megatron_core.utils import init_method_normal

SEQ, BATCH, HIDDEN, FFN = 8, 2, 16, 64


def _gather(shard: torch.Tensor, dim: int) -> torch.Tensor:
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def run(sequence_parallel: bool) -> float:
    """Build the TP MLP, run forward and backward, compare with one-process ``nn.Linear``; return the error."""
    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                                 use_cpu_initialization=True)
    init = init_method_normal(0.02)
    fc1 = ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=init, bias=True, gather_output=False)
    fc2 = RowParallelLinear(FFN, HIDDEN, config=config, init_method=init, bias=True, input_is_parallel=True,
                            skip_bias_add=False)

    torch.manual_seed(0)
    x = torch.randn(SEQ, BATCH, HIDDEN)           # [s, b, h], the same on every rank
    x_local = scatter_to_sequence_parallel_region(x) if sequence_parallel else x
    x_local = x_local.detach().requires_grad_()
    hidden, _ = fc1(x_local)                      # [s, b, ffn / tp]
    y_local, _ = fc2(F.gelu(hidden))              # [s / tp if SP else s, b, h]
    y_local.pow(2).sum().backward()
    y = gather_from_sequence_parallel_region(y_local.detach()) if sequence_parallel else y_local.detach()

    # The same MLP in one process, with the full weights gathered from the slices.
    ref1, ref2 = torch.nn.Linear(HIDDEN, FFN), torch.nn.Linear(FFN, HIDDEN)
    with torch.no_grad():
        ref1.weight.copy_(_gather(fc1.weight, 0))
        ref1.bias.copy_(_gather(fc1.bias, 0))
        ref2.weight.copy_(_gather(fc2.weight, 1))
        ref2.bias.copy_(fc2.bias)
    x_ref = x.clone().requires_grad_()
    y_ref = ref2(F.gelu(ref1(x_ref)))
    y_ref.pow(2).sum().backward()
    with torch.no_grad():
        errors = [
            (y - y_ref).abs().max(),
            (_gather(fc1.weight.grad, 0) - ref1.weight.grad).abs().max(),
            (_gather(fc2.weight.grad, 1) - ref2.weight.grad).abs().max(),
        ]
    return float(max(errors))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequence-parallel", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    error = run(args.sequence_parallel)
    if dist.get_rank() == 0:
        print(f"TP={dist.get_world_size()} sequence_parallel={args.sequence_parallel}: "
              f"max difference from nn.Linear {error:.2e}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
