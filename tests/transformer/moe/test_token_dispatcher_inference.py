"""Inference MoE under expert parallelism through ``NCCLAllGatherDispatcher`` equals one process (fp32, gloo).

Layouts: EP=2 and expert-TP=2 on 2 ranks (equal and, with ``_use_allgather_v``, unequal token counts per
rank), and TP=2 (sequence parallel) x EP=2 with expert-TP 1 on 4 ranks. Every rank routes its own tokens; the
reference is the one-process MoE layer on the same global weights, and the training path of the same
parallel layer (outside an engine) must agree too. The default ``'nvls'`` gets the NCCL dispatcher;
``NVLSAllGatherVDispatcher`` itself and unknown dispatcher types are refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from megatron_core import parallel_state
from megatron_core._ground.inference_mode import InferenceMode
from megatron_core.models.gpt.moe_module_specs import get_inference_optimized_moe_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.moe.token_dispatcher_inference import (
    InferenceAllGatherDispatcherBase,
    NCCLAllGatherDispatcher,
    NVLSAllGatherVDispatcher,
)
from tests.dist_harness import run_on_ranks
from tests.transformer.moe.moe_parallel_utils import global_tensors, load_globals

TOL = dict(rtol=1e-6, atol=1e-6)


def _config(**overrides) -> TransformerConfig:
    cfg = dict(num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, num_moe_experts=4,
               moe_router_topk=2, moe_ffn_hidden_size=12, normalization="RMSNorm", gated_linear_unit=True,
               activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
               use_cpu_initialization=True, moe_grouped_gemm=True, moe_router_score_function="sigmoid",
               moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=16,
               inference_moe_token_dispatcher_type="nccl")
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def _tokens(rank: int, seq: int) -> torch.Tensor:
    return torch.randn(seq, 2, 16, generator=torch.Generator().manual_seed(100 + rank))


def _layers(tp: int, ep: int, etp: int, inputs: list[torch.Tensor] = (), **overrides):
    """``(one-process outputs on inputs, parallel layer)`` with the same global weights, in eval mode.

    The one-process layer is built, read and run before the groups exist (its layers would otherwise pick up
    ``parallel_state``'s groups).
    """
    torch.manual_seed(0)
    ref = get_inference_optimized_moe_spec()(config=_config(**overrides)).eval()
    with torch.no_grad():
        ref.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 4))
        outputs = [ref(x)[0] for x in inputs]
    globals_ = global_tensors(ref)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    config = _config(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                     sequence_parallel=tp > 1, **overrides)
    layer = get_inference_optimized_moe_spec()(config=config).eval()
    load_globals(layer, globals_)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 4))
    return outputs, layer


def _check_equal_to_one_process(tp: int, ep: int, etp: int, seq_by_rank: list[int] | None) -> None:
    rank = torch.distributed.get_rank()
    if tp > 1:  # sequence parallel: each rank takes its TP slice of its EP rank's sequence (every op is per token)
        candidates = [_tokens(ep_rank, 8) for ep_rank in range(ep)]
    else:
        candidates = [_tokens(rank, seq_by_rank[rank] if seq_by_rank else 6)]
    outputs, layer = _layers(tp, ep, etp, candidates)
    assert isinstance(layer._inference_token_dispatcher, NCCLAllGatherDispatcher)
    if tp > 1:
        tp_rank, ep_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank()
        x, expected = candidates[ep_rank].chunk(tp)[tp_rank], outputs[ep_rank].chunk(tp)[tp_rank]
    else:
        x, expected = candidates[0], outputs[0]
    with torch.no_grad():  # the training all-gather dispatcher needs equal token counts
        training_path = layer(x)[0] if seq_by_rank is None else expected
    NCCLAllGatherDispatcher._use_allgather_v = seq_by_rank is not None
    try:
        with torch.no_grad():
            with InferenceMode.active():
                got, bias = layer(x)
    finally:
        NCCLAllGatherDispatcher._use_allgather_v = False
        InferenceMode.unset_active()
    assert bias is None and got.dtype == x.dtype
    assert_close(got, expected, **TOL)
    assert_close(got, training_path, **TOL)
    gathered = sum(seq_by_rank) * 2 if seq_by_rank else x.shape[0] * x.shape[1] * 2
    assert InferenceAllGatherDispatcherBase._host_valid_tokens_estimate == gathered
    assert int(InferenceAllGatherDispatcherBase._valid_tokens()[0]) == gathered


@pytest.mark.parametrize("ep,etp,seq_by_rank", [(2, 1, None), (2, 1, [5, 3]), (1, 2, None), (1, 2, [2, 7])],
                         ids=["ep2", "ep2-uneven", "etp2", "etp2-uneven"])
def test_nccl_dispatcher_on_two_ranks_equals_one_process(ep: int, etp: int, seq_by_rank: list[int] | None):
    run_on_ranks(2, _check_equal_to_one_process, 1, ep, etp, seq_by_rank)


def test_nccl_dispatcher_at_tp2_ep2_equals_one_process():
    run_on_ranks(4, _check_equal_to_one_process, 2, 2, 1, None)


def _check_refusals() -> None:
    # The default 'nvls' gets the NCCL all-gather dispatcher (same maths; no NVLS transport here).
    _, layer = _layers(1, 2, 1, inference_moe_token_dispatcher_type="nvls")
    assert type(layer._inference_token_dispatcher) is NCCLAllGatherDispatcher
    with pytest.raises(NotImplementedError, match="NVLS symmetric memory"):
        NVLSAllGatherVDispatcher.allocate_buffers(8, 2, 16, parallel_state.get_expert_model_parallel_group())
    with pytest.raises(ValueError, match="inference_moe_token_dispatcher_type"):
        get_inference_optimized_moe_spec()(config=_config(expert_model_parallel_size=2,
                                                          inference_moe_token_dispatcher_type="deepep"))


def test_nvls_falls_back_to_nccl_and_unknown_dispatchers_are_refused_by_name():
    run_on_ranks(2, _check_refusals)
