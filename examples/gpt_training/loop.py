"""The training loop of ``pretrain_gpt.py``: steps, evaluation, logging, checkpoints and exit conditions."""

from __future__ import annotations

import gc
import itertools
import math
import os
import signal
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

from gpt_training.data import to_device
from gpt_training.moe_metrics import moe_log_values
from gpt_training.mtp_metrics import mtp_log_values
from gpt_training.profiling import StepProfiler
from gpt_training.step_results import HostCopy, QueuedStep, SettledStep, StepResults, window_summary
from gpt_training.step_timers import StepTimers, breakdown, timed
from megatron_core import device, parallel_state
from megatron_core.full_cuda_graph import FullCudaGraphWrapper
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.progress import track
from megatron_core.training_metrics import model_flops_utilization
from megatron_core.transformer.moe.router_trace import get_moe_router_tracer
from megatron_core.utils import get_batch_on_this_cp_rank

# Test hook: every rank SIGKILLs itself at the end of this iteration (after its checkpoint, if any, is
# published), so a crash test stops the run at a known iteration instead of watching the tracker.
KILL_AT_ITERATION_ENV = "PRETRAIN_GPT_KILL_AT_ITERATION"


def kill_if_asked(iteration: int) -> None:
    """SIGKILL this process at the end of iteration ``$PRETRAIN_GPT_KILL_AT_ITERATION`` (crash tests only)."""
    target = os.environ.get(KILL_AT_ITERATION_ENV)
    if target is not None and iteration == int(target):
        os.kill(os.getpid(), signal.SIGKILL)


# Test hook: with this set to 1, a run that returns ends without the interpreter's teardown (see ``exit_run``).
FAST_EXIT_ENV = "PRETRAIN_GPT_FAST_EXIT"


def exit_run(status: int) -> None:
    """Exit the process with ``status``.

    With ``$PRETRAIN_GPT_FAST_EXIT=1`` (the test suite, which starts the script many times) the exit
    handlers run and the standard streams are flushed, then the process ends at once: freeing every module and
    object of a process that has torch loaded costs 1-1.5 s of CPU per rank, for nothing at exit.
    """
    if os.environ.get(FAST_EXIT_ENV) == "1":
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean per-token loss over the unmasked tokens of one micro-batch.

    Under context parallelism each rank holds part of every sequence: the token count (and the logged
    loss) is summed over the context-parallel group, the gradient flows through this rank's share.
    """
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    if parallel_state.get_context_parallel_world_size() > 1:
        local = torch.sum(losses * mask)
        totals = torch.stack([local.detach(), mask.sum()])
        dist.all_reduce(totals, group=parallel_state.get_context_parallel_group())
        count = totals[1].clamp(min=1)
        return local / count, {"lm loss": totals[0] / count}
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron's forward_step_func: one micro-batch through ``model``; the loss is built on the last stage.

    ``return_schedule_plan`` (the combined 1F1B schedule of ``overlap_moe_expert_parallel_comm``): return the
    micro-batch's schedule plan (``model.build_schedule_plan``) instead of running the model."""
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is not None and parallel_state.get_context_parallel_world_size() > 1:
        batch = get_batch_on_this_cp_rank(batch)  # this rank's load-balanced chunks of each sequence
    tokens = batch["tokens"] if batch is not None else None
    position_ids = batch["position_ids"] if batch is not None else None
    labels = batch["labels"] if batch is not None else None
    output = (model.build_schedule_plan if return_schedule_plan else model)(tokens, position_ids, None, labels=labels)
    loss_mask = batch["loss_mask"] if batch is not None else None
    return output, partial(loss_func, loss_mask)


class _DeviceIterator:
    """Wraps a batch iterator, moving each batch to this rank's device."""

    def __init__(self, iterator) -> None:
        self.iterator = iterator

    def __iter__(self):
        return self

    def __next__(self):
        return to_device(next(self.iterator))


class _PrefetchingDeviceIterator(_DeviceIterator):
    """A :class:`_DeviceIterator` that can load and start copying its next batch ahead of time.

    The training step calls :meth:`prefetch` once its forward and backward are queued and before it
    waits for the GPU (loss check, gradient norm): the host reads the next batch while the GPU is
    still busy, instead of after the wait, while the GPU idles.
    """

    _EXHAUSTED = object()

    def __init__(self, iterator) -> None:
        super().__init__(iterator)
        self._ready = None

    def prefetch(self) -> None:
        """Load the next batch now (no-op if one is waiting)."""
        if self._ready is None:
            try:
                self._ready = to_device(next(self.iterator))
            except StopIteration:
                self._ready = self._EXHAUSTED

    def __next__(self):
        ready, self._ready = self._ready, None
        if ready is self._EXHAUSTED:
            raise StopIteration
        return ready if ready is not None else super().__next__()


