"""The combined 1F1B schedule on CUDA streams gives the plain schedule's losses and gradients.

One GPU: ``overlap_moe_expert_parallel_comm`` needs EP > 1 (Megatron-Core's rule), so the schedule function
(``combined_1f1b_schedule_for_no_pipelining``) is called directly on an EP=1 MoE GPT; on CUDA its
communication nodes run on the side stream. The same check runs on CPU (nodes in line). Two GPUs: the
flag itself, EP=2 over NCCL, through ``forward_backward_no_pipelining``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import tempfile
import traceback

import pytest
import torch

from megatron_core.pipeline_parallel.combined_1f1b import combined_1f1b_schedule_for_no_pipelining
from megatron_core.pipeline_parallel.schedules import forward_backward_no_pipelining
from tests.pipeline_parallel.combined_1f1b_utils import PlanRuns, micro_batches
from tests.transformer.moe.moe_parallel_utils import SEQ, build

MICRO = 3


def _forward_step(device: str):
    def step(data_iterator, model, return_schedule_plan: bool = False):
        ids, pos, labels = (t.to(device) for t in next(data_iterator))
        run = model.build_schedule_plan if return_schedule_plan else model
        output = run(ids, pos, None, labels=labels)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    return step


def _losses_and_grads(model: torch.nn.Module, combined: bool, device: str) -> tuple[torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    data = iter(micro_batches(0, MICRO))
    if combined:
        store: list = []
        with PlanRuns.record() as runs:
            combined_1f1b_schedule_for_no_pipelining(
                _forward_step(device), data, model, MICRO, None, None, store, model.config, False, None, False,
                contextlib.nullcontext, torch.zeros([], dtype=torch.int, device=device), lambda first: first)
        assert (runs.forward, runs.both, runs.backward) == (1, MICRO - 1, 1)
    else:
        store = forward_backward_no_pipelining(
            forward_step_func=_forward_step(device), data_iterator=data, model=model, num_microbatches=MICRO)
    if device == "cuda":
        torch.cuda.synchronize()
    return torch.stack([d["lm loss"] for d in store]), [p.grad.detach().clone() for p in model.parameters()]


def _compare(device: str, dtype: torch.dtype, rtol: float, atol: float) -> None:
    torch.manual_seed(1234)
    model = build("deepseek").to(device=device, dtype=dtype)
    plain_losses, plain_grads = _losses_and_grads(model, False, device)
    losses, grads = _losses_and_grads(model, True, device)
    torch.testing.assert_close(losses, plain_losses, rtol=rtol, atol=atol)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_schedule_function_matches_plain_schedule_on_cpu():
    _compare("cpu", torch.float32, 0.0, 0.0)


@pytest.mark.gpu
# Not bit for bit on CUDA: the unpermutation's backward adds with atomics, in either schedule.
@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float32, 1e-5, 1e-6), (torch.bfloat16, 2e-2, 2e-3)])
def test_schedule_function_on_cuda_streams_matches_plain_schedule(dtype: torch.dtype, rtol: float, atol: float):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    _compare("cuda", dtype, rtol, atol)


def _two_gpu_rank(rank: int, store_dir: str, results) -> None:
    try:
        from megatron_core import parallel_state, tensor_parallel
        from megatron_core.pipeline_parallel import get_forward_backward_func

        torch.cuda.set_device(rank)
        torch.distributed.init_process_group("nccl", init_method=f"file://{store_dir}/store", rank=rank, world_size=2)
        parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        out = []
        for overlap in (False, True):
            torch.manual_seed(1234)
            model = build("mixtral", expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall", bf16=True,
                          overlap_moe_expert_parallel_comm=overlap).cuda()
            logs = get_forward_backward_func()(
                forward_step_func=_forward_step("cuda"), data_iterator=iter(micro_batches(rank, MICRO)),
                model=[model], num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=1, forward_only=False)
            torch.cuda.synchronize()
            out.append((torch.stack([d["lm loss"] for d in logs]).cpu(), [p.grad.cpu() for p in model.parameters()]))
        (off_losses, off_grads), (on_losses, on_grads) = out
        torch.testing.assert_close(on_losses, off_losses, rtol=1e-5, atol=1e-5)
        for got, want in zip(on_grads, off_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        results.put((rank, "ok"))
    except Exception as err:
        results.put((rank, "".join(traceback.format_exception(err))))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.gpu
def test_flag_with_ep2_over_nccl_matches_flag_off():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as store_dir:
        procs = [context.Process(target=_two_gpu_rank, args=(rank, store_dir, results)) for rank in range(2)]
        for proc in procs:
            proc.start()
        try:
            answers = dict(results.get(timeout=300) for _ in procs)
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    assert answers == {0: "ok", 1: "ok"}, "\n".join(str(v) for v in answers.values())
