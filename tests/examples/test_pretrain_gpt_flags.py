"""``examples/pretrain_gpt.py`` flags checked in one process: the profiler window and a fixed validation set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples.example_modules import TINY, gpt_training

pytestmark = pytest.mark.slow  # subprocess/torchrun training runs

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "pretrain_gpt.py"


def _run(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, *flags], cwd=tmp_path, text=True,
                          capture_output=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _valid_losses(log: Path) -> list[float]:
    return [r["validation loss"] for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "valid"]


def test_profile_window_prints_operators_and_writes_trace(tmp_path: Path) -> None:
    out = _run(tmp_path, "--train-iters", "4", "--eval-interval", "0", "--eval-iters", "1", "--profile",
               "--profile-step-start", "2", "--profile-step-end", "3", "--profile-dir", str(tmp_path / "prof"))
    assert "[profile] rank 0, steps 2-3 (2 steps)" in out.stdout
    assert "aten::mm" in out.stdout
    trace = tmp_path / "prof" / "trace_rank0_steps2-3.json"
    assert json.loads(trace.read_text())["traceEvents"]


def test_fixed_validation_set_repeats_the_same_batches(tmp_path: Path) -> None:
    # With a zero learning rate the weights never change, so only the batches can change the validation loss.
    common = ["--train-iters", "6", "--eval-interval", "2", "--eval-iters", "2", "--lr", "0", "--min-lr", "0"]
    _run(tmp_path, *common, "--fixed-validation-set", "--log-json", str(tmp_path / "fixed.jsonl"))
    _run(tmp_path, *common, "--log-json", str(tmp_path / "fresh.jsonl"))
    fixed, fresh = _valid_losses(tmp_path / "fixed.jsonl"), _valid_losses(tmp_path / "fresh.jsonl")
    assert len(fixed) == len(fresh) >= 3
    assert len(set(fixed)) == 1, fixed
    assert len(set(fresh)) > 1, fresh


@pytest.mark.parametrize("cuda, extra, expected", [
    (False, [], False),  # CPU: off
    (True, [], True),  # CUDA: on, as Megatron-LM's default
    (True, ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"], False),  # FSDP2 refuses it
    (True, ["--no-gradient-accumulation-fusion"], False),
    (False, ["--gradient-accumulation-fusion"], True),
], ids=["cpu-default", "cuda-default", "cuda-fsdp2", "cuda-off", "cpu-forced"])
def test_gradient_accumulation_fusion_default_follows_the_device(monkeypatch, cuda, extra, expected):
    arguments = gpt_training("arguments")
    monkeypatch.setattr(arguments, "cuda_available", lambda: cuda)
    args = arguments.validate_args(arguments.build_parser().parse_args([*TINY, "--train-iters", "1", *extra]), 1)
    assert args.gradient_accumulation_fusion is expected


def test_first_write_overwrites_stay_off_under_graphed_layers(monkeypatch):
    arguments = gpt_training("arguments")
    monkeypatch.setattr(arguments, "cuda_available", lambda: True)
    tiny = [*TINY, "--train-iters", "1"]
    plain = arguments.validate_args(arguments.build_parser().parse_args(tiny), 1)
    graphed = arguments.validate_args(arguments.build_parser().parse_args([*tiny, "--cuda-graph-impl", "local"]), 1)
    assert plain.overwrite_main_grad_on_first_wgrad and plain.gradient_accumulation_fusion
    assert graphed.gradient_accumulation_fusion and not graphed.overwrite_main_grad_on_first_wgrad


def _train_records(log: Path) -> list[dict]:
    return [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "train"]


def test_step_time_breakdown_reports_every_part_and_leaves_the_losses_alone(tmp_path: Path) -> None:
    # The distributed optimizer's flat step hands the loop its outcome before the update (a host copy per step);
    # the breakdown reads finished steps only and drops the evaluation's spans.
    common = ["--train-iters", "6", "--log-interval", "3", "--eval-interval", "3", "--eval-iters", "1",
              "--use-distributed-optimizer"]
    _run(tmp_path, *common, "--step-time-breakdown", "--log-json", str(tmp_path / "timed.jsonl"))
    _run(tmp_path, *common, "--log-json", str(tmp_path / "plain.jsonl"))
    timed, plain = _train_records(tmp_path / "timed.jsonl"), _train_records(tmp_path / "plain.jsonl")
    assert [r["iteration"] for r in timed] == [3, 6]
    for record in timed:
        assert record["fwd-bwd ms"] > 0 and record["optimizer ms"] > 0 and record["compute ms"] > 0, record
    assert [(r["lm loss"], r["grad norm"]) for r in timed] == [(r["lm loss"], r["grad norm"]) for r in plain]


def test_recompute_modules_and_moe_benchmark_flags_reach_the_config():
    arguments, model_builder = gpt_training("arguments"), gpt_training("model_builder")
    flags = [*TINY, "--train-iters", "1", "--num-experts", "4", "--recompute-granularity", "selective",
             "--recompute-modules", "moe_act", "shared_experts", "--moe-router-force-load-balancing",
             "--moe-shared-expert-intermediate-size", "16", "--disable-bias-linear"]
    config = model_builder.transformer_config_from_args(
        arguments.validate_args(arguments.build_parser().parse_args(flags), 1))
    assert config.recompute_modules == ["moe_act", "shared_experts"]
    assert config.moe_router_force_load_balancing
    default = model_builder.transformer_config_from_args(
        arguments.validate_args(arguments.build_parser().parse_args([*TINY, "--train-iters", "1"]), 1))
    assert default.recompute_modules == ["core_attn"] and not default.moe_router_force_load_balancing


def test_moe_use_upcycling_starts_a_moe_run_from_a_dense_checkpoint(tmp_path: Path) -> None:
    # Top-2 of 4 experts that are all the dense MLP, probabilities renormalised: the upcycled model is the dense
    # function, so its validation loss at the start equals the dense model's on the same fixed batches.
    common = ["--fixed-validation-set", "--eval-iters", "2", "--eval-interval", "0"]
    moe = ["--num-experts", "4", "--moe-router-topk", "2"]
    _run(tmp_path, *common, "--train-iters", "2", "--save", "dense", "--log-json", str(tmp_path / "dense.jsonl"))
    _run(tmp_path, *common, *moe, "--train-iters", "1", "--moe-use-upcycling", "--load", "dense", "--save", "moe",
         "--log-json", str(tmp_path / "moe.jsonl"))
    dense_loss, upcycled_loss = _valid_losses(tmp_path / "dense.jsonl"), _valid_losses(tmp_path / "moe.jsonl")
    assert len(dense_loss) == len(upcycled_loss) == 1
    assert abs(dense_loss[0] - upcycled_loss[0]) < 1e-5, (dense_loss, upcycled_loss)
    assert (tmp_path / "moe" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    # Later runs resume from the upcycled checkpoint; upcycling into it again is refused.
    _run(tmp_path, *common, *moe, "--train-iters", "2", "--load", "moe", "--save", "moe")
    again = subprocess.run([sys.executable, str(SCRIPT), *TINY, *common, *moe, "--train-iters", "3",
                            "--moe-use-upcycling", "--load", "dense", "--save", "moe"], cwd=tmp_path, text=True,
                           capture_output=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode != 0
    assert "already holds checkpoints (up to iteration 2)" in again.stderr


def test_moe_routing_trace_path_writes_a_trace_per_iteration(tmp_path: Path) -> None:
    # Megatron-LM's flags: every iteration's routing, stamped with the iterations done before it, up to the limit;
    # the validation passes are not recorded.
    _run(tmp_path, "--num-experts", "4", "--moe-router-topk", "2", "--train-iters", "3", "--eval-interval", "1",
         "--eval-iters", "1", "--moe-routing-trace-path", "trace", "--moe-routing-trace-max-training-iters", "2",
         "--moe-routing-trace-capture-logits", "--moe-routing-trace-dump-weights")
    trace = tmp_path / "trace"
    records = [json.loads(line) for line in (trace / "router_trace_rank0.jsonl").read_text().splitlines()]
    assert [(r["step"], r["layer"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {(r["num_tokens"], r["topk"], r["logit_shape"][1]) for r in records} == {(64, 2, 4)}
    assert all(len(row) == 2 and 0 <= min(row) and max(row) < 4 for r in records for row in r["top_indices"])
    assert (trace / "logits_rank0.bin").stat().st_size == sum(r["logit_bytes"] for r in records)
    assert (trace / "router_state_rank0.pt").exists() and not (trace / "hidden_states_rank0.bin").exists()


def test_mtp_num_layers_trains_and_logs_each_depth(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    _run(tmp_path, "--train-iters", "2", "--eval-interval", "0", "--eval-iters", "1", "--mtp-num-layers", "2",
         "--log-json", str(log))
    train = [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "train"]
    assert len(train) == 2
    for record in train:
        for depth in (1, 2):
            assert 3.0 < record[f"mtp_{depth} loss"] < 6.0, record  # about ln(127) for a fresh model
            assert 0.0 <= record[f"mtp_{depth} acceptance %"] <= 100.0


def test_deepseek_tiny_preset_trains_saves_and_resumes(tmp_path: Path) -> None:
    # MLA, a dense first layer then MoE layers (per-layer checkpoint keys), sigmoid routing, MTP: through a checkpoint.
    common = ["--model-preset", "deepseek-tiny", "--mock-data", "--vocab-size", "127", "--seq-length", "32",
              "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
              "--log-interval", "1", "--no-progress", "--eval-interval", "0", "--eval-iters", "1", "--save", "ckpt",
              "--log-json", str(tmp_path / "log.jsonl")]

    def run(*flags: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, str(SCRIPT), *common, *flags], cwd=tmp_path, text=True,
                              capture_output=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return proc

    run("--train-iters", "2", "--save-interval", "2")
    assert "start at 2" in run("--train-iters", "3", "--load", "ckpt").stdout
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["iteration"] for r in train] == [1, 2, 3]
    assert all("mtp_1 loss" in r and "load_imbalance" in r for r in train)


def test_moe_layer_freq_takes_megatron_lms_list_forms() -> None:
    parse_layer_freq = gpt_training("arguments").parse_layer_freq

    assert parse_layer_freq("2") == 2
    assert parse_layer_freq("[0,1,1]") == [0, 1, 1]
    assert parse_layer_freq("([0]*1+[1]*3)") == [0, 1, 1, 1]
    for bad in ("[0,2]", "__import__('os')", "0"):
        with pytest.raises(Exception, match="moe-layer-freq"):
            parse_layer_freq(bad)


@pytest.mark.parametrize("extra, overlap", [
    (["--num-layers-per-virtual-pipeline-stage", "1"], True),  # interleaved: overlapped and unbatched
    (["--num-layers-per-virtual-pipeline-stage", "1", "--no-overlap-p2p-communication"], False),
    ([], False),  # 1F1B has no overlapped exchange (Megatron-LM turns the flag off)
], ids=["interleaved", "interleaved-off", "1f1b"])
def test_p2p_overlap_follows_megatron_lms_rule(extra, overlap):
    arguments, model_builder = gpt_training("arguments"), gpt_training("model_builder")
    flags = [*TINY, "--num-layers", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
             "--train-iters", "1", *extra]
    config = model_builder.transformer_config_from_args(arguments.validate_args(arguments.build_parser().parse_args(flags), 2))
    assert config.overlap_p2p_comm is overlap and config.batch_p2p_comm is not overlap