def _mean_loss_tensor(losses: list[dict], key: str = "lm loss") -> torch.Tensor:
    """Average of ``key`` over micro-batches on the last stage, then over all ranks, on every rank's device.

    Nothing goes through the host, either way: the per-micro-batch values are summed where they are, and the
    count is written by a kernel. (Item assignment such as ``value[1] = n`` or ``value[0] = tensor`` copies
    through the host and waits for every queued kernel: here it drained the GPU before each optimizer step.)
    """
    on = device.get_current_device()
    if parallel_state.is_pipeline_last_stage() and losses:
        total = torch.stack([torch.as_tensor(d[key]).detach().to(on, torch.float64).reshape(()) for d in losses]).sum()
        value = torch.stack([total, torch.full((), float(len(losses)), dtype=torch.float64, device=on)])
    else:
        value = torch.zeros(2, dtype=torch.float64, device=on)
    dist.all_reduce(value)
    return value[0] / value[1].clamp(min=1)


def _mean_loss(losses: list[dict], key: str = "lm loss") -> float:
    """:func:`_mean_loss_tensor` read on the host."""
    return float(_mean_loss_tensor(losses, key))


class Trainer:
    """Owns the model chunks, optimizer, scheduler and data iterators of one run."""

    def __init__(self, args, config, chunks, optimizer, scheduler, train_iter, valid_iter, logger, checkpointer):
        self.args, self.config, self.chunks = args, config, chunks
        self.optimizer, self.scheduler = optimizer, scheduler
        self.train_iter, self.valid_iter = train_iter, valid_iter
        # One chunk reads the training batches through one persistent iterator that can prefetch.
        self._train_batches = (_PrefetchingDeviceIterator(train_iter)
                               if len(chunks) == 1 and train_iter is not None else None)
        self.logger, self.checkpointer = logger, checkpointer
        self.forward_backward = get_forward_backward_func()
        if args.cuda_graph_impl == "full_iteration":  # one CUDA graph per stage after the warm-up (eager on CPU)
            self.forward_backward = FullCudaGraphWrapper(self.forward_backward, args.cuda_graph_warmup_steps,
                                                         config.cuda_graph_use_single_mempool)
        self.stop_requested = False
        self.timers = StepTimers() if args.step_time_breakdown else None
        self.results = StepResults()  # steps whose loss, gradient norm and outcome are not read yet
        # The per-step stop decision is a collective of host values: over gloo it never waits for the GPU (with
        # NCCL, reading its result would wait for every queued kernel). None: the default group is gloo already.
        self.host_group = (dist.new_group(backend="gloo")
                           if dist.get_world_size() > 1 and dist.get_backend() != "gloo" else None)
        self.settled_in_window: list[SettledStep] = []  # steps read since the last log line
        if self.timers is not None:  # the schedules time forward/backward through config.timers
            config.timers = self.timers
            if getattr(config, "finalize_model_grads_func", None) is not None:
                config.finalize_model_grads_func = timed(self.timers, "grads-sync", config.finalize_model_grads_func)
        self._previous_sigterm = signal.signal(signal.SIGTERM, self._request_stop)

    def _request_stop(self, signum, frame) -> None:
        self.stop_requested = True

    def close(self) -> None:
        """Give SIGTERM back to the handler it had before this trainer (a process that goes on, e.g. a test, and
        the children it forks later must not inherit a handler that only sets this trainer's flag), and drop the
        full-iteration CUDA graphs (process-wide: a later trainer captures its own)."""
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        if isinstance(self.forward_backward, FullCudaGraphWrapper):  # its graphs are process-wide: free them
            self.forward_backward.reset_cuda_graph()

    def _iterators(self, iterator):
        if iterator is self.train_iter and self._train_batches is not None:
            return self._train_batches
        if len(self.chunks) == 1:
            return _DeviceIterator(iterator)
        # Each virtual pipeline stage reads every micro-batch of the step (Megatron gives each model chunk its
        # own iterator over the same data): one tee'd copy of the stream per chunk. Every chunk runs the same
        # number of micro-batches, so after the step the copies are drained and the next step tees afresh.
        return [_DeviceIterator(copy) for copy in itertools.tee(iterator, len(self.chunks))]

    def _run(self, iterator, forward_only: bool) -> list[dict]:
        return self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=self._iterators(iterator),
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=self.args.num_microbatches,
            seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size,
            forward_only=forward_only,
        )

    def train_step(self, iteration: int) -> QueuedStep:
        """Step ``iteration`` (counted from 1): one optimizer step over a global batch, its results left unread.

        The loss is handed to the optimizer on the device (``skip_unless_finite``), which decides there whether
        to skip the update; the loss, gradient norm and outcome stay on the device until :meth:`settle` reads
        them (each log line, checkpoint and stop), so the host queues the next step while the GPU still runs
        this one. The learning-rate schedule advances now and is taken back for a step found skipped.
        """
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self._run(self.train_iter, forward_only=False)
        loss_tensor = _mean_loss_tensor(losses)  # averaged over all ranks, so every rank takes the same decision
        extra = moe_log_values(self.args) if self.args.num_experts is not None else {}
        if getattr(self.args, "mtp_num_layers", None):
            extra.update(mtp_log_values(self.args))
        check = self.args.check_for_nan_in_loss_and_grad
        step = self.optimizer.step_on_device
        if self.timers is not None:
            step = timed(self.timers, "optimizer", step)
        announced: list[tuple[torch.Tensor, HostCopy]] = []

        def copy_results(update_successful: torch.Tensor, norm: torch.Tensor) -> None:
            # Before the update is queued: a log line reading this copy does not wait for the update.
            announced.append((update_successful, HostCopy([loss_tensor, update_successful, norm, *extra.values()])))

        kwargs = {"skip_unless_finite": loss_tensor} if check else {}
        success, grad_norm, _ = step(outcome_known=copy_results, **kwargs)
        if self._train_batches is not None:
            self._train_batches.prefetch()  # the next step's first batch, while the GPU runs the update
        advanced = success is not False  # False: a skip already known on the host (a grad scaler's overflow)
        if advanced:
            self.scheduler.step(increment=self.args.global_batch_size)
        if self.timers is not None:
            self.timers.end_step()
        host_copy = announced[0][1] if announced and announced[0][0] is success else None
        return QueuedStep(iteration, loss_tensor, success, grad_norm, advanced, extra, host_copy)

    def settle(self) -> SettledStep | None:
        """Read the queued steps' results (one wait for the GPU); the last one, or None if none was queued.

        With ``--check-for-nan-in-loss-and-grad`` a non-finite loss, or a step the optimizer skipped for a
        non-finite gradient norm, raises ``RuntimeError`` on every rank naming the iteration; the optimizer
        skipped that step on every rank. Without the check a skipped step is counted and training goes on;
        its advance of the learning-rate schedule is taken back (the steps queued after it, up to the next
        log line, ran one schedule step ahead).
        """
        settled = self.results.settle()
        check = self.args.check_for_nan_in_loss_and_grad
        for position, step in enumerate(settled):
            problem = None
            if not math.isfinite(step.loss):
                problem = f"the loss is {step.loss}"
            elif not step.update_successful and step.grad_norm is not None and not math.isfinite(step.grad_norm):
                # (A grad scaler's skip, fp16 overflow, returns no norm and is routine; a non-finite norm is not.)
                problem = f"the gradient norm is {step.grad_norm}"
            if check and problem is not None:
                later = len(settled) - 1 - position
                weights = ("weights unchanged" if not later else
                           f"weights unchanged by it; {later} later step(s) ran before this check at the log line")
                raise RuntimeError(f"iteration {step.iteration}: {problem}; the optimizer skipped the step on every "
                                   f"rank ({weights}); stopping")
            if not step.update_successful and step.scheduler_advanced:
                self.scheduler.step(increment=-self.args.global_batch_size)
        self.settled_in_window.extend(settled)
        return settled[-1] if settled else None

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``--eval-iters`` global batches."""
        for chunk in self.chunks:
            chunk.eval()
        total = 0.0
        iterator = self.valid_iter() if callable(self.valid_iter) else self.valid_iter
        # A transient bar on a terminal (rank 0, tqdm installed); nothing extra in plain logs.
        for _ in track(range(self.args.eval_iters), self.args.eval_iters, "validation", unit="batch",
                       enabled=self.logger.progress, stream=sys.stdout, lines=0, transient=True):
            total += _mean_loss(self._run(iterator, forward_only=True))
        for chunk in self.chunks:
            chunk.train()
        if self.timers is not None:
            self.timers.discard()  # evaluation is not part of the training steps' breakdown
        return total / self.args.eval_iters

    def train(self, start_iteration: int, flops_per_token: float, peak: float | None) -> int:
        """Run until ``--train-iters``, a stop signal, ``--exit-interval`` or ``--exit-duration-in-mins``.

        With ``--manual-gc`` Python's threshold-triggered garbage collector is off for the duration: it collects
        every ``--manual-gc-interval`` steps and around evaluation (unless ``--no-manual-gc-eval``) instead.
        """
        if not self.args.manual_gc:
            return self._train(start_iteration, flops_per_token, peak)
        was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()
        try:
            return self._train(start_iteration, flops_per_token, peak)
        finally:
            if was_enabled:
                gc.enable()

    def _collect_garbage(self, iteration: int | None = None) -> None:
        """A manual collection: at ``--manual-gc-interval`` (given the iteration) or around evaluation (without)."""
        args = self.args
        if not args.manual_gc:
            return
        if iteration is None:
            due = args.manual_gc_eval
        else:
            due = args.manual_gc_interval > 0 and iteration % args.manual_gc_interval == 0
        if due:
            gc.collect()

    def _train(self, start_iteration: int, flops_per_token: float, peak: float | None) -> int:
        args = self.args
        start_time = time.time()
        iteration = start_iteration
        window_start, window_steps = time.time(), 0
        tokens_per_step = args.global_batch_size * args.seq_length
        profiler = StepProfiler(args)
        while iteration < args.train_iters:
            profiler.before_step(iteration + 1)
            self.results.add(self.train_step(iteration + 1))
            if get_moe_router_tracer() is not None:  # as Megatron-LM: the step id is the iterations done before it
                get_moe_router_tracer().advance_step(iteration)
            iteration += 1
            profiler.after_step(iteration)
            window_steps += 1
            if iteration % args.log_interval == 0 or iteration == args.train_iters:
                # The window ends when this step's results reach the host: its update may still be running (as
                # the previous window's last update was when this window began).
                self.settle()
                elapsed = time.time() - window_start
                tokens_per_s = tokens_per_step * window_steps / elapsed
                summary = window_summary(self.settled_in_window)
                skipped = summary.pop("skipped steps")
                record = {
                    **summary,
                    "lr": self.optimizer.param_groups[0]["lr"],
                    "loss scale": float(self.optimizer.get_loss_scale()),
                    "skipped steps": skipped,
                    "tokens/s": tokens_per_s, "ms/step": 1000 * elapsed / window_steps,
                }
                if peak is not None:
                    record["MFU %"] = 100 * model_flops_utilization(tokens_per_s, flops_per_token, peak,
                                                                    dist.get_world_size())
                    record["mem GB"] = device.max_memory_allocated() / 1e9
                if self.timers is not None:
                    record.update(breakdown(self.timers, self.host_group))
                self.logger.log(iteration, record)
                window_start, window_steps, self.settled_in_window = time.time(), 0, []
            self._collect_garbage(iteration)
            if args.eval_interval and args.eval_iters > 0 and iteration % args.eval_interval == 0:
                self._collect_garbage()
                self.logger.log(iteration, {"validation loss": self.evaluate()}, kind="valid")
                self._collect_garbage()
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                self.settle()  # a checkpoint holds only steps whose outcome was checked
                self.checkpointer.save(iteration)
            kill_if_asked(iteration)
            if self._should_exit(iteration, start_time):
                break
        self.settle()  # the steps after the last log line (a stop between log lines)
        return iteration

    def _should_exit(self, iteration: int, start_time: float) -> bool:
        args = self.args
        flags = torch.tensor([
            float(self.stop_requested),
            float(args.exit_interval is not None and iteration >= args.exit_interval),
            float(args.exit_duration_in_mins is not None
                  and (time.time() - start_time) / 60 >= args.exit_duration_in_mins),
        ])
        if dist.get_world_size() > 1:  # every rank agrees, over a host (gloo) group: the GPU's queue is not drained
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.host_group)
        if flags.any():
            reason = ["SIGTERM", "--exit-interval", "--exit-duration-in-mins"][int(flags.argmax())]
            self.logger.info(f"stopping at iteration {iteration}: {reason}")
            if args.save:
                self.settle()
                self.checkpointer.save(iteration)
            return True
        return False
