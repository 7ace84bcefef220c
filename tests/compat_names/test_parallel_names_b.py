"""Megatron-Core 0.19 names of tensor_parallel, pipeline_parallel and inference.communication_utils (part B).

Parallel behaviour is checked on 2 CPU ranks against a single-process reference; helpers are compared with
megatron-core 0.16.1 (``megatron.core``) where it has them.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.pipeline_parallel import p2p_communication, schedules
from megatron_core.tensor_parallel import layers, random
from tests.compat_names import part_b_rank_checks as checks
from tests.dist_harness import run_on_ranks

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_frozen_weights_on_two_tp_ranks_match_one_process(sequence_parallel):
    data = checks.reference_data()
    ref = checks.reference_frozen(data)
    for result in run_on_ranks(2, checks.frozen_tp_check, sequence_parallel):
        torch.testing.assert_close(result["y"], ref["y"], **TOL)
        torch.testing.assert_close(result["dx"], ref["dx"], **TOL)
        torch.testing.assert_close(result["db1"], ref["db1"], **TOL)
        assert result["weight_grads"] == [None, None]


def test_layers_route_frozen_weights_to_the_frozen_op(monkeypatch):
    calls = []
    real = layers.linear_with_frozen_weight
    monkeypatch.setattr(layers, "linear_with_frozen_weight", lambda *a, **k: calls.append(1) or real(*a, **k))
    col = layers.ColumnParallelLinear(4, 6, config=ModelParallelConfig(perform_initialization=False),
                                      init_method=torch.nn.init.ones_, bias=False, gather_output=False)
    with torch.no_grad():
        col.weight.fill_(1.0)
    col(torch.randn(3, 1, 4))
    assert calls == []
    col.weight.requires_grad_(False)
    x = torch.randn(3, 1, 4, requires_grad=True)
    col(x)[0].sum().backward()
    assert calls == [1] and col.weight.grad is None
    torch.testing.assert_close(x.grad, torch.full((3, 1, 4), 6.0))


def test_frozen_op_matches_oracle_single_process():
    from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight as Oracle

    w, b = torch.randn(5, 4), torch.randn(5)
    x = torch.randn(3, 2, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = layers.LinearWithFrozenWeight.apply(x, w, b, False, None)
    y_ref = Oracle.apply(x_ref, w, b, False, None)
    torch.testing.assert_close(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad)
    with pytest.raises(ValueError, match="grad_output_buffer"):
        layers.linear_with_frozen_weight(x, w, None, False, False, False, None, grad_output_buffer=[])
    with pytest.raises(ValueError, match="allreduce_dgrad"):
        layers.linear_with_frozen_weight(x, w, None, False, True, True, None)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_drained_embedding_wgrad_equals_the_direct_gradient(sequence_parallel):
    data = checks.reference_data()
    expected = sum(((torch.ones(checks.S, checks.B, checks.OUT) * (mb + 1)).reshape(-1, checks.OUT).t()
                    @ (data["x"] * (mb + 1)).reshape(-1, checks.H)) for mb in range(2))
    shards = run_on_ranks(2, checks.deferred_wgrad_check, sequence_parallel)
    torch.testing.assert_close(torch.cat(shards), expected, **TOL)


def test_is_checkpointing_only_inside_checkpoint():
    seen = []

    def fn(x):
        seen.append(random.is_checkpointing())
        return x * 2

    assert random.is_checkpointing() is False and random.IS_CHECKPOINTING is False
    x = torch.randn(3, requires_grad=True)
    random.checkpoint(fn, False, x).sum().backward()
    assert seen == [True, True]  # forward and the backward recomputation
    assert random.is_checkpointing() is False


def test_schedule_helpers_match_oracle():
    from megatron.core.pipeline_parallel import schedules as oracle

    assert schedules.get_tensor_device({"a": torch.zeros(1, device="meta")}) == torch.device("meta")
    assert schedules.get_tensor_device(torch.zeros(1)) == torch.device("cpu")
    for pp, rank, vp, chunks, group, fwd_only, moe in [(4, 1, None, 1, 4, False, False), (4, 0, 2, 2, 4, False, True),
                                                        (2, 1, 2, 2, 2, False, False), (4, 3, None, 1, 4, True, False),
                                                        (1, 0, None, 1, 1, False, False), (8, 0, None, 1, 8, False, False)]:
        comm = types.SimpleNamespace(pp_group=None, virtual_pipeline_model_parallel_size=vp)
        oracle_comm = types.SimpleNamespace(
            pp_group=types.SimpleNamespace(size=lambda pp=pp: pp, rank=lambda rank=rank: rank),
            virtual_pipeline_model_parallel_size=vp)
        import torch.distributed as dist

        orig = dist.get_world_size, dist.get_rank
        dist.get_world_size, dist.get_rank = (lambda group=None, pp=pp: pp), (lambda group=None, rank=rank: rank)
        try:
            ours = schedules.get_pp_rank_microbatches(3, chunks, group, fwd_only, moe, p2p_communicator=comm)
        finally:
            dist.get_world_size, dist.get_rank = orig
        assert ours == oracle.get_pp_rank_microbatches(3, chunks, group, fwd_only, moe, p2p_communicator=oracle_comm)


def test_embedding_wgrad_helpers_are_inert_for_a_model_without_buffers():
    config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                 defer_embedding_wgrad_compute=True)
    model = torch.nn.Linear(2, 2)
    model.post_process = True
    assert schedules.clear_embedding_activation_buffer(config, [model], is_last_stage=True) is model
    schedules.finish_embedding_wgrad_compute(config, model, True, None)  # nothing deferred: no error
    assert model.weight.grad is None
    buffered = torch.nn.Module()
    buffered.post_process = True
    buffered.embedding_activation_buffer, buffered.grad_output_buffer = [torch.ones(3, 2)], [torch.ones(3, 4)]
    buffered.output_layer = torch.nn.Linear(2, 4, bias=False)
    assert schedules.clear_embedding_activation_buffer(config, buffered, True) is buffered
    assert buffered.embedding_activation_buffer == []
    assert schedules.clear_embedding_activation_buffer(ModelParallelConfig(), buffered, True) is None


def test_is_single_shape_matches_oracle():
    from megatron.core.pipeline_parallel.p2p_communication import is_single_shape as oracle

    for x in [torch.Size([2, 3]), [2, 3], (4,), [], [[2, 3], [4]], [torch.Size([1])], (2, None), "ab"]:
        assert p2p_communication.is_single_shape(x) == oracle(x), x
    assert schedules.Shape is p2p_communication.Shape


def test_inference_collectives_on_two_ranks():
    results = run_on_ranks(2, checks.inference_comm_check)
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["tensor"], torch.arange(6, dtype=torch.float32).view(2, 3) + 10)
        assert out["ints"].tolist() == [7, 8, 9] and out["ints"].dtype == torch.int64
        assert out["floats"].tolist() == [0.5, 1.5] and out["floats"].dtype == torch.float32
        assert out["last"].tolist() == [1, 42]
        assert out["prev"].item() == (rank - 1) % 2
        assert (out["first"], out["is_last"]) == (rank == 0, rank == 1)
        assert out["dp_list"].tolist() == [100]  # from the model-parallel source rank (global rank 0)
        assert out["first_none"] is True  # PP = 1 under parallel_state


def test_get_all_ranks_is_megatrons_rank_string():
    """Megatron-Core 0.19's ``tp_gtp_dp_cp_pp_ep`` string (GTP always 0 here), which ``config_logger`` names files by."""
    results = run_on_ranks(4, checks.all_ranks_check)
    assert [r[0] for r in results] == ["0_0_0_0_0_0"] * 4  # nothing set up: every rank 0
    # TP=2 x PP=2: tensor rank varies fastest, then the pipeline stage (Megatron's default order tp-cp-ep-dp-pp)
    assert [r[1] for r in results] == ["0_0_0_0_0_0", "1_0_0_0_0_0", "0_0_0_0_1_0", "1_0_0_0_1_0"]
    # DP=4 with EP=2: data-parallel rank = global rank, expert rank alternates
    assert [r[2] for r in results] == ["0_0_0_0_0_0", "0_0_1_0_0_1", "0_0_2_0_0_0", "0_0_3_0_0_1"]
