"""Parallel layers against single-process ``nn.Linear`` / ``nn.Embedding`` on identical weights (fp32).

On 4 CPU ranks with TP in {1, 2, 4} (the rest is DP) and sequence parallelism on and off:
outputs and every gradient (input, weight, bias) of ColumnParallelLinear (gather_output on/off),
RowParallelLinear (input_is_parallel on/off) and VocabParallelEmbedding match the reference.
Also: CPU initialisation gives TP shards equal to slices of the TP=1 weight (stride 1 and 3),
parameter attributes, and the errors for sizes that do not divide by TP.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_core import parallel_state
from megatron_core import tensor_parallel as tp
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.utils import init_method_normal
from tests.dist_harness import run_on_ranks

WORLD = 4
S, B, H_IN, H_OUT, VOCAB = 8, 2, 12, 16, 24


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _config(tp_size: int, sp: bool) -> ModelParallelConfig:
    return ModelParallelConfig(tensor_model_parallel_size=tp_size, sequence_parallel=sp,
                               use_cpu_initialization=True)


def _tp_sum(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.clone()
    dist.all_reduce(out, group=parallel_state.get_tensor_model_parallel_group())
    return out


def _reference_linear(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, dy: torch.Tensor):
    """Output and (input, weight, bias) gradients of ``sum(linear(x) * dy)`` in one process."""
    ref = torch.nn.Linear(weight.size(1), weight.size(0))
    with torch.no_grad():
        ref.weight.copy_(weight)
        ref.bias.copy_(bias)
    x = x.clone().requires_grad_(True)
    y = ref(x)
    (y * dy).sum().backward()
    return y.detach(), x.grad, ref.weight.grad, ref.bias.grad


def _check_column(tp_size: int, sp: bool, rank: int) -> None:
    config = _config(tp_size, sp)
    for gather_output in ([False] if sp else [False, True]):
        torch.manual_seed(10)
        layer = tp.ColumnParallelLinear(H_IN, H_OUT, config=config, init_method=init_method_normal(0.2),
                                        bias=True, gather_output=gather_output, keep_master_weight_for_test=True)
        bias = _rand(H_OUT, seed=11)
        with torch.no_grad():
            layer.bias.copy_(bias.chunk(tp_size)[rank])
        x, dy = _rand(S, B, H_IN, seed=12), _rand(S, B, H_OUT, seed=13)
        y_ref, dx_ref, dw_ref, db_ref = _reference_linear(layer.master_weight, bias, x, dy)

        x_local = (x.chunk(tp_size, dim=0)[rank] if sp else x).clone().requires_grad_(True)
        y, out_bias = layer(x_local)
        assert out_bias is None
        dy_local = dy if gather_output else dy.chunk(tp_size, dim=-1)[rank]
        (y * dy_local).sum().backward()
        assert_close(y, y_ref if gather_output else y_ref.chunk(tp_size, dim=-1)[rank])
        assert_close(x_local.grad, dx_ref.chunk(tp_size, dim=0)[rank] if sp else dx_ref)
        assert_close(layer.weight.grad, dw_ref.chunk(tp_size, dim=0)[rank])
        assert_close(layer.bias.grad, db_ref.chunk(tp_size, dim=0)[rank])
        assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0
        assert layer.bias.tensor_model_parallel and layer.weight.allreduce


def _check_row(tp_size: int, sp: bool, rank: int) -> None:
    config = _config(tp_size, sp)
    for input_is_parallel in ([True] if sp else [True, False]):
        torch.manual_seed(20)
        layer = tp.RowParallelLinear(H_IN, H_OUT, config=config, init_method=init_method_normal(0.2), bias=True,
                                     input_is_parallel=input_is_parallel, skip_bias_add=False,
                                     keep_master_weight_for_test=True)
        bias = _rand(H_OUT, seed=21)
        with torch.no_grad():
            layer.bias.copy_(bias)
        x, dy = _rand(S, B, H_IN, seed=22), _rand(S, B, H_OUT, seed=23)
        y_ref, dx_ref, dw_ref, db_ref = _reference_linear(layer.master_weight, bias, x, dy)

        x_local = (x.chunk(tp_size, dim=-1)[rank] if input_is_parallel else x).clone().requires_grad_(True)
        y, out_bias = layer(x_local)
        assert out_bias is None
        dy_local = dy.chunk(tp_size, dim=0)[rank] if sp else dy
        (y * dy_local).sum().backward()
        assert_close(y, y_ref.chunk(tp_size, dim=0)[rank] if sp else y_ref)
        assert_close(x_local.grad, dx_ref.chunk(tp_size, dim=-1)[rank] if input_is_parallel else dx_ref)
        assert_close(layer.weight.grad, dw_ref.chunk(tp_size, dim=1)[rank])
        # Under SP the replicated bias sees only this rank's tokens; finalize_model_grads sums over TP.
        assert layer.bias.sequence_parallel == sp
        assert_close(_tp_sum(layer.bias.grad) if sp else layer.bias.grad, db_ref)
        assert layer.weight.partition_dim == 1 and not hasattr(layer.bias, "tensor_model_parallel")


def _check_skip_bias_add(tp_size: int, rank: int) -> None:
    config = _config(tp_size, False)
    col = tp.ColumnParallelLinear(H_IN, H_OUT, config=config, init_method=init_method_normal(0.2),
                                  skip_bias_add=True)
    x = _rand(S, B, H_IN, seed=30)
    y, bias = col(x)
    assert bias is col.bias
    assert_close(y, x @ col.weight.t())
    shared = torch.nn.Parameter(_rand(H_OUT, H_IN, seed=31).chunk(tp_size)[rank].clone())
    tied = tp.ColumnParallelLinear(H_IN, H_OUT, config=config, init_method=init_method_normal(0.2), bias=False,
                                   skip_weight_param_allocation=True)
    assert tied.weight is None
    y, _ = tied(x, weight=shared, runtime_gather_output=True)
    assert_close(y, x @ _rand(H_OUT, H_IN, seed=31).t())


def _check_embedding(tp_size: int, sp: bool, rank: int) -> None:
    config = _config(tp_size, sp)
    torch.manual_seed(40)
    layer = tp.VocabParallelEmbedding(VOCAB, H_OUT, init_method=init_method_normal(0.2),
                                      reduce_scatter_embeddings=sp, config=config)
    torch.manual_seed(40)
    full = torch.empty(VOCAB, H_OUT)
    init_method_normal(0.2)(full)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(41))
    dy = _rand(B, S, H_OUT, seed=42)
    ref = torch.nn.Embedding(VOCAB, H_OUT)
    with torch.no_grad():
        ref.weight.copy_(full)
    y_ref = ref(ids)
    (y_ref * dy).sum().backward()

    assert_close(layer.weight, full.chunk(tp_size)[rank])
    y = layer(ids)
    if sp:  # [s/TP, b, h]
        y_expected, dy_local = y_ref.transpose(0, 1).chunk(tp_size, dim=0)[rank], dy.transpose(0, 1).chunk(
            tp_size, dim=0)[rank]
    else:
        y_expected, dy_local = y_ref, dy
    (y * dy_local).sum().backward()
    assert_close(y, y_expected.detach())
    assert_close(layer.weight.grad, ref.weight.grad.chunk(tp_size)[rank])


def _check_layers(tp_size: int, sp: bool) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    tp.model_parallel_cuda_manual_seed(1234)
    rank = parallel_state.get_tensor_model_parallel_rank()
    _check_column(tp_size, sp, rank)
    _check_row(tp_size, sp, rank)
    _check_embedding(tp_size, sp, rank)
    if not sp:
        _check_skip_bias_add(tp_size, rank)


@pytest.mark.parametrize("tp_size,sp", [(1, False), (2, False), (2, True), (4, False), (4, True)])
def test_layers_match_single_process_reference(tp_size: int, sp: bool) -> None:
    run_on_ranks(WORLD, _check_layers, tp_size, sp)


def _check_cpu_init_slices(tp_size: int) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    rank = parallel_state.get_tensor_model_parallel_rank()
    config = _config(tp_size, False)
    for stride in (1, 3):
        out = 6 * tp_size * stride
        torch.manual_seed(50)
        col = tp.ColumnParallelLinear(H_IN, out, config=config, init_method=init_method_normal(1.0), stride=stride)
        torch.manual_seed(50)
        full = torch.empty(out, H_IN)
        init_method_normal(1.0)(full)
        # Pieces of out / (TP * stride) rows; rank r holds pieces r, r + TP, ... (interleaved fused weights).
        pieces = full.split(out // (tp_size * stride), dim=0)
        assert_close(col.weight, torch.cat(pieces[rank::tp_size], dim=0), rtol=0, atol=0)
        assert col.weight.partition_stride == stride

        torch.manual_seed(51)
        row = tp.RowParallelLinear(out, H_IN, config=config, init_method=init_method_normal(1.0), bias=False,
                                   input_is_parallel=True, skip_bias_add=False, stride=stride)
        torch.manual_seed(51)
        full = torch.empty(H_IN, out)
        init_method_normal(1.0)(full)
        pieces = full.split(out // (tp_size * stride), dim=1)
        assert_close(row.weight, torch.cat(pieces[rank::tp_size], dim=1), rtol=0, atol=0)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_cpu_initialization_gives_slices_of_the_tp1_weight(tp_size: int) -> None:
    run_on_ranks(WORLD, _check_cpu_init_slices, tp_size)


def _check_errors() -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=4)
    tp.model_parallel_cuda_manual_seed(1)
    config = _config(4, False)
    init = init_method_normal(0.02)
    with pytest.raises(ValueError, match=r"output_size \(30\).*tensor-parallel size \(4\).*pad_vocab_size"):
        tp.ColumnParallelLinear(8, 30, config=config, init_method=init)
    with pytest.raises(ValueError, match=r"input_size \(10\).*tensor-parallel size \(4\).*pad_vocab_size"):
        tp.RowParallelLinear(10, 8, config=config, init_method=init, bias=True, input_is_parallel=True,
                             skip_bias_add=False)
    with pytest.raises(ValueError, match=r"vocabulary size \(50\).*tensor-parallel size \(4\).*pad_vocab_size"):
        tp.VocabParallelEmbedding(50, 8, init_method=init, config=config)
    sp_config = _config(4, True)
    with pytest.raises(ValueError, match="input_is_parallel"):
        tp.RowParallelLinear(8, 8, config=sp_config, init_method=init, bias=True, input_is_parallel=False,
                             skip_bias_add=False)
    col = tp.ColumnParallelLinear(8, 8, config=sp_config, init_method=init)
    with pytest.raises(ValueError, match="gather_output"):
        col(torch.zeros(2, 1, 8), runtime_gather_output=True)


def test_sizes_not_divisible_by_tp_raise() -> None:
    run_on_ranks(WORLD, _check_errors)


def test_pad_vocab_size() -> None:
    assert tp.pad_vocab_size(50257, 128, 1) == 50304
    assert tp.pad_vocab_size(50257, 128, 8) == 51200
    assert tp.pad_vocab_size(256, 128, 2) == 256
    with pytest.raises(ValueError, match="orig_vocab_size=0"):
        tp.pad_vocab_size(0)


def test_device_initialization_needs_seeded_tracker() -> None:
    """Without CPU initialisation the weights come from the model-parallel RNG stream."""
    config = ModelParallelConfig()
    tp.model_parallel_cuda_manual_seed(7)
    a = tp.ColumnParallelLinear(4, 8, config=config, init_method=init_method_normal(1.0)).weight
    tp.model_parallel_cuda_manual_seed(7)
    b = tp.ColumnParallelLinear(4, 8, config=config, init_method=init_method_normal(1.0)).weight
    assert_close(a, b, rtol=0, atol=0)
    tp.get_cuda_rng_tracker().reset()
    with pytest.raises(KeyError, match="model_parallel_cuda_manual_seed"):
        tp.ColumnParallelLinear(4, 8, config=config, init_method=init_method_normal(1.0))


def test_sequence_parallel_needs_tensor_parallel() -> None:
    with pytest.raises(ValueError, match="sequence parallelism without tensor parallelism"):
        ModelParallelConfig(tensor_model_parallel_size=1, sequence_parallel=True)
