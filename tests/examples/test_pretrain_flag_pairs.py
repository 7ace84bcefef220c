"""Regressions of ``tools/pretrain_flag_matrix.py``: flag pairs of ``pretrain_gpt.py`` that hung, crashed deep in the
library or were silently ignored, now either train or are refused by ``validate_args`` with the flags' names."""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.tensor_parallel.random import checkpoint
from tests.examples.example_modules import EXAMPLES, gpt_training

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--mock-data", "--vocab-size", "128", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--train-iters", "2", "--log-interval", "1", "--eval-interval", "0",
        "--eval-iters", "0", "--no-progress"]


def _args(*flags: str, world_size: int = 1):
    arguments = gpt_training("arguments")
    return arguments.validate_args(arguments.build_parser().parse_args([*BASE, *flags]), world_size)


# ------------------------------------------------------------------------------------------- refused by name


@pytest.mark.parametrize("flags, world_size, named", [
    # the library raised naming add_bias_linear, while building the model
    (["--num-experts", "4", "--moe-shared-expert-intermediate-size", "32"], 1,
     ["--moe-shared-expert-intermediate-size (32)", "--disable-bias-linear"]),
    (["--moe-shared-expert-intermediate-size", "32", "--disable-bias-linear"], 1,
     ["--moe-shared-expert-intermediate-size (32)", "--num-experts"]),
    # MoE under TP without SP: a ValueError at the first training forward
    (["--num-experts", "4", "--disable-bias-linear", "--tensor-model-parallel-size", "2"], 2,
     ["--num-experts", "--tensor-model-parallel-size 2", "--sequence-parallel"]),
    # expert biases under expert TP > 1: named by config fields only
    (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
     ["--num-experts", "--expert-tensor-parallel-size", "--disable-bias-linear"]),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "2", "--global-batch-size", "4"], 2,
     ["--expert-tensor-parallel-size", "--disable-bias-linear"]),
    # FSDP2 with MoE: refused by TorchFullyShardedDataParallel naming expert_model_parallel_size=1
    (["--num-experts", "4", "--use-torch-fsdp2", "--untie-embeddings-and-output-weights"], 2,
     ["--use-torch-fsdp2", "--num-experts (4)"]),
    # graphs with MoE / SP: refused by TransformerConfig naming its fields
    (["--num-experts", "4", "--cuda-graph-impl", "local"], 1, ["--cuda-graph-impl local", "--num-experts (4)"]),
    (["--num-experts", "4", "--cuda-graph-impl", "full_iteration"], 1,
     ["--num-experts", "full_iteration", "--moe-grouped-gemm"]),
    (["--num-experts", "4", "--moe-grouped-gemm", "--cuda-graph-impl", "full_iteration"], 1,
     ["--num-experts", "full_iteration", "fp32"]),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--cuda-graph-impl", "full_iteration"], 2,
     ["--sequence-parallel", "full_iteration"]),
    # GQA flags under MLA were silently ignored
    (["--multi-latent-attention", "--num-query-groups", "2"], 1, ["--num-query-groups (2)", "--multi-latent-attention"]),
    (["--multi-latent-attention", "--group-query-attention"], 1, ["--group-query-attention", "--multi-latent-attention"]),
    # --rotary-percent under MLA's default YaRN rotary embedding was silently ignored
    (["--multi-latent-attention", "--rotary-percent", "0.5"], 1, ["--rotary-percent (0.5)", "--rope-type"]),
    # recompute under CUDA graphs: refused by TransformerConfig naming recompute_granularity and cuda_graph_impl
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
      "--cuda-graph-impl", "full_iteration"], 1, ["--recompute-granularity full", "--cuda-graph-impl full_iteration"]),
    (["--recompute-granularity", "selective", "--cuda-graph-impl", "full_iteration"], 1,
     ["--recompute-granularity selective", "--cuda-graph-impl full_iteration"]),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
      "--cuda-graph-impl", "local"], 1, ["--recompute-granularity full", "--cuda-graph-impl local"]),
    (["--attention-dropout", "0.1", "--cuda-graph-impl", "full_iteration"], 1,
     ["--attention-dropout 0.1", "--cuda-graph-impl full_iteration"]),
    # the precision-aware optimizer's rules: refused by OptimizerConfig naming its fields
    (["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--optimizer", "sgd"], 2,
     ["--use-precision-aware-optimizer", "--optimizer sgd"]),
    (["--use-precision-aware-optimizer"], 1, ["--use-precision-aware-optimizer", "--use-distributed-optimizer"]),
    (["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "fp16"], 1,
     ["--exp-avg-dtype bf16, --exp-avg-sq-dtype fp16", "--use-precision-aware-optimizer"]),
    (["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--main-params-dtype", "fp16"], 1,
     ["--main-params-dtype (fp16)"]),
    (["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"], 1,
     ["--main-grads-dtype (bf16)", "--main-params-dtype (fp32)"]),
    # FP8 parameters: refused by check_fp8_config / DistributedDataParallelConfig naming fp8_param(_gather)
    (["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-param-gather", "--use-distributed-optimizer"], 1,
     ["--fp8-param-gather", "--fp8-recipe tensorwise", "--fp8-recipe delayed"]),
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather"], 1,
     ["--fp8-param-gather", "--use-distributed-optimizer"]),
])
def test_pairs_the_library_cannot_build_are_refused_by_name(flags, world_size, named):
    with pytest.raises(ValueError) as caught:
        _args(*flags, world_size=world_size)
    for name in named:
        assert name in str(caught.value), str(caught.value)


