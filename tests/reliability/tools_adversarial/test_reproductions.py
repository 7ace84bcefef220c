"""Issue #46, the tools' reproductions 1-4, 6 and 7 (5 is ``test_model_config_record.py``).

Each test failed before its fix: the ZeroDivisionError that lost a trained run, ``main_job.py``
removing an earlier run's checkpoints, ``megatron-preprocess-data`` leaving a new ``.bin`` beside
an old ``.idx``, ``megatron-convert --overwrite`` removing files it never wrote, a full disk
reported as ``unexpected pos 704 vs 598``, and tracebacks where one line and exit status 2 were
promised.
"""

from __future__ import annotations

import errno
import json
import shutil
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_core.command_line import TRACEBACK_ENV
from megatron_core.datasets import IndexedDataset
from megatron_core.datasets import preprocess_data as preprocess_module
from megatron_core.datasets.preprocess_data import main as preprocess
from megatron_core.dist_checkpointing import CheckpointingException, manifest
from megatron_core.inference.cli.generate import main as generate
from megatron_core.models.hf.cli import main as convert
from megatron_core.training import load_checkpoint, read_tracker, save_checkpoint
from tests.dist_checkpointing.crash_saver import TinyModel
from tests.reliability.tools_adversarial.conftest import fingerprint

TINY = ["--model-preset", "tiny", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--mock-data", "--vocab-size", "64", "--make-vocab-size-divisible-by", "8",
        "--micro-batch-size", "1", "--no-progress", "--log-interval", "1"]


def _pretrain(argv: list[str]) -> int:
    if dist.is_initialized():
        pytest.skip("a process group from another test is still up")
    import pretrain_gpt

    return pretrain_gpt.main(argv)


def test_eval_iters_zero_trains_and_saves(tmp_path, examples_path, capsys) -> None:
    # Reproduction 1: five steps, then ZeroDivisionError in evaluate() before the final save; nothing saved.
    assert _pretrain([*TINY, "--train-iters", "5", "--eval-iters", "0", "--save", str(tmp_path / "ckpt")]) == 0
    assert read_tracker(tmp_path / "ckpt") == 5
    assert "validation" not in capsys.readouterr().out
    assert (tmp_path / "ckpt" / "iter_0000005" / "metadata.json").is_file()


def test_pretrain_saves_before_the_final_evaluation(tmp_path, examples_path, monkeypatch) -> None:
    # Whatever the final evaluation does, the trained state is already on disk.
    from gpt_training.loop import Trainer

    def broken(self):
        raise ZeroDivisionError("evaluation failed")

    monkeypatch.setattr(Trainer, "evaluate", broken)
    with pytest.raises(ZeroDivisionError):
        _pretrain([*TINY, "--train-iters", "2", "--eval-iters", "1", "--eval-interval", "0",
                   "--save", str(tmp_path / "ckpt")])
    if dist.is_initialized():
        dist.destroy_process_group()
    from megatron_core import parallel_state

    parallel_state.destroy_model_parallel()
    assert read_tracker(tmp_path / "ckpt") == 2


