"""The example scripts (``pretrain_gpt.py``, ``main_job.py``) against bad flags and directories they must not touch.

Flag errors end the script before training with one line and exit status 2; directories holding
earlier outputs are left exactly as they were.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_core import parallel_state
from tests.reliability.tools_adversarial.conftest import fingerprint

TINY = ["--model-preset", "tiny", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--mock-data", "--vocab-size", "64", "--micro-batch-size", "1", "--no-progress"]

PRETRAIN_FLAGS = [
    # --train-iters 0 is allowed: it writes the initial model with --save (benchmarks/nccl_layout_parity.py).
    ("train-iters-negative", ["--train-iters", "-1"], "--train-iters (-1) must be >= 0"),
    ("eval-iters-negative", ["--train-iters", "2", "--eval-iters", "-1"], "--eval-iters (-1) must be >= 0"),
    ("eval-interval-negative", ["--train-iters", "2", "--eval-interval", "-5"], "--eval-interval (-5)"),
    ("log-interval-zero", ["--train-iters", "2", "--log-interval", "0"], "--log-interval (0) must be >= 1"),
    ("save-interval-zero", ["--train-iters", "2", "--save", "/tmp/never-written", "--save-interval", "0"],
     "--save-interval (0)"),
    ("micro-batch-zero", ["--train-iters", "2", "--micro-batch-size", "0"], "--micro-batch-size (0)"),
    ("lr-negative", ["--train-iters", "2", "--lr", "-0.1"], "--lr (-0.1)"),
    ("warmup-not-below-decay", ["--train-iters", "4", "--lr-warmup-iters", "4"],
     "--lr-warmup-iters (4) must be smaller than --lr-decay-iters (4"),
    ("global-batch-not-divisible", ["--train-iters", "2", "--micro-batch-size", "2", "--global-batch-size", "3"],
     "--global-batch-size (3)"),
    ("bf16-and-fp16", ["--train-iters", "2", "--bf16", "--fp16"], "exclusive"),
    ("save-interval-without-save", ["--train-iters", "2", "--save-interval", "1"], "--save-interval needs --save"),
    ("context-parallel-zero", ["--train-iters", "2", "--context-parallel-size", "0"], "--context-parallel-size (0)"),
    ("tensor-parallel-above-world", ["--train-iters", "2", "--tensor-model-parallel-size", "2"], "world size (1)"),
    ("hf-model-missing", ["--train-iters", "2", "--hf-model", "/nonexistent/hf"], "/nonexistent/hf"),
    ("load-missing", ["--train-iters", "2", "--load", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
    ("data-path-missing", ["--train-iters", "2", "--data-path", "/nonexistent/corpus", "--tokenizer-type",
                           "NullTokenizer"], "/nonexistent/corpus"),
]


def _pretrain(argv: list[str]) -> int:
    if dist.is_initialized():
        pytest.skip("a process group from another test is still up")
    import pretrain_gpt

    return pretrain_gpt.main(argv)


@pytest.mark.parametrize("name, flags, fragment", PRETRAIN_FLAGS, ids=[p[0] for p in PRETRAIN_FLAGS])
def test_pretrain_gpt_flag_errors(examples_path, capsys, name, flags, fragment) -> None:
    argv = [a for a in TINY if not (name == "data-path-missing" and a in ("--mock-data",))]
    assert _pretrain([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pretrain_gpt.py: error: ") and fragment in err, err
    assert "[train]" not in capsys.readouterr().out
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()


def test_pretrain_gpt_refuses_to_replace_published_checkpoints(examples_path, tmp_path, capsys) -> None:
    save = tmp_path / "ckpt"
    (save / "iter_0000010").mkdir(parents=True)
    (save / "iter_0000010" / "data.distcp").write_bytes(b"weights")
    (save / "latest_checkpointed_iteration.txt").write_text("10\n")
    before = fingerprint(save)
    assert _pretrain([*TINY, "--train-iters", "2", "--save", str(save)]) == 2
    err = capsys.readouterr().err
    assert "already holds checkpoints up to iteration 10" in err and "--load" in err
    assert fingerprint(save) == before


def _workdir(tmp_path, *names: str):
    work = tmp_path / "work"
    work.mkdir()
    for name in names:
        if name.endswith("/"):
            (work / name).mkdir()
            (work / name / "kept").write_text("x")
        else:
            (work / name).write_text("earlier output\n")
    return work


MAIN_JOB = [
    ("corpus-only", ["stdlib.jsonl"], [], "stdlib.jsonl"),
    ("tokenizer-only", ["tokenizer/"], [], "tokenizer/"),
    ("log-only", ["train_log.jsonl"], [], "train_log.jsonl"),
    ("plot-only", ["loss_curves.png"], [], "loss_curves.png"),
    ("checkpoints-without-tracker", ["checkpoints/"], [], "checkpoints/"),
    ("data-files", ["stdlib_text_document.bin", "stdlib_text_document.idx"], [], "stdlib_text_document.bin"),
    ("resume-without-earlier-run", ["train_log.jsonl"], ["--resume"], "lacks tokenizer"),
    ("corpus-mb-zero", [], ["--corpus-mb", "0"], "--corpus-mb (0.0)"),
    ("vocab-too-small", [], ["--vocab-size", "100"], "--vocab-size (100)"),
    ("eval-interval-zero", [], ["--eval-interval", "0"], "--eval-interval (0)"),
    ("warmup-negative", [], ["--lr-warmup-iters", "-1"], "--lr-warmup-iters (-1)"),
    ("train-iters-negative", [], ["--train-iters", "-3"], "--train-iters (-3)"),
]


@pytest.mark.parametrize("name, existing, flags, fragment", MAIN_JOB, ids=[m[0] for m in MAIN_JOB])
def test_main_job_refusals_touch_nothing(examples_path, tmp_path, capsys, name, existing, flags, fragment) -> None:
    import main_job

    work = _workdir(tmp_path, *existing)
    (work / "unrelated.txt").write_text("not the job's")
    before = fingerprint(work)
    assert main_job.main(["--workdir", str(work), "--train-iters", "5", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("main_job.py: error: ") and fragment in err, err
    assert fingerprint(work) == before


def test_main_job_workdir_is_a_file(examples_path, tmp_path, capsys) -> None:
    import main_job

    target = tmp_path / "work"
    target.write_text("a file")
    assert main_job.main(["--workdir", str(target), "--train-iters", "5"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert target.read_text() == "a file"
