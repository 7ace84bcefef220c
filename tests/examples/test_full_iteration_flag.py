"""``pretrain_gpt.py --cuda-graph-impl full_iteration``: the example loop wraps its schedule in a
``FullCudaGraphWrapper``.

CPU: the flags that cannot be replayed from one graph are refused by name, and the wrapped loop (eager on the CPU)
trains exactly as the plain one. GPU: the same bit for bit, with the graph captured after the warm-up steps and
replayed (bf16, distributed optimizer, fused weight-gradient accumulation as the example sets them up on CUDA).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.full_cuda_graph import FullCudaGraphWrapper

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--mock-data", "--vocab-size", "128", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "6", "--log-interval", "6", "--eval-interval", "0",
        "--no-progress"]


def _examples_on_path() -> None:
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)


def _args(*flags: str, world_size: int = 1):
    _examples_on_path()
    from gpt_training.arguments import build_parser, validate_args

    return validate_args(build_parser().parse_args([*BASE, *flags]), world_size)


@pytest.mark.parametrize("flags, world_size, named", [
    (["--step-time-breakdown"], 1, "--step-time-breakdown"),
    (["--overlap-param-gather", "--overlap-grad-reduce"], 1, "--overlap-param-gather"),
    (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"], 1, "--use-torch-fsdp2"),
    (["--pipeline-model-parallel-size", "2"], 2, "--pipeline-model-parallel-size"),
    (["--cuda-graph-warmup-steps", "-1"], 1, "--cuda-graph-warmup-steps (-1)"),
])
def test_settings_a_graph_cannot_replay_are_refused_by_name(flags, world_size, named):
    with pytest.raises(ValueError) as caught:
        _args("--cuda-graph-impl", "full_iteration", *flags, world_size=world_size)
    assert named in str(caught.value), str(caught.value)
    if named != "--cuda-graph-warmup-steps (-1)":
        assert "full_iteration" in str(caught.value)


def _train(*flags: str) -> tuple[list[float], bool]:
    """Six steps of the example's tiny model; the per-step losses and whether the schedule was wrapped."""
    _examples_on_path()
    import pretrain_gpt

    from gpt_training import loop
    from gpt_training.logger import TrainingLogger

    args = _args("--use-distributed-optimizer", *flags)
    run = pretrain_gpt.setup(args)
    trainer = loop.Trainer(args, run.config, run.model, run.optimizer, run.scheduler, run.train_data_iterator,
                           None, TrainingLogger(args, 0), None)
    try:
        wrapped = isinstance(trainer.forward_backward, FullCudaGraphWrapper)
        losses = [float(trainer.train_step(iteration).loss) for iteration in range(1, 7)]
        return losses, wrapped
    finally:
        trainer.close()
        parallel_state.destroy_model_parallel()


def test_on_cpu_the_wrapped_loop_trains_as_the_plain_loop():
    if dist.is_initialized():
        pytest.skip("needs a process group of its own")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        graphed, wrapped = _train("--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "2")
        plain, plain_wrapped = _train()
    finally:
        dist.destroy_process_group()
    assert wrapped and not plain_wrapped
    assert graphed == plain, (graphed, plain)
    assert FullCudaGraphWrapper.curr_iteration["training"] == 0  # Trainer.close() reset the process-wide state


def _train_on_cuda(*flags: str) -> tuple[list[float], bool, int]:
    """:func:`_train` under a one-rank NCCL group, with how many times the schedule itself ran."""
    from megatron_core.pipeline_parallel import schedules

    calls = []
    inner = schedules.forward_backward_no_pipelining

    def counted(**kwargs):
        calls.append(1)
        return inner(**kwargs)

    schedules.forward_backward_no_pipelining = counted  # what get_forward_backward_func hands out
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        losses, wrapped = _train("--bf16", *flags)
        torch.cuda.synchronize()
        return losses, wrapped, len(calls)
    finally:
        dist.destroy_process_group()
        schedules.forward_backward_no_pipelining = inner


@pytest.mark.gpu
def test_on_cuda_the_graphed_loop_trains_exactly_as_the_plain_loop():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.cuda_process_group import in_fresh_process

    graphed, wrapped, graphed_calls = in_fresh_process(
        _train_on_cuda, "--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "2", nccl_group=False)
    plain, _, plain_calls = in_fresh_process(_train_on_cuda, nccl_group=False)
    assert wrapped
    assert plain_calls == 6 and graphed_calls == 3, (plain_calls, graphed_calls)  # 2 warm-ups, 1 capture, 3 replays
    assert graphed == plain, (graphed, plain)
