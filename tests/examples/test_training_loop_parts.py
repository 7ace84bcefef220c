"""Pieces of ``examples/gpt_training/loop.py``: the prefetching batch iterator and the single-process exit decision."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from tests.dist_harness import run_on_ranks

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")


def _loop():
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from gpt_training import loop

    return loop


def _batches(n: int):
    return iter([{"tokens": torch.full((1, 4), i), "note": "not a tensor"} for i in range(n)])


def test_prefetched_batch_is_the_next_one_and_order_is_kept():
    batches = _loop()._PrefetchingDeviceIterator(_batches(3))
    assert int(next(batches)["tokens"][0, 0]) == 0
    batches.prefetch()
    batches.prefetch()  # a waiting batch is not replaced
    got = [int(b["tokens"][0, 0]) for b in batches]
    assert got == [1, 2]


def test_prefetch_past_the_end_raises_stop_iteration_on_next():
    batches = _loop()._PrefetchingDeviceIterator(_batches(1))
    assert set(next(batches)) == {"tokens"}  # to_device keeps the tensors only
    batches.prefetch()
    with pytest.raises(StopIteration):
        next(batches)


def _exit_decisions() -> list[bool]:
    loop = _loop()
    messages: list[str] = []
    trainer = types.SimpleNamespace(
        args=argparse.Namespace(exit_interval=3, exit_duration_in_mins=None, save=None),
        stop_requested=False, logger=types.SimpleNamespace(info=messages.append), host_group=None)
    decisions = [loop.Trainer._should_exit(trainer, iteration, time.time()) for iteration in (1, 2, 3)]
    trainer.args.exit_interval, trainer.stop_requested = None, True
    decisions.append(loop.Trainer._should_exit(trainer, 4, time.time()))
    assert messages == ["stopping at iteration 3: --exit-interval", "stopping at iteration 4: SIGTERM"]
    return decisions


def test_one_process_decides_to_exit_on_the_host():
    (decisions,) = run_on_ranks(1, _exit_decisions)
    assert decisions == [False, False, True, True]


def _sigterm_on_one_rank() -> list[bool]:
    import torch.distributed as dist

    loop = _loop()
    trainer = types.SimpleNamespace(
        args=argparse.Namespace(exit_interval=None, exit_duration_in_mins=None, save=None),
        stop_requested=False, logger=types.SimpleNamespace(info=lambda message: None), host_group=None)
    decisions = [loop.Trainer._should_exit(trainer, 1, time.time())]
    trainer.stop_requested = dist.get_rank() == 1  # only rank 1 got the signal
    decisions.append(loop.Trainer._should_exit(trainer, 2, time.time()))
    return decisions


def test_every_rank_stops_when_one_rank_gets_sigterm():
    assert run_on_ranks(2, _sigterm_on_one_rank) == [[False, True], [False, True]]


def test_manual_gc_turns_the_collector_off_while_training_and_collects_when_asked(monkeypatch):
    import gc

    loop = _loop()
    collected: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    args = argparse.Namespace(manual_gc=True, manual_gc_interval=2, manual_gc_eval=True)

    def _train(*unused):
        enabled_while_training = gc.isenabled()
        for iteration in (1, 2, 3, 4):
            loop.Trainer._collect_garbage(trainer, iteration)
        loop.Trainer._collect_garbage(trainer)  # around evaluation
        return enabled_while_training

    trainer = types.SimpleNamespace(args=args, _train=_train)
    assert gc.isenabled()
    assert loop.Trainer.train(trainer, 0, 0.0, None) is False
    assert gc.isenabled()  # back on afterwards
    assert len(collected) == 1 + 2 + 1  # at the start, at iterations 2 and 4, around evaluation
    args.manual_gc_eval, collected[:] = False, []
    loop.Trainer._collect_garbage(trainer)
    assert collected == []


def test_negative_manual_gc_interval_is_refused():
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from gpt_training.arguments import build_parser, validate_args

    flags = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--max-position-embeddings", "16", "--mock-data", "--vocab-size", "128", "--micro-batch-size", "1",
             "--train-iters", "1", "--manual-gc", "--manual-gc-interval", "-1"]
    with pytest.raises(ValueError, match=r"--manual-gc-interval \(-1\) must be >= 0"):
        validate_args(build_parser().parse_args(flags), 1)


def test_log_line_averages_the_loss_over_the_steps_that_updated_the_weights():
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from gpt_training.step_results import SettledStep, window_summary

    def step(iteration, loss, ok, norm, aux):
        return SettledStep(iteration, loss, ok, norm, True, {"load_balancing_loss": aux})

    window = [step(1, 4.0, True, 1.0, 0.5), step(2, float("nan"), False, float("nan"), 9.0), step(3, 2.0, True, 3.0, 1.5)]
    summary = window_summary(window)
    assert summary == {"lm loss": 3.0, "grad norm": 3.0, "load_balancing_loss": 1.0, "skipped steps": 1}
    only_skipped = window_summary([step(2, float("nan"), False, None, 9.0)])
    assert only_skipped["lm loss"] != only_skipped["lm loss"] and only_skipped["skipped steps"] == 1
    assert only_skipped["grad norm"] != only_skipped["grad norm"]  # no norm (a grad scaler's skip): nan
    with pytest.raises(ValueError, match="at least one settled step"):
        window_summary([])


def _mean_losses(per_rank: list[list[float]]) -> float:
    from megatron_core import parallel_state

    loop = _loop()
    parallel_state.initialize_model_parallel()
    try:
        rank = torch.distributed.get_rank()
        losses = [{"lm loss": torch.tensor(v)} for v in per_rank[rank]]
        return float(loop._mean_loss_tensor(losses))
    finally:
        parallel_state.destroy_model_parallel()


def test_mean_loss_averages_micro_batches_then_ranks():
    # rank 0: micro-batch losses 1 and 3 (mean 2); rank 1: 6 and 10 (mean 8); over both ranks: 5
    assert run_on_ranks(2, _mean_losses, [[1.0, 3.0], [6.0, 10.0]]) == [5.0, 5.0]


@contextlib.contextmanager
def _one_rank_nccl_group():
    """A one-process NCCL default group for the duration (skips where a non-NCCL one exists already)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() != "nccl":
        pytest.skip("this process already has a non-NCCL default group (its all_reduce copies through the host)")
    made_group = not dist.is_initialized()
    if made_group:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if made_group:
            dist.destroy_process_group()


