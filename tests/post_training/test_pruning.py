"""Minitron pruning of a GPTModel (post_training.modelopt.pruning, issue 42).

Parts made provably dead (a neuron's ``linear_fc1`` rows zeroed, a query group's or a multi-head model's head's
value rows zeroed, a layer whose ``linear_proj`` and ``linear_fc2`` are zero, hidden channels whose norm weights
are zero) score exactly 0 and are the ones removed; removing only dead parts keeps the logits (float64: the
GEMMs of the smaller model add the same non-zero products in another blocking, 1e-12; dropping a dead layer
alone: bitwise). The pruned model's config and shapes are the export_config's, it trains, saves and loads
through dist_checkpointing at DP=2 (each rank calibrating on its own batch, equal to one process calibrating on
both), and exports through the HF bridge to a checkpoint transformers loads with our logits.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from megatron_core import dist_checkpointing, parallel_state
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron_core.post_training.modelopt.pruning import (
    check_export_config,
    drop_mcore_language_model_layers,
    prune,
    pruned_hf_bridge,
)
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks

VOCAB, SEQ = 128, 16
POS = torch.arange(SEQ).expand(2, SEQ)


def gqa_config(**overrides) -> TransformerConfig:
    fields = dict(num_layers=3, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=96,
                  normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                  hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **overrides})


def build(config: TransformerConfig, seed: int = 0, **kwargs) -> GPTModel:
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    kwargs.setdefault("position_embedding_type", "rope")
    return GPTModel(config, spec, VOCAB, SEQ, parallel_output=False, **kwargs).eval()


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def loop_over(*seeds: int):
    def forward_loop(model):
        for seed in seeds:
            model(tokens(seed), POS, None)
    return forward_loop


def logits(model: GPTModel, seed: int = 100) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens(seed), POS, None)


def test_dead_neurons_group_and_layer_are_removed_and_logits_keep():
    config = gqa_config(params_dtype=torch.float64)
    model = build(config)
    hn = config.kv_channels
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.mlp.linear_fc1.weight[[5, 7, 96 + 5, 96 + 7]] = 0  # gate and up rows of neurons 5, 7
            start = 3 * (2 + 2) * hn  # group 3: query heads 6, 7, its key, its value
            layer.self_attention.linear_qkv.weight[start + 3 * hn:start + 4 * hn] = 0
        model.decoder.layers[1].self_attention.linear_proj.weight.zero_()
        model.decoder.layers[1].mlp.linear_fc2.weight.zero_()
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    reference = logits(model)
    export = {"ffn_hidden_size": 94, "num_attention_heads": 6, "num_query_groups": 3, "num_layers": 2}
    _, result = prune(model, "mcore_minitron", {"export_config": export}, None, {"forward_loop": loop_over(0, 1)})

    scores = result["importance"]
    assert scores.layers[1] == 0 and (scores.layers[[0, 2]] > 0).all()
    for i in (0, 2):
        assert (scores.ffn[i][[5, 7]] == 0).all() and (scores.ffn[i] > 0).sum() == 94
        assert scores.query_groups[i][3] == 0 and (scores.query_groups[i][:3] > 0).all()
        assert (scores.heads[i][6:] == 0).all() and (scores.heads[i][:6] > 0).all()
    c = model.config
    assert (c.num_layers, c.hidden_size, c.ffn_hidden_size, c.num_attention_heads, c.num_query_groups,
            c.kv_channels) == (2, 64, 94, 6, 3, hn)
    assert len(model.decoder.layers) == 2
    for new, old in ((0, 0), (1, 2)):
        layer = model.decoder.layers[new]
        keep = [i for i in range(96) if i not in (5, 7)]
        torch.testing.assert_close(layer.mlp.linear_fc1.weight,
                                   before[f"decoder.layers.{old}.mlp.linear_fc1.weight"][keep + [96 + i for i in keep]],
                                   rtol=0, atol=0)
        assert layer.self_attention.linear_qkv.weight.shape == (3 * 4 * hn, 64)
        torch.testing.assert_close(layer.self_attention.linear_qkv.weight,
                                   before[f"decoder.layers.{old}.self_attention.linear_qkv.weight"][:12 * hn],
                                   rtol=0, atol=0)
        assert layer.self_attention.linear_proj.weight.shape == (64, 6 * hn)
        assert layer.mlp.linear_fc2.weight.shape == (64, 94)
    torch.testing.assert_close(logits(model), reference, rtol=0, atol=1e-12)


def test_multi_head_model_with_biases_learned_positions_and_layernorm():
    config = gqa_config(num_query_groups=None, num_attention_heads=4, normalization="LayerNorm",
                        gated_linear_unit=False, activation_func=F.gelu, add_bias_linear=True, num_layers=2,
                        params_dtype=torch.float64)
    model = build(config, position_embedding_type="learned_absolute")
    hn = config.kv_channels
    with torch.no_grad():
        for layer in model.decoder.layers:
            qkv = layer.self_attention.linear_qkv
            qkv.weight[2 * 3 * hn + 2 * hn:2 * 3 * hn + 3 * hn] = 0  # head 2's value (one head per group)
            qkv.bias[2 * 3 * hn + 2 * hn:2 * 3 * hn + 3 * hn] = 0
            layer.mlp.linear_fc1.weight[[0, 50]] = 0
            layer.mlp.linear_fc1.bias[[0, 50]] = 0
    reference = logits(model)
    export = {"num_attention_heads": 3, "ffn_hidden_size": 94}
    _, result = prune(model, "mcore_minitron", {"export_config": export}, None, {"forward_loop": loop_over(3)})
    assert all(h[2] == 0 and (h[[0, 1, 3]] > 0).all() for h in result["importance"].heads)
    assert (model.config.num_attention_heads, model.config.num_query_groups) == (3, 3)
    assert model.decoder.layers[0].self_attention.linear_qkv.bias.shape == (3 * 3 * hn,)
    assert model.embedding.position_embeddings.weight.shape == (SEQ, 64)
    torch.testing.assert_close(logits(model), reference, rtol=0, atol=1e-12)


def test_hidden_channels_ranked_by_norm_outputs_and_the_pruned_model_trains():
    model = build(gqa_config(num_layers=2))
    dead = [3, 10, 41]
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.input_layernorm.weight[dead] = 0
            layer.pre_mlp_layernorm.weight[dead] = 0
    embedding = model.embedding.word_embeddings.weight.detach().clone()
    _, result = prune(model, "mcore_minitron", {"export_config": {"hidden_size": 61}}, None,
                      {"forward_loop": loop_over(0)})
    assert (result["importance"].hidden[dead] == 0).all() and (result["importance"].hidden > 0).sum() == 61
    keep = [i for i in range(64) if i not in dead]
    torch.testing.assert_close(model.embedding.word_embeddings.weight, embedding[:, keep], rtol=0, atol=0)
    assert model.output_layer.weight.shape == (VOCAB, 61) and model.decoder.final_layernorm.weight.shape == (61,)
    assert model.decoder.layers[1].self_attention.linear_proj.weight.shape == (61, 64)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    ids = tokens(0)
    for _ in range(6):
        loss = model(ids, POS, None, labels=ids).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses  # measured 4.85 -> 2.75


def test_depth_pruning_drops_the_named_layers_bitwise():
    model = build(gqa_config(num_layers=3))
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        model.decoder.layers[0].self_attention.linear_proj.weight.zero_()
        model.decoder.layers[0].mlp.linear_fc2.weight.zero_()
    reference = logits(model)
    drop_mcore_language_model_layers(model, layers_to_drop=[1])  # numbered from 1, as Model Optimizer's
    assert model.config.num_layers == 2
    for new, old in ((0, 1), (1, 2)):
        key = "self_attention.linear_qkv.weight"
        assert torch.equal(model.state_dict()[f"decoder.layers.{new}.{key}"], before[f"decoder.layers.{old}.{key}"])
    assert torch.equal(logits(model), reference)


@pytest.mark.parametrize("export, message", [
    ({"hidden_size": 65}, r"export_config\['hidden_size'\] \(65\) must not exceed the model's hidden_size \(64\)"),
    ({"num_attention_heads": 6, "num_query_groups": 4}, r"num_attention_heads \(6\) must be divisible by "
                                                        r"num_query_groups \(4\)"),
    ({"num_attention_heads": 8, "num_query_groups": 2}, r"num_attention_heads / num_query_groups \(8 / 2\) must not "
                                                        r"exceed the model's heads per query group \(8 / 4\)"),
    ({"hidden": 32}, r"unknown key\(s\) \['hidden'\]; supported"),
    ({"num_layers": 0}, r"export_config\['num_layers'\] \(0\) must be a positive integer"),
])
def test_bad_export_config_names_field_value_and_rule(export, message):
    with pytest.raises(ValueError, match=message):
        check_export_config(gqa_config(), export)


def test_refusals():
    model = build(gqa_config(num_layers=2))
    with pytest.raises(ValueError, match="mode 'fastnas' is not supported"):
        prune(model, "fastnas", {"export_config": {}}, None, {"forward_loop": loop_over(0)})
    with pytest.raises(ValueError, match=r"params/flops search is not supported"):
        prune(model, "mcore_minitron", {"params": "60%"}, None, {"forward_loop": loop_over(0)})
    with pytest.raises(ValueError, match="config\\['forward_loop'\\] is required"):
        prune(model, "mcore_minitron", {"export_config": {"num_layers": 1}}, None, {})
    with pytest.raises(ValueError, match=r"layers_to_drop \[3\] must name distinct layers in 1..2"):
        drop_mcore_language_model_layers(model, layers_to_drop=[3])
    sinks = build(gqa_config(num_layers=1, softmax_type="learnable"))  # per-head attention sinks: not sliced
    reference = logits(sinks)
    with pytest.raises(ValueError, match=r"does not know how to slice decoder\.layers\.0\.self_attention\."
                                         r"core_attention\.softmax_offset \(shape \(8,\)\)"):
        prune(sinks, "mcore_minitron", {"export_config": {"num_attention_heads": 4}}, None,
              {"forward_loop": loop_over(0)})
    assert sinks.config.num_attention_heads == 8 and torch.equal(logits(sinks), reference)  # left as it was
    moe = build(gqa_config(num_layers=1, num_moe_experts=2, moe_router_topk=1, ffn_hidden_size=32))
    with pytest.raises(ValueError, match=r"does not support MoE layers .*: config.num_moe_experts is 2"):
        prune(moe, "mcore_minitron", {"export_config": {"num_layers": 1}}, None, {"forward_loop": loop_over(0)})
    gated = build(gqa_config(num_layers=1, attention_output_gate=True))
    with pytest.raises(ValueError, match=r"does not support gated attention output .*attention_output_gate is True"):
        prune(gated, "mcore_minitron", {"export_config": {"num_layers": 1}}, None, {"forward_loop": loop_over(0)})


def test_saved_scores_prune_another_copy_without_calibration(tmp_path):
    scores = str(tmp_path / "scores.pt")
    first, second = build(gqa_config(num_layers=2)), build(gqa_config(num_layers=2))
    export = {"export_config": {"ffn_hidden_size": 48, "num_layers": 1}}
    prune(first, "mcore_minitron", export, None, {"forward_loop": loop_over(0), "checkpoint": scores})
    prune(second, "mcore_minitron", export, None, {"checkpoint": scores})
    assert os.path.isfile(scores)
    for key, value in first.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(second.state_dict()[key], value), key


@pytest.mark.gpu
def test_prunes_a_model_on_cuda():
    model = build(gqa_config(params_dtype=torch.float64)).cuda()
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.mlp.linear_fc1.weight[[5, 7, 96 + 5, 96 + 7]] = 0
    ids, pos = tokens(100).cuda(), POS.cuda()
    with torch.no_grad():
        reference = model(ids, pos, None)
    prune(model, "mcore_minitron", {"export_config": {"ffn_hidden_size": 94}}, None,
          {"forward_loop": lambda m: m(tokens(0).cuda(), pos, None)})
    assert all(p.is_cuda and p.dtype == torch.float64 for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, None), reference, rtol=0, atol=1e-10)


EXPORT = {"hidden_size": 56, "ffn_hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2}


def _prune_at_dp2_save_and_load(ckpt: str) -> dict[str, object]:
    """Each DP rank calibrates on its own batch, prunes, saves; a fresh model of the pruned config loads it."""
    parallel_state.initialize_model_parallel()
    try:
        rank = torch.distributed.get_rank()
        model = build(gqa_config())
        _, result = prune(model, "mcore_minitron", {"export_config": EXPORT}, None,
                          {"forward_loop": loop_over(rank)})
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
        fresh = build(model.config, seed=7)
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt))
        return {"state": {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
                "hidden": result["importance"].hidden, "logits": logits(model), "loaded": logits(fresh)}
    finally:
        parallel_state.destroy_model_parallel()


def test_dp2_equals_one_process_and_the_checkpoint_round_trips(tmp_path):
    one = build(gqa_config())
    _, result = prune(one, "mcore_minitron", {"export_config": EXPORT}, None, {"forward_loop": loop_over(0, 1)})
    for rank_result in run_on_ranks(2, _prune_at_dp2_save_and_load, str(tmp_path / "ckpt")):
        torch.testing.assert_close(rank_result["hidden"], result["importance"].hidden, rtol=1e-6, atol=0)
        assert rank_result["state"].keys() == {k for k, v in one.state_dict().items() if isinstance(v, torch.Tensor)}
        for key, value in one.state_dict().items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(rank_result["state"][key], value), key
        assert torch.equal(rank_result["loaded"], rank_result["logits"])


def test_pruned_llama_exports_to_hf_and_transformers_gives_our_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    from megatron_core.models.hf import AutoBridge
    from tests.models.hf.hf_models import make_hf_model

    make_hf_model("llama", tmp_path / "hf")
    bridge = AutoBridge.from_hf_pretrained(str(tmp_path / "hf"))
    (model,) = bridge.to_megatron_model()
    model.eval()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12).expand(2, 12)
    export = {"hidden_size": 40, "ffn_hidden_size": 64, "num_attention_heads": 4, "num_layers": 1}
    prune(model, "mcore_minitron", {"export_config": export}, None, {"forward_loop": lambda m: m(ids, pos, None)})
    out = str(tmp_path / "pruned")
    pruned_hf_bridge(bridge, model).save_hf_pretrained(model, out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert (hf.config.hidden_size, hf.config.intermediate_size, hf.config.num_attention_heads,
            hf.config.num_key_value_heads, hf.config.num_hidden_layers, hf.config.head_dim) == (40, 64, 4, 2, 1, 8)
    with torch.no_grad():
        ours = model(ids, pos, None)
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert os.path.isfile(os.path.join(out, "config.json"))
