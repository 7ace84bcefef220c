"""GPTModel's public surface on one process: Megatron-Core state-dict keys, outputs, size errors.

(The smoke run of ``benchmarks/gpt_fwd_bwd.py --tiny`` lives in ``benchmarks/test_benchmarks_smoke.py``,
outside the test suite.)
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig
from tests.models.gpt_test_utils import BATCH, SEQ, VOCAB, batch, build, gpt2_like, llama_like

_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def _layer_keys(index: int, norm_params: tuple[str, ...], linear_params: tuple[str, ...]) -> list[str]:
    prefix = f"decoder.layers.{index}."
    keys = [f"{prefix}{norm}.{p}" for norm in ("input_layernorm", "pre_mlp_layernorm") for p in norm_params]
    # Local linear layers keep an (empty) ``_extra_state`` entry, as Megatron-Core's do, for TE compatibility.
    keys += [f"{prefix}{lin}.{p}" for lin in _LINEARS for p in (*linear_params, "_extra_state")]
    return keys


def test_state_dict_keys_match_megatron_core() -> None:
    llama = build(llama_like())
    expected = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
                "output_layer.weight", "output_layer._extra_state"]
    for i in range(2):
        expected += _layer_keys(i, ("weight",), ("weight",))
    assert sorted(llama.state_dict()) == sorted(expected)

    gpt2 = build(gpt2_like())
    expected = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer._extra_state"]
    for i in range(2):
        expected += _layer_keys(i, ("weight", "bias"), ("weight", "bias"))
    assert sorted(gpt2.state_dict()) == sorted(expected)
    # Tied: the output layer holds no weight of its own and uses the word embedding.
    assert gpt2.output_layer.weight is None
    assert gpt2.shared_embedding_or_output_weight() is gpt2.embedding.word_embeddings.weight


def test_forward_returns_loss_or_logits() -> None:
    torch.manual_seed(0)
    model = build(llama_like())
    ids, pos, labels = batch()
    loss = model(ids, pos, None, labels=labels)
    logits = model(ids, pos, None)
    assert loss.shape == (BATCH, SEQ) and logits.shape == (BATCH, SEQ, VOCAB)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(loss, expected.reshape(BATCH, SEQ), rtol=1e-5, atol=1e-5)


def test_tp_size_in_config_without_a_tp_group_is_rejected() -> None:
    # Sizes come from the process groups: a single process has no TP group (size 1), so a config that
    # insists on TP=4 contradicts it (the vocabulary check under a real group is in test_process_groups).
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=4,
                               use_cpu_initialization=True)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size is 4 but no group is set up \(size 1\)"):
        GPTModel(config, get_gpt_layer_local_spec(), 50, 16)


def test_hidden_size_not_divisible_by_tp_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\).*tensor_model_parallel_size \(4\)"):
        TransformerConfig(num_layers=1, hidden_size=36, num_attention_heads=6, tensor_model_parallel_size=4)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_model_computes_rope_angles_in_graph_and_matches_eager(dynamic: bool) -> None:
    # Under torch.compile the rotary angles are built inside the graph (a cached graph output would be
    # overwritten by CUDA-graph replays); the eager path keeps its cache. Dynamo tracing only (no codegen).
    # dynamic=True: symbolic sequence lengths must not reach SDPA's is_causal as a SymBool.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build(llama_like())
    ids, pos, labels = batch()
    eager_loss = model(ids, pos, None, labels=labels)
    model.rotary_pos_emb._cache.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    compiled_loss = compiled(ids, pos, None, labels=labels)
    assert model.rotary_pos_emb._cache == {}
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-5)
    compiled_loss.mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_transformer_engine_spec_without_transformer_engine_names_the_extra() -> None:
    from megatron_core.models.gpt import get_gpt_layer_with_transformer_engine_spec

    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install megatron_core\[te\]"):
            get_gpt_layer_with_transformer_engine_spec()
    else:
        pytest.skip("Transformer Engine is installed")


def test_cross_entropy_loss_fusion_gives_the_same_loss_and_gradients() -> None:
    results = []
    for fusion in (False, True):
        torch.manual_seed(0)
        model = build(llama_like(), cross_entropy_loss_fusion=fusion)
        ids, pos, labels = batch()
        loss = model(ids, pos, None, labels=labels)
        loss.float().mean().backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.warns(UserWarning, match="known stability issues"):  # Megatron-Core's warning; native kernel
        TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, cross_entropy_loss_fusion=True,
                          cross_entropy_fusion_impl="te")