@pytest.mark.gpu
def test_mean_loss_does_not_wait_for_the_gpu_cuda():
    # Item assignment into a CUDA tensor (value[1] = n) copied through the host and drained the GPU's queue
    # before every optimizer step; the average must be built by kernels only.
    loop = _loop()
    with _one_rank_nccl_group():
        losses = [{"lm loss": torch.tensor(v, device="cuda")} for v in (1.0, 3.0)]
        loop._mean_loss_tensor(losses)  # the first collective sets up the communicator
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            mean = loop._mean_loss_tensor(losses)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert float(mean) == 2.0


def _tiny_trainer(*flags: str):
    """``(Trainer, run)`` of ``pretrain_gpt.py``'s setup for a 2-layer model with the distributed optimizer and
    ``flags`` added (the default process group must exist; the caller destroys the model-parallel state)."""
    loop = _loop()
    import pretrain_gpt

    from gpt_training.arguments import build_parser, validate_args
    from gpt_training.logger import TrainingLogger

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--mock-data", "--vocab-size", "128", "--micro-batch-size", "2",
            "--eval-interval", "0", "--no-progress", "--use-distributed-optimizer"]
    args = validate_args(build_parser().parse_args([*base, *flags]), 1)
    run = pretrain_gpt.setup(args)
    trainer = loop.Trainer(args, run.config, run.model, run.optimizer, run.scheduler, run.train_data_iterator,
                           None, TrainingLogger(args, 0), None)
    return trainer, run


@pytest.mark.gpu
def test_a_training_step_does_not_wait_for_the_gpu_cuda():
    # bf16 with the distributed optimizer (the flat Adam step, clipping folded in) and the NaN check on: the
    # step's loss, norm and outcome stay on the device until the loop settles them at a log line.
    from megatron_core import parallel_state

    with _one_rank_nccl_group():
        trainer, _ = _tiny_trainer("--global-batch-size", "4", "--train-iters", "6", "--log-interval", "6", "--bf16")
        try:
            for iteration in (1, 2, 3):  # warm-up: the flat step's kernel, the communicator
                trainer.results.add(trainer.train_step(iteration))
            trainer.settle()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for iteration in (4, 5):
                    trainer.results.add(trainer.train_step(iteration))
            finally:
                torch.cuda.set_sync_debug_mode(0)
            last = trainer.settle()
            assert last.iteration == 5 and last.update_successful and last.grad_norm > 0, last
            assert torch.isfinite(torch.tensor(last.loss)), last
        finally:
            parallel_state.destroy_model_parallel()


