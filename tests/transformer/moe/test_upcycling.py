"""Upcycling a dense GPT into a MoE GPT (``transformer.moe.upcycling_utils``).

- Against Megatron-Core's own conversion (the installed megatron-core as an oracle, run on this library's
  models): every converted tensor equal, for both expert layouts, granularity 1 and 2, with and without
  ``moe_router_pre_softmax``.
- The property upcycling is for: where the routed probabilities are what the scaling assumes, the upcycled MoE
  model computes the dense model's logits.
- Mixed dense and MoE layers, model chunks, ``load_and_upcycle_model``, and the errors.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_core import parallel_state, tensor_parallel
from megatron_core.activations import squared_relu
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.moe import BaseMoELayer, SequentialMLP, TEGroupedMLP
from megatron_core.transformer.moe.upcycling_utils import (
    load_and_upcycle_model,
    upcycle_state_dict,
)
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import MAX_SEQ, SEQ, VOCAB
from tests.transformer.moe.moe_parallel_utils import batches, global_tensors, load_globals, local_vs_global

BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
            normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True, gated_linear_unit=True, activation_func=F.silu)


def _gpt(seed: int, **overrides) -> GPTModel:
    torch.manual_seed(seed)
    config = TransformerConfig(**{**BASE, **overrides})
    return GPTModel(config, get_gpt_decoder_block_spec(config, False), VOCAB, MAX_SEQ,
                    position_embedding_type="rope").eval()


def _pair(moe: dict, dense: dict | None = None) -> tuple[GPTModel, GPTModel]:
    """A trained-looking dense GPT and a MoE GPT of the same shape with its own (other) initialisation."""
    dense_model = _gpt(1, **(dense or {}))
    moe_model = _gpt(2, **{**(dense or {}), **moe})
    return moe_model, dense_model


def _logits(model: GPTModel) -> torch.Tensor:
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        return model(ids, pos, None)


def _megatron_conversion(moe_model: GPTModel, dense_model: GPTModel, monkeypatch) -> dict:
    """Megatron-Core's ``_convert_to_moe_state_dict`` run on this library's models (the classes it checks for
    are pointed at ours; a single process has no expert-parallel group, so it gets rank 0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = pytest.importorskip("megatron.core.transformer.moe.upcycling_utils")
    monkeypatch.setattr(reference, "BaseMoELayer", BaseMoELayer)
    monkeypatch.setattr(reference, "SequentialMLP", SequentialMLP)
    monkeypatch.setattr(reference, "TEGroupedMLP", TEGroupedMLP)
    for layer in moe_model.modules():
        if isinstance(layer, BaseMoELayer):
            monkeypatch.setattr(layer, "ep_group", types.SimpleNamespace(rank=lambda: 0))
    return reference._convert_to_moe_state_dict(moe_model, dense_model)


ORACLE_CASES = [
    dict(moe_grouped_gemm=False),
    dict(moe_grouped_gemm=True),
    dict(moe_grouped_gemm=False, moe_ffn_hidden_size=16),
    dict(moe_grouped_gemm=True, moe_ffn_hidden_size=8, moe_router_pre_softmax=True),
    dict(moe_grouped_gemm=False, moe_router_pre_softmax=True, moe_router_topk=1),
]


@pytest.mark.parametrize("moe", ORACLE_CASES)
def test_upcycled_state_matches_megatron_cores_conversion(moe: dict, monkeypatch):
    moe_model, dense_model = _pair({"num_moe_experts": 8, "moe_router_topk": 2, **moe})
    ours = upcycle_state_dict(moe_model, dense_model)["model"]
    want = _megatron_conversion(moe_model, dense_model, monkeypatch)
    assert ours.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
        else:
            assert ours[key] is None and value is None, key


def _upcycled(moe_model: GPTModel, dense_model: GPTModel) -> GPTModel:
    moe_model.load_state_dict(upcycle_state_dict(moe_model, dense_model)["model"])
    return moe_model


@pytest.mark.parametrize("grouped", [False, True])
def test_granularity_one_reproduces_the_dense_logits(grouped: bool):
    """Every expert is the dense MLP and the top-k probabilities sum to one: the dense function exactly."""
    moe_model, dense_model = _pair(dict(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=grouped))
    torch.testing.assert_close(_logits(_upcycled(moe_model, dense_model)), _logits(dense_model),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grouped", [False, True])
def test_fine_grained_experts_rebuild_the_dense_mlp(grouped: bool):
    """Granularity 2 with top-2: the tied router rows route a block's two slices together, each with
    probability 1/2; squared ReLU is homogeneous, so the scaled slices add up to the dense MLP."""
    dense = dict(gated_linear_unit=False, activation_func=squared_relu)
    moe_model, dense_model = _pair(dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                                        moe_grouped_gemm=grouped), dense)
    upcycled = _upcycled(moe_model, dense_model)
    router = upcycled.decoder.layers[0].mlp.router.weight
    torch.testing.assert_close(router[0], router[1], rtol=0, atol=0)
    torch.testing.assert_close(router[2], router[3], rtol=0, atol=0)
    torch.testing.assert_close(_logits(upcycled), _logits(dense_model), rtol=1e-5, atol=1e-5)


def test_pre_softmax_scaling_reproduces_the_dense_logits_under_a_uniform_router():
    """With ``moe_router_pre_softmax`` each routed expert gets 1/num_experts; the weights carry the rest."""
    dense = dict(gated_linear_unit=False, activation_func=squared_relu)
    moe_model, dense_model = _pair(dict(num_moe_experts=4, moe_router_topk=2, moe_router_pre_softmax=True), dense)
    upcycled = _upcycled(moe_model, dense_model)
    with torch.no_grad():
        for layer in upcycled.decoder.layers:
            layer.mlp.router.weight.zero_()
    torch.testing.assert_close(_logits(upcycled), _logits(dense_model), rtol=1e-5, atol=1e-5)


def test_dense_layers_of_a_mixed_model_are_copied_and_moe_layers_upcycled():
    moe_model, dense_model = _pair(dict(num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[0, 1]))
    upcycled = _upcycled(moe_model, dense_model)
    dense_mlp, moe_mlp = upcycled.decoder.layers[0].mlp, upcycled.decoder.layers[1].mlp
    torch.testing.assert_close(dense_mlp.linear_fc1.weight, dense_model.decoder.layers[0].mlp.linear_fc1.weight)
    torch.testing.assert_close(moe_mlp.experts.local_experts[3].linear_fc2.weight,
                               dense_model.decoder.layers[1].mlp.linear_fc2.weight)
    torch.testing.assert_close(_logits(upcycled), _logits(dense_model), rtol=1e-5, atol=1e-5)


def test_shared_experts_and_expert_bias_keep_the_moe_initialisation():
    moe_model, dense_model = _pair(dict(num_moe_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=16,
                                        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True))
    before = {k: v.clone() for k, v in moe_model.state_dict().items()
              if isinstance(v, torch.Tensor) and ("shared_experts" in k or "expert_bias" in k)}
    converted = upcycle_state_dict(moe_model, dense_model)["model"]
    assert before
    for key, value in before.items():
        torch.testing.assert_close(converted[key], value, rtol=0, atol=0)


def test_load_and_upcycle_model_loads_the_dense_checkpoint_first_and_returns_its_counters():
    moe_model, dense_model = _pair(dict(num_moe_experts=4, moe_router_topk=2))
    trained = _gpt(7).state_dict()

    def load_dense(state: dict, *, model: list[GPTModel]) -> tuple[int, float]:
        model[0].load_state_dict(state)
        return 120, 3.5e12

    result = load_and_upcycle_model(load_dense, [moe_model], [dense_model], load_args=(trained,),
                                    load_kwargs=dict(model=[dense_model]))
    assert result == (120, 3.5e12)
    torch.testing.assert_close(moe_model.decoder.layers[1].mlp.experts.local_experts[2].linear_fc1.weight,
                               trained["decoder.layers.1.mlp.linear_fc1.weight"], rtol=0, atol=0)
    torch.testing.assert_close(_logits(moe_model), _logits(dense_model), rtol=1e-5, atol=1e-5)


def test_model_chunks_are_converted_one_by_one():
    moe_a, dense_a = _pair(dict(num_moe_experts=4, moe_router_topk=2))
    moe_b, dense_b = _pair(dict(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True))
    state = upcycle_state_dict([moe_a, moe_b], [dense_a, dense_b])
    assert set(state) == {"model0", "model1"}
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in state["model1"]
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight" in state["model0"]


@pytest.mark.parametrize("moe,dense,match", [
    (dict(num_moe_experts=4, moe_ffn_hidden_size=12), {}, "multiple of moe_ffn_hidden_size"),
    (dict(num_moe_experts=2, moe_router_topk=1, moe_ffn_hidden_size=8), {}, "num_moe_experts .2. to be a multiple"),
    (dict(num_moe_experts=4, activation_func=F.relu, gated_linear_unit=False), {}, "activation_func"),
])
def test_models_that_cannot_be_upcycled_are_refused_naming_the_values(moe: dict, dense: dict, match: str):
    moe_model, dense_model = _pair({"moe_router_topk": 2, **moe}, dense)
    with pytest.raises(ValueError, match=match):
        upcycle_state_dict(moe_model, dense_model)


def test_a_dense_model_is_refused_as_the_moe_side():
    dense_a, dense_b = _gpt(1), _gpt(2)
    with pytest.raises(ValueError, match="has no MoE layer"):
        upcycle_state_dict(dense_a, dense_b)


def test_a_different_chunk_count_is_refused():
    moe_model, dense_model = _pair(dict(num_moe_experts=4, moe_router_topk=2))
    with pytest.raises(ValueError, match="as many dense model chunks"):
        upcycle_state_dict([moe_model, moe_model], [dense_model])


FINE_GRAINED = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
SQUARED_RELU = dict(gated_linear_unit=False, activation_func=squared_relu)


def _loss(model: GPTModel) -> torch.Tensor:
    ids, pos, labels = batches(1)[0]
    with torch.no_grad():
        return model(ids, pos, None, labels=labels).mean()


def _check_expert_parallel_upcycling() -> list[str]:
    """On 4 ranks: EP=4 gives each rank the single-process upcycled model's experts (global expert index, so
    the right slice); EP=2 x TP=2 x expert-TP=2 slices each rank's shard and reproduces the dense loss."""
    moe_ref, dense_ref = _pair(FINE_GRAINED, SQUARED_RELU)
    moe_init, dense_globals = global_tensors(moe_ref), global_tensors(dense_ref)
    upcycled_globals = global_tensors(_upcycled(moe_ref, dense_ref))
    dense_loss = _loss(dense_ref)
    done = []
    for tp, ep in ((1, 4), (2, 2)):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=tp)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            layout = dict(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, **SQUARED_RELU)
            dense = _gpt(1, **layout)
            moe = _gpt(2, expert_model_parallel_size=ep, expert_tensor_parallel_size=tp, **FINE_GRAINED, **layout)
            load_globals(dense, dense_globals)
            load_globals(moe, moe_init)
            moe = _upcycled(moe, dense)
            if tp == 1:
                for key, local, ref in local_vs_global(moe, upcycled_globals):
                    torch.testing.assert_close(local, ref, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
            torch.testing.assert_close(_loss(moe), dense_loss, rtol=1e-5, atol=1e-5)
            done.append(f"tp={tp} ep={ep}")
        finally:
            parallel_state.destroy_model_parallel()
    return done


def test_expert_parallel_upcycling_slices_by_global_expert_and_keeps_the_dense_loss():
    results = run_on_ranks(4, _check_expert_parallel_upcycling)
    assert all(r == ["tp=1 ep=4", "tp=2 ep=2"] for r in results)
