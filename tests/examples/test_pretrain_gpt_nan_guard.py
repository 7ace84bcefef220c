"""``pretrain_gpt.py``'s ``--check-for-nan-in-loss-and-grad``: the optimizer skips the step and the loop stops.

The loop of ``examples/gpt_training`` runs in-process on two CPU ranks (DP=2) with a tiny GPT built
by the script's own ``setup(args)`` (its data iterator replaced by poisoned batches). Rank 1 alone gets a NaN at iteration 3: in its loss (a NaN in one
micro-batch's loss mask) or in one gradient (a tensor hook on one parameter, loss finite). Every
rank must raise ``RuntimeError`` naming iteration 3, with the weights of iteration 2 untouched; with
``--no-check-for-nan-in-loss-and-grad`` the optimizer skips the step and training goes on.
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_on_ranks

pytestmark = pytest.mark.slow  # subprocess/torchrun training runs

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
WORLD, BAD_RANK, BAD_ITERATION, VOCAB, SEQ = 2, 1, 3, 128, 16
FLAGS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--max-position-embeddings", str(SEQ), "--mock-data", "--vocab-size", str(VOCAB),
         "--micro-batch-size", "1", "--global-batch-size", "4", "--log-interval", "1", "--eval-interval", "0",
         "--no-progress", "--lr", "1e-2"]


def _batches(poison: dict[str, Any]) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches of random tokens; this rank's micro-batch of BAD_ITERATION is poisoned as asked."""
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    index = 0
    while True:
        iteration = index // poison["microbatches"] + 1
        tokens = torch.randint(0, VOCAB - 1, (1, SEQ + 1), generator=gen)
        loss_mask = torch.ones(1, SEQ)
        bad = dist.get_rank() == BAD_RANK and iteration == BAD_ITERATION and index % poison["microbatches"] == 0
        if bad and poison["kind"] == "loss":
            loss_mask[0, 0] = float("nan")
        poison["grad_now"] = bad and poison["kind"] == "grad"
        index += 1
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask,
               "position_ids": torch.arange(SEQ).unsqueeze(0)}