def test_settle_reads_host_copies_and_unread_tensors_in_step_order():
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from gpt_training.step_results import HostCopy, QueuedStep, StepResults

    results = StepResults()
    copied = [torch.tensor(2.5), torch.tensor(True), torch.tensor(0.75), torch.tensor(0.125)]
    results.add(QueuedStep(1, torch.tensor(3.0), torch.tensor(False), torch.tensor(float("nan")), True,
                           {"aux": torch.tensor(0.5)}))
    results.add(QueuedStep(2, torch.tensor(-1.0), torch.tensor(False), None, True, {"aux": 9.0},
                           host_copy=HostCopy(copied)))  # the copy, not the fields, is what is read
    results.add(QueuedStep(3, 4.0, True, 1.5, False, {"aux": 0.25}))
    first, second, third = results.settle()
    assert (first.loss, first.update_successful, first.extra) == (3.0, False, {"aux": 0.5})
    assert first.grad_norm != first.grad_norm
    assert (second.loss, second.update_successful, second.grad_norm, second.extra) == (2.5, True, 0.75,
                                                                                       {"aux": 0.125})
    assert (third.loss, third.update_successful, third.grad_norm, third.scheduler_advanced) == (4.0, True, 1.5,
                                                                                                False)
    assert results.settle() == []
    assert HostCopy([torch.tensor(1.0), None, 2]).values() == [1.0, None, 2.0]
    with pytest.raises(ValueError, match="one device"):
        HostCopy([torch.tensor(1.0), torch.tensor(1.0, device="meta")])


def test_step_timers_read_whole_finished_steps_and_drop_what_followed_the_last():
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from gpt_training.step_timers import StepTimers, breakdown

    timers = StepTimers()
    assert timers.take_finished_steps() == ({name: 0.0 for name in StepTimers.NAMES}, 0)
    for _ in range(2):
        for name in ("forward-backward", "forward-compute", "forward-compute", "optimizer"):
            timers(name).start()
            timers(name).stop()
        timers.end_step()
    timers("forward-compute").start()  # an evaluation's span after the last step: not a training step's
    timers("forward-compute").stop()
    timers.discard()
    assert len(timers("forward-compute").spans) == 4
    totals, steps = timers.take_finished_steps()
    assert steps == 2 and set(totals) == set(StepTimers.NAMES) and all(v >= 0 for v in totals.values())
    assert all(not timers(name).spans for name in StepTimers.NAMES)
    timers("optimizer").start()
    timers("optimizer").stop()
    timers.end_step()
    record = breakdown(timers)
    assert record["optimizer ms"] >= 0 and record["fwd-bwd ms"] == 0.0 and not timers("optimizer").spans


@pytest.mark.gpu
def test_a_log_line_does_not_wait_for_the_optimizer_update_cuda():
    # The step's results are copied to the host before its update is queued: with the update held up on the GPU
    # (a sleep queued in front of it), settling the step returns while the update has not run.
    from megatron_core import parallel_state

    with _one_rank_nccl_group():
        trainer, run = _tiny_trainer("--global-batch-size", "2", "--train-iters", "4", "--log-interval", "4",
                                     "--bf16", "--check-for-nan-in-loss-and-grad")
        try:
            trainer.results.add(trainer.train_step(1))
            trainer.settle()
            inner = run.optimizer.step_with_ready_grads

            def slow_update():
                torch.cuda._sleep(1_000_000_000)  # ~0.5 s at 2 GHz
                return inner()

            run.optimizer.step_with_ready_grads = slow_update
            step = trainer.train_step(2)
            updated = torch.cuda.Event()
            updated.record()
            assert step.host_copy is not None
            trainer.results.add(step)
            last = trainer.settle()
            assert not updated.query(), "settling waited for the optimizer's update"
            assert last.iteration == 2 and last.update_successful and last.grad_norm > 0, last
            torch.cuda.synchronize()
        finally:
            parallel_state.destroy_model_parallel()


def test_a_step_hands_its_results_to_a_host_copy_before_the_update(monkeypatch):
    # CPU, one gloo rank, the flat distributed step forced on: the loop's copy is made when the optimizer announces
    # the outcome, and settling reads the same values as the returned tensors.
    import torch.distributed as dist

    from megatron_core import parallel_state
    from megatron_core.optimizer.distrib_optimizer import DistributedOptimizer

    if dist.is_initialized():
        pytest.skip("needs a fresh one-process group")
    monkeypatch.setattr(DistributedOptimizer, "flat_shard_step", True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer, _ = _tiny_trainer("--global-batch-size", "2", "--train-iters", "3", "--log-interval", "3",
                                   "--use-precision-aware-optimizer", "--check-for-nan-in-loss-and-grad")
        steps = [trainer.train_step(iteration) for iteration in (1, 2)]
        assert all(step.host_copy is not None for step in steps)
        expected = [(float(s.loss), bool(s.update_successful), float(s.grad_norm)) for s in steps]
        for step in steps:
            trainer.results.add(step)
        trainer.settle()
        settled = [(s.loss, s.update_successful, s.grad_norm) for s in trainer.settled_in_window]
        assert settled == expected and all(ok for _, ok, _ in settled)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
