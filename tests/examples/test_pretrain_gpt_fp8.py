"""FP8 in ``examples/pretrain_gpt.py`` (Megatron-LM's ``--fp8-*`` flags; float8 emulated in fp32 on the CPU).

The flags reach the config and the DDP config, the model's linear layers are converted before DDP (FP8 parameters
in one-byte buffers with ``--fp8-param-gather``), the flag rules name the flags, and a run trains within FP8's
rounding of the same run without FP8 (and not identically: the float8 rounding is really applied).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.examples.example_modules import TINY, gpt_training

pytestmark = pytest.mark.slow  # subprocess training runs

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt.py"
FP8_PARAM = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather",
             "--use-distributed-optimizer"]


def _example_modules():
    return gpt_training("arguments"), gpt_training("model_builder")


def _args(*extra: str, cuda: bool = False):
    arguments, _ = _example_modules()
    original = arguments.cuda_available
    arguments.cuda_available = lambda: cuda
    try:
        return arguments.validate_args(arguments.build_parser().parse_args([*TINY, "--train-iters", "1", *extra]), 1)
    finally:
        arguments.cuda_available = original


def test_fp8_flags_reach_the_config_and_set_the_fused_wgrad_default():
    _, model_builder = _example_modules()
    args = _args(*FP8_PARAM, "--fp8-margin", "1", "--fp8-amax-history-len", "8", cuda=True)
    # FP8 parameters keep the CUDA default (on): they add to main_grad, the bf16 layers take the fused GEMM
    assert args.gradient_accumulation_fusion is True
    assert _args(*FP8_PARAM).gradient_accumulation_fusion is False  # the CPU default
    # torchao's FP8 GEMMs return their weight gradients: off, though on by default on CUDA
    assert _args("--fp8-format", "hybrid", cuda=True).gradient_accumulation_fusion is False
    config = model_builder.transformer_config_from_args(args)
    assert (config.fp8, config.fp8_recipe, config.fp8_param, config.fp8_margin, config.fp8_amax_history_len) == \
        ("hybrid", "tensorwise", True, 1, 8)
    assert model_builder.ddp_config_from_args(args).fp8_param_gather is True
    plain = model_builder.transformer_config_from_args(_args())
    assert plain.fp8 is None and plain.fp8_param is False


@pytest.mark.parametrize("extra, names", [
    (["--fp8-format", "hybrid", "--gradient-accumulation-fusion"],
     ["--gradient-accumulation-fusion", "--fp8-format", "--fp8-param-gather"]),
    (["--fp8-param-gather"], ["--fp8-param-gather", "--fp8-format"]),
])
def test_fp8_flag_rules_name_the_flags(extra, names):
    with pytest.raises(ValueError) as err:
        _args(*extra)
    for name in names:
        assert name in str(err.value), str(err.value)


def _built_model_state(flags: list[str]) -> dict:
    from megatron_core import parallel_state
    from megatron_core.distributed.fp8_params import is_fp8_param

    arguments, model_builder = _example_modules()
    args = arguments.validate_args(arguments.build_parser().parse_args([*TINY, "--train-iters", "1", *flags]), 1)
    parallel_state.initialize_model_parallel()
    try:
        torch.manual_seed(0)
        config = model_builder.transformer_config_from_args(args)
        (ddp,) = model_builder.build_model(args, config, args.vocab_size)
        weights = [(name, p.dtype) for name, p in ddp.named_parameters() if is_fp8_param(p)]
        return dict(fp8_weights=weights, buffer_dtypes=sorted(str(b.param_data.dtype) for b in ddp.buffers),
                    linears=sorted({type(m).__name__ for m in ddp.modules() if "Linear" in type(m).__name__}))
    finally:
        parallel_state.destroy_model_parallel()


def test_the_model_is_converted_before_ddp_with_fp8_weights_in_byte_buffers():
    (state,) = run_on_ranks(1, _built_model_state, FP8_PARAM)
    # every linear weight of the two transformer layers: QKV, projection, fc1, fc2
    assert len(state["fp8_weights"]) == 8, state
    assert all(dtype == torch.float8_e4m3fn for _, dtype in state["fp8_weights"]), state
    assert "torch.uint8" in state["buffer_dtypes"], state
    (plain,) = run_on_ranks(1, _built_model_state, ["--use-distributed-optimizer"])
    assert plain["fp8_weights"] == [] and "torch.uint8" not in plain["buffer_dtypes"], plain


def _losses(tmp_path: Path, name: str, *flags: str) -> list[float]:
    log = tmp_path / f"{name}.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--train-iters", "6", "--lr", "1e-3",
                           "--log-json", str(log), *flags], cwd=tmp_path, text=True,
                          capture_output=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [r["lm loss"] for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "train"]


def test_fp8_param_run_trains_within_fp8_rounding_of_the_plain_run(tmp_path: Path) -> None:
    fp8 = _losses(tmp_path, "fp8", *FP8_PARAM)
    plain = _losses(tmp_path, "plain", "--use-distributed-optimizer")
    assert len(fp8) == len(plain) == 6
    assert fp8 != plain  # the float8 rounding is applied
    for got, want in zip(fp8, plain):
        assert abs(got - want) / want < 1e-2, (fp8, plain)
    assert fp8[-1] < fp8[0]