@pytest.mark.parametrize("flags, world_size", [
    (["--num-experts", "4", "--moe-shared-expert-intermediate-size", "32", "--disable-bias-linear"], 1),
    (["--num-experts", "4", "--disable-bias-linear", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--expert-tensor-parallel-size", "1"], 2),
    (["--multi-latent-attention"], 1),
    (["--model-preset", "deepseek-tiny", "--seq-length", "32", "--max-position-embeddings", "32"], 1),
    (["--recompute-granularity", "selective", "--cuda-graph-impl", "local"], 1),
    (["--num-experts", "4", "--moe-grouped-gemm", "--bf16", "--cuda-graph-impl", "full_iteration"], 1),
    (["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16",
      "--main-params-dtype", "bf16", "--exp-avg-dtype", "fp16"], 1),
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather", "--use-distributed-optimizer"],
     2),
])
def test_the_valid_forms_still_pass(flags, world_size):
    _args(*flags, world_size=world_size)


def test_rotary_percent_reaches_mla_with_plain_rope():
    # MLA builds its rotary embedding from the config (as Megatron-Core 0.19): the flag must reach the config.
    args = _args("--multi-latent-attention", "--rope-type", "rope", "--rotary-percent", "0.5")
    assert gpt_training("model_builder").transformer_config_from_args(args).rotary_percent == 0.5


# ------------------------------------------------------------------------------------------- library fixes


def test_checkpoint_hands_a_passed_through_parameter_back_as_itself():
    # A function returning a parameter unchanged (the MLP's skip_bias_add bias): the parameter must stay a leaf and
    # get its gradient once, exactly as without recompute; before the fix it became the function's output and the
    # backward recomputed into itself without end.
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))

    def layer(x):  # also a view of its input, which is no leaf of its own and keeps flowing through the function
        return torch.tanh(x @ weight), bias, x.view(-1)

    def loss_of(out, out_bias, x_flat):
        return ((out + out_bias) ** 2).sum() + (x_flat ** 3).sum()

    x = torch.randn(3, 4, requires_grad=True)
    loss_of(*layer(x)).backward()
    expected = [t.grad.clone() for t in (weight, bias, x)]
    for t in (weight, bias, x):
        t.grad = None
    out, out_bias, x_flat = checkpoint(layer, False, x)
    assert out_bias is bias and bias.is_leaf and bias.grad_fn is None
    loss_of(out, out_bias, x_flat).backward()
    for got, want in zip((weight.grad, bias.grad, x.grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _pretrain_gpt():
    """The ``examples/pretrain_gpt.py`` module."""
    sys.path.insert(0, EXAMPLES)
    try:
        return importlib.import_module("pretrain_gpt")
    finally:
        sys.path.remove(EXAMPLES)


def _train_losses(*flags: str, world_size: int = 1, iterations: tuple[int, ...] = (1, 2),
                  save_at: int | None = None) -> list[float]:
    """Steps ``iterations`` of ``pretrain_gpt``'s tiny model in this process (``--load`` in ``flags`` resumes);
    the per-step losses. ``save_at``: save a checkpoint (``--save`` in ``flags``) after that step, as the loop does
    at an exit, before any later forward."""
    pretrain_gpt = _pretrain_gpt()
    loop, logger = gpt_training("loop"), gpt_training("logger")
    args = _args(*flags, world_size=world_size)
    run = pretrain_gpt.setup(args)
    trainer = loop.Trainer(args, run.config, run.model, run.optimizer, run.scheduler, run.train_data_iterator,
                           None, logger.TrainingLogger(args, dist.get_rank()), run.checkpointer)
    try:
        losses = []
        for iteration in iterations:
            losses.append(float(trainer.train_step(iteration).loss))
            if iteration == save_at:
                trainer.settle()
                run.checkpointer.save(iteration)
        return losses
    finally:
        trainer.close()
        parallel_state.destroy_model_parallel()


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group for in-process training runs (skipped where a group exists already)."""
    if dist.is_initialized():
        pytest.skip("needs a process group of its own")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_selective_mlp_recompute_with_biases_trains_as_without_recompute(one_rank_group):
    # --recompute-modules mlp with the default biased linear layers hung in the first backward.
    plain = _train_losses()
    recomputed = _train_losses("--recompute-granularity", "selective", "--recompute-modules", "mlp")
    assert all(math.isfinite(v) for v in recomputed)
    assert recomputed == pytest.approx(plain, rel=1e-6, abs=1e-6)


def test_bf16_with_delayed_fp8_scaling_trains(one_rank_group):
    # Float16Module cast the delayed-scaling buffers to bf16; the first amax update overflowed
    # ("value cannot be converted to type c10::BFloat16 without overflow").
    fp8 = ("--fp8-format", "e4m3", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "4")
    losses = _train_losses("--bf16", *fp8)
    assert all(math.isfinite(v) for v in losses)
    assert losses == pytest.approx(_train_losses("--bf16"), abs=0.05)  # bf16 vs bf16 with FP8 GEMMs


def test_fp8_layer_keeps_its_scaling_state_in_fp32_under_casts(one_rank_group):
    fp8 = ("--fp8-format", "e4m3", "--fp8-recipe", "delayed")
    args = _args("--bf16", *fp8)
    run = _pretrain_gpt().setup(args)
    try:
        buffers = {name: buf for name, buf in run.model[0].named_buffers() if name.rsplit(".", 1)[-1].startswith("fp8_")}
        assert buffers and {buf.dtype for buf in buffers.values()} == {torch.float32}, buffers
        run.model[0].to(torch.float16)
        assert {buf.dtype for name, buf in run.model[0].named_buffers() if name in buffers} == {torch.float32}
    finally:
        parallel_state.destroy_model_parallel()


def test_fp8_shape_refusal_names_the_fp8_flags(one_rank_group):
    # MLA's kv down-projection is kv_lora_rank + qk_pos_emb_head_dim = 40 rows: no FP8 GEMM. The library's message
    # named the layer only.
    args = _args("--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "32", "--qk-head-dim", "16",
                 "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--position-embedding-type", "rope",
                 "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")
    try:
        with pytest.raises(ValueError, match="--fp8-format hybrid --fp8-recipe tensorwise: .*multiples of 16"):
            _pretrain_gpt().setup(args)
    finally:
        parallel_state.destroy_model_parallel()


def _resumed_and_straight(directory: str) -> tuple[list[float], list[float]]:
    flags = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
    straight = _train_losses(*flags, world_size=2)
    first = _train_losses(*flags, "--save", directory, world_size=2, iterations=(1,), save_at=1)
    second = _train_losses(*flags, "--load", directory, world_size=2, iterations=(2,))
    return first + second, straight


def test_overlap_param_gather_checkpoint_resumes_to_the_same_losses(tmp_path):
    # The save after a step wrote the other ranks' parts of each parameter as they were before the step (their
    # all-gather waits for the next forward): the resumed run's second loss differed.
    from tests.dist_harness import run_on_ranks

    for resumed, straight in run_on_ranks(2, _resumed_and_straight, str(tmp_path / "ckpt")):
        assert resumed == pytest.approx(straight, rel=1e-6, abs=1e-6), (resumed, straight)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "fp8-param"])
def test_an_fp8_expert_that_gets_no_tokens_runs(one_rank_group, recipe):
    # Top-1 routing left an expert without tokens; its FP8 GEMM took the amax of an empty tensor and raised (the
    # FP8-parameter GEMM of --fp8-param-gather too, found when the flag joined the matrix).
    fp8 = (["--fp8-recipe", "tensorwise", "--fp8-param-gather", "--use-distributed-optimizer"]
           if recipe == "fp8-param" else ["--fp8-recipe", recipe])
    args = _args("--num-experts", "4", "--disable-bias-linear", "--fp8-format", "hybrid", *fp8)
    run = _pretrain_gpt().setup(args)
    try:
        fc1 = next(m for n, m in run.model[0].named_modules() if n.endswith("local_experts.0.linear_fc1"))
        x = torch.zeros(0, 64, requires_grad=True)
        out, _ = fc1(x)
        assert out.shape == (0, fc1.weight.shape[0])
        out.sum().backward()
        assert x.grad is not None and x.grad.shape == (0, 64)
        if recipe == "delayed":  # no tokens, no amax recorded
            assert not fc1.fp8_amax_history.any()
        if recipe == "fp8-param":  # nothing added to the gradient; SwiGLU inside the GEMM (a dense MLP's) as well
            assert not fc1.weight.main_grad.any()
            activated, amax = fc1.forward_swiglu(torch.zeros(0, 64, requires_grad=True))
            assert activated.shape == (0, fc1.weight.shape[0] // 2) and float(amax) == 0.0
    finally:
        parallel_state.destroy_model_parallel()