def _job_workdir(tmp_path):
    work = tmp_path / "work"
    (work / "checkpoints" / "iter_0000003").mkdir(parents=True)
    (work / "checkpoints" / "iter_0000003" / "data.distcp").write_bytes(b"weights")
    (work / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("3\n")
    (work / "stdlib.jsonl").write_text('{"text": "corpus"}\n')
    (work / "train_log.jsonl").write_text('{"kind": "valid"}\n')
    return work


def test_main_job_never_removes_an_earlier_run(tmp_path, examples_path, capsys) -> None:
    # Reproduction 2: rmtree of checkpoints/, stdlib.jsonl overwritten, train_log.jsonl deleted, then a failure.
    import main_job

    work = _job_workdir(tmp_path)
    before = fingerprint(work)
    assert main_job.main(["--workdir", str(work), "--train-iters", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "main_job.py: error:" in err
    assert "checkpoints/ (iteration 3)" in err and "train_log.jsonl" in err and "--resume" in err
    assert fingerprint(work) == before
    # The warm-up: clamped by default, a clear error when given and too long; nothing created.
    args = main_job.build_parser().parse_args(["--train-iters", "2"])
    assert main_job.warmup_iters(args) == 0
    fresh = tmp_path / "fresh"
    assert main_job.main(["--workdir", str(fresh), "--train-iters", "2", "--lr-warmup-iters", "20"]) == 2
    assert "--lr-warmup-iters (20) must be >= 0 and smaller than --train-iters (2)" in capsys.readouterr().err
    assert not fresh.exists()


def _jsonl(path, texts: list[str], bad_line: int | None = None) -> str:
    lines = [json.dumps({"text": t}) for t in texts]
    if bad_line is not None:
        lines[bad_line - 1] = '{"text": broken'
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _null_flags(source: str, prefix: str) -> list[str]:
    return ["--input", source, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
            "--workers", "1", "--log-interval", "0"]


def test_preprocess_rerun_failure_keeps_the_old_pair(tmp_path, capsys) -> None:
    # Reproduction 3: the .bin was overwritten in place, the old .idx stayed; the pair opened with wrong text.
    prefix = str(tmp_path / "out" / "corpus")
    good = _jsonl(tmp_path / "good.jsonl", [f"{i} {i + 1}" for i in range(40)])
    assert preprocess(_null_flags(good, prefix)) == 0
    before = fingerprint(tmp_path / "out")
    bad = _jsonl(tmp_path / "bad.jsonl", [f"{i} {i} {i} {i}" for i in range(40)], bad_line=30)
    assert preprocess(_null_flags(bad, prefix)) == 2
    err = capsys.readouterr().err
    assert f"{bad}:30: malformed JSON" in err
    assert fingerprint(tmp_path / "out") == before  # old pair untouched, temporaries gone
    dataset = IndexedDataset(prefix + "_text_document")
    assert len(dataset) == 40 and dataset[3].tolist() == [3, 4]


def test_preprocess_publishes_bin_then_idx(tmp_path, monkeypatch) -> None:
    # A crash between the two renames leaves no new .bin beside an old .idx: the old .idx goes first.
    prefix = str(tmp_path / "corpus")
    assert preprocess(_null_flags(_jsonl(tmp_path / "a.jsonl", ["1 2"] * 3), prefix)) == 0
    moves = []
    real_replace = preprocess_module.os.replace

    def replace(src, dst):
        moves.append(dst.rsplit(".", 1)[-1])
        if dst.endswith(".idx"):
            raise OSError(errno.EIO, "simulated crash before the .idx rename")
        real_replace(src, dst)

    monkeypatch.setattr(preprocess_module.os, "replace", replace)
    assert preprocess(_null_flags(_jsonl(tmp_path / "b.jsonl", ["5 6 7"] * 3), prefix)) == 2
    assert moves == ["bin", "idx"]
    assert not (tmp_path / "corpus_text_document.idx").exists()
    with pytest.raises((OSError, ValueError)):
        IndexedDataset(prefix + "_text_document")  # refuses to open; never reads new tokens through an old index
    assert not list(tmp_path.glob(".preprocess-*"))


def test_convert_overwrite_refuses_foreign_files(exported, tmp_path, capsys) -> None:
    # Reproduction 4: --overwrite deleted files and folders it did not write, without naming them.
    _, ckpt, export = exported
    out = tmp_path / "out"
    shutil.copytree(export, out)
    (out / "notes.txt").write_text("mine")
    (out / "eval").mkdir()
    (out / "eval" / "scores.json").write_text("{}")
    before = fingerprint(out)
    assert convert(["mcore-to-hf", "--mcore", str(ckpt), "--out", str(out), "--overwrite", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'eval'" in err and "'notes.txt'" in err and str(out) in err
    assert fingerprint(out) == before
    assert not list(tmp_path.glob("out.tmp-*"))
    # An earlier export alone is replaced.
    (out / "notes.txt").unlink()
    shutil.rmtree(out / "eval")
    assert convert(["mcore-to-hf", "--mcore", str(ckpt), "--out", str(out), "--overwrite", "--no-progress"]) == 0
    assert fingerprint(out) == fingerprint(export)


@pytest.mark.parametrize("fault", ["enospc", "torch_short_write"])
def test_disk_full_during_save_says_so_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, fault) -> None:
    # Reproduction 6: "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598".
    save = tmp_path / "ckpt"
    save_checkpoint(save, 1, TinyModel(1.0), None, None)
    before = fingerprint(save)
    real_write = manifest._HashingWriter.write
    written = [0]

    def write(self, data):
        written[0] += len(data)
        if written[0] > 4096:
            if fault == "enospc":
                raise OSError(errno.ENOSPC, "No space left on device")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_write(self, data)

    monkeypatch.setattr(manifest._HashingWriter, "write", write)
    monkeypatch.setattr("megatron_core.dist_checkpointing.disk_space.shutil.disk_usage",
                        lambda path: shutil._ntuple_diskusage(10**6, 10**6 - 2048, 2048))
    with pytest.raises(CheckpointingException) as caught:
        save_checkpoint(save, 2, TinyModel(2.0), None, None)
    message = str(caught.value)
    assert "no space left on device" in message and str(save / "iter_0000002") in message
    assert "2,048 bytes are free" in message and "writes about 18,720 bytes" in message  # (64x64+64+64x8+8) x 4
    assert fingerprint(save) == before  # the temporary directory is gone, checkpoint 1 and the tracker unchanged
    model = TinyModel(0.0)
    load_checkpoint(str(save), model, None, None, load_rng=False)
    assert read_tracker(save) == 1 and torch.equal(model.a.weight, torch.ones(64, 64))


CLI_USER_ERRORS = [
    (preprocess, ["--input", "/nonexistent/in.jsonl", "--output-prefix", "/tmp/x", "--tokenizer-type",
                  "NullTokenizer", "--vocab-size", "10", "--workers", "1"], "megatron-preprocess-data",
     "/nonexistent/in.jsonl does not exist"),
    (convert, ["hf-to-mcore", "--hf", "/nonexistent/hf", "--out", "/tmp/never"], "megatron-convert", "/nonexistent/hf"),
    (generate, ["--load", "/nonexistent/ckpt", "--prompt", "x"], "megatron-generate", "/nonexistent/ckpt"),
]


@pytest.mark.parametrize("main, argv, prog, what", CLI_USER_ERRORS, ids=["preprocess", "convert", "generate"])
def test_console_scripts_report_user_errors_in_one_line(main, argv, prog, what, capsys) -> None:
    # Reproduction 7: a traceback and exit 1 where one clear line and exit 2 were promised.
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error:") and what in err, err


def test_example_scripts_report_flag_errors_in_one_line(examples_path, capsys) -> None:
    assert _pretrain([*TINY, "--train-iters", "2", "--eval-iters", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == "pretrain_gpt.py: error: --eval-iters (-1) must be >= 0\n"
    import main_job

    assert main_job.main(["--train-iters", "0"]) == 2
    assert capsys.readouterr().err == "main_job.py: error: --train-iters (0) must be >= 1\n"


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch) -> None:
    def bug(args):
        raise KeyError("a bug in the tool")

    monkeypatch.setattr(preprocess_module, "preprocess", bug)
    source = _jsonl(tmp_path / "in.jsonl", ["1"])
    with pytest.raises(KeyError):
        preprocess(_null_flags(source, str(tmp_path / "p")))
    monkeypatch.undo()
    monkeypatch.setenv(TRACEBACK_ENV, "1")  # and a user error shows its traceback on request
    with pytest.raises(FileNotFoundError):
        preprocess(_null_flags(str(tmp_path / "missing.jsonl"), str(tmp_path / "p")))


def test_preprocess_console_script_exit_status(tmp_path) -> None:
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "megatron_core.datasets.preprocess_data", "--input",
                           str(tmp_path / "none.jsonl"), "--output-prefix", str(tmp_path / "p"), "--tokenizer-type",
                           "NullTokenizer", "--vocab-size", "10", "--workers", "1"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith("none.jsonl does not exist")