def _poison_grad(poison: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A tensor hook that puts a NaN into the gradient once, when ``_batches`` has armed it."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not poison["grad_now"]:
            return grad
        poison["grad_now"] = False
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad
    return hook


def _weights_sha256(chunks: list[torch.nn.Module]) -> str:
    digest = hashlib.sha256()
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            digest.update(name.encode())
            digest.update(param.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _train(kind: str, extra: list[str], log_json: str, flat_step: bool = False) -> dict[str, Any]:
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import pretrain_gpt

    from megatron_core.optimizer.distrib_optimizer import DistributedOptimizer

    # The flat step on CPU too: the update is then queued with its skip decision on the device, and the
    # optimizer hands the loop unread tensors, as on a GPU.
    DistributedOptimizer.flat_shard_step = True if flat_step else None

    from gpt_training.arguments import build_parser, validate_args
    from gpt_training.logger import TrainingLogger
    from gpt_training.loop import Trainer

    args = validate_args(build_parser().parse_args([*FLAGS, "--train-iters", "4", "--log-json", log_json, *extra]),
                         dist.get_world_size())
    run = pretrain_gpt.setup(args)
    config, chunks, optimizer, scheduler = run.config, run.model, run.optimizer, run.scheduler
    poison = {"kind": kind, "microbatches": args.num_microbatches, "grad_now": False}
    next(p for p in chunks[0].parameters() if p.requires_grad).register_hook(_poison_grad(poison))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        trainer = Trainer(args, config, chunks, optimizer, scheduler, _batches(poison), None,
                          TrainingLogger(args, dist.get_rank()), None)
        args.train_iters = BAD_ITERATION - 1
        trainer.train(0, 0.0, None)
        before = _weights_sha256(chunks)
        args.train_iters = 4
        error, reached = None, None
        try:
            reached = trainer.train(BAD_ITERATION - 1, 0.0, None)
        except RuntimeError as exc:
            error = str(exc)
        return {"error": error, "reached": reached, "unchanged": _weights_sha256(chunks) == before,
                "finite": all(bool(torch.isfinite(p).all()) for c in chunks for p in c.parameters()),
                "scheduler_steps": scheduler.num_steps, "global_batch": args.global_batch_size}
    finally:
        signal.signal(signal.SIGTERM, previous)
        DistributedOptimizer.flat_shard_step = None


@pytest.mark.parametrize(("kind", "extra", "message"), [
    ("loss", [], "iteration 3: the loss is nan; the optimizer skipped the step on every rank (weights unchanged)"),
    ("grad", ["--bf16", "--use-distributed-optimizer"], "iteration 3: the gradient norm is nan;"),
    ("grad", ["--clip-grad", "0"], "iteration 3: the gradient norm is nan;"),
], ids=["nan_loss_fp32", "nan_grad_bf16_distopt", "nan_grad_fp32_noclip"])
def test_every_rank_stops_before_the_step_naming_the_iteration(kind: str, extra: list[str], message: str,
                                                                tmp_path: Path) -> None:
    for rank, result in enumerate(run_on_ranks(WORLD, _train, kind, extra, str(tmp_path / "log.jsonl"))):
        assert result["error"] is not None and message in result["error"], (rank, result)
        assert result["unchanged"] and result["finite"], (rank, result)


def test_without_the_check_the_step_is_skipped_and_training_goes_on(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    for rank, result in enumerate(run_on_ranks(WORLD, _train, "loss", ["--no-check-for-nan-in-loss-and-grad"],
                                               str(log))):
        assert result["error"] is None and result["reached"] == 4, (rank, result)
        assert result["finite"] and not result["unchanged"], (rank, result)
    records = {r["iteration"]: r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "train"}
    assert records[BAD_ITERATION]["skipped steps"] == 1 and records[4]["skipped steps"] == 0, records
    assert records[BAD_ITERATION]["lm loss"] != records[BAD_ITERATION]["lm loss"]  # nan


DEFERRED = ["--use-distributed-optimizer", "--log-interval", "2"]


def test_with_results_left_on_the_device_the_check_runs_at_the_next_log_line(tmp_path: Path) -> None:
    # Iteration 3's loss is read at iteration 4's log line: step 4 has run (and updated the weights) by then.
    expected = ("iteration 3: the loss is nan; the optimizer skipped the step on every rank (weights unchanged by "
                "it; 1 later step(s) ran before this check at the log line)")
    for rank, result in enumerate(run_on_ranks(WORLD, _train, "loss", DEFERRED, str(tmp_path / "log.jsonl"), True)):
        assert result["error"] is not None and expected in result["error"], (rank, result)
        assert result["finite"] and not result["unchanged"], (rank, result)


def test_a_step_skipped_on_the_device_is_counted_and_takes_back_its_schedule_step(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    results = run_on_ranks(WORLD, _train, "loss", [*DEFERRED, "--no-check-for-nan-in-loss-and-grad"], str(log), True)
    for rank, result in enumerate(results):
        assert result["error"] is None and result["reached"] == 4 and result["finite"], (rank, result)
        assert result["scheduler_steps"] == 3 * result["global_batch"], (rank, result)  # 4 steps, 1 skipped
    records = {r["iteration"]: r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "train"}
    assert records[2]["skipped steps"] == 0 and records[4]["skipped steps"] == 1, records


def _check_flag_values() -> tuple[bool, bool]:
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from gpt_training.arguments import build_parser

    base = [*FLAGS, "--train-iters", "1"]
    return (build_parser().parse_args(base).check_for_nan_in_loss_and_grad,
            build_parser().parse_args([*base, "--no-check-for-nan-in-loss-and-grad"]).check_for_nan_in_loss_and_grad)


def test_the_check_is_on_by_default() -> None:
    # In a rank process, so that examples/ stays off this process's sys.path.
    assert run_on_ranks(WORLD, _check_flag_values) == [(True, False)] * WORLD
