"""``pretrain_gpt.py --use-torch-fsdp2``: FSDP2 training equals DDP training, and the flag's rules.

The script's own ``setup(args)`` and training loop run in-process on two CPU ranks (DP=2, gloo,
fp32) on mock data: the losses of four steps under ``--use-torch-fsdp2`` equal those of plain DDP
on the same seed. A checkpoint saved at step 2 under FSDP2 resumes under DDP with the distributed
optimizer and gives the same losses for steps 3-4 (the checkpoint format is shared).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.dist_harness import run_on_ranks

pytestmark = pytest.mark.slow  # training runs of the example script

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
WORLD = 2
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--mock-data", "--vocab-size", "128", "--micro-batch-size", "1",
         "--global-batch-size", "4", "--log-interval", "1", "--eval-interval", "0", "--no-progress", "--lr", "1e-2",
         "--lr-warmup-iters", "1", "--lr-decay-iters", "4", "--untie-embeddings-and-output-weights", "--seed", "11",
         "--use-cpu-initialization"]


def _args(extra: list[str]):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from gpt_training.arguments import build_parser, validate_args

    return validate_args(build_parser().parse_args([*FLAGS, *extra]), dist.get_world_size())


def _train(extra: list[str], log_json: str) -> list[float]:
    from megatron_core import parallel_state

    args = _args(["--log-json", log_json, *extra])  # puts examples/ on the path
    import pretrain_gpt

    from gpt_training.logger import TrainingLogger
    from gpt_training.loop import Trainer
    try:
        run = pretrain_gpt.setup(args)
        trainer = Trainer(args, run.config, run.model, run.optimizer, run.scheduler, run.train_data_iterator, None,
                          TrainingLogger(args, dist.get_rank()), run.checkpointer)
        trainer.train(run.iteration, 0.0, None)
        run.checkpointer.finalize()
    finally:
        parallel_state.destroy_model_parallel()
    if dist.get_rank() != 0:
        return []
    return [r["lm loss"] for r in map(json.loads, Path(log_json).read_text().splitlines()) if r["kind"] == "train"]


def test_fsdp2_trains_like_ddp_and_its_checkpoint_resumes_under_ddp(tmp_path: Path) -> None:
    ddp = run_on_ranks(WORLD, _train, ["--train-iters", "4"], str(tmp_path / "ddp.jsonl"))[0]
    fsdp = run_on_ranks(WORLD, _train, ["--train-iters", "4", "--use-torch-fsdp2"], str(tmp_path / "fsdp.jsonl"))[0]
    assert len(ddp) == len(fsdp) == 4
    for step, (a, b) in enumerate(zip(fsdp, ddp), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), (step, fsdp, ddp)

    ckpt = str(tmp_path / "ckpt")
    run_on_ranks(WORLD, _train, ["--train-iters", "2", "--use-torch-fsdp2", "--save", ckpt, "--save-interval", "2"],
                 str(tmp_path / "first.jsonl"))
    resumed = run_on_ranks(WORLD, _train, ["--train-iters", "4", "--use-distributed-optimizer", "--load", ckpt],
                           str(tmp_path / "resumed.jsonl"))[0]
    assert len(resumed) == 2, resumed
    for step, (a, b) in enumerate(zip(resumed, fsdp[2:]), start=3):
        assert abs(a - b) <= 1e-5 * abs(b), (step, resumed, fsdp)


def _rule_error(extra: list[str]) -> str:
    try:
        _args(extra)
    except ValueError as err:
        return str(err)
    return ""


@pytest.mark.parametrize(("extra", "message"), [
    (["--pipeline-model-parallel-size", "2"], "not supported with pipeline parallelism"),
    (["--use-distributed-optimizer"], "cannot be combined with --use-distributed-optimizer"),
    (["--gradient-accumulation-fusion"], "not supported with --gradient-accumulation-fusion"),
    (["--fp16"], "does not support --fp16"),
])
def test_flag_rules_name_the_conflicting_flag(extra: list[str], message: str) -> None:
    errors = run_on_ranks(WORLD, _rule_error, ["--train-iters", "1", "--use-torch-fsdp2", *extra])
    assert all(message in e for e in errors), errors
