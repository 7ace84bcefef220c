"""Megatron-Core 0.19's ``config_overrides``: ``ParamKey`` matching, the standard overrides, custom groups.

The standard overrides must group exactly as the earlier conditions did; custom overrides give their parameters
their own schedule; conflicting or inconsistent overrides raise; the parameter -> group map can be dumped.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.optimizer import (
    OptimizerConfig,
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
    get_megatron_optimizer,
    get_param_groups,
    get_standard_config_overrides,
)
from megatron_core.optimizer.param_groups import get_param_groups_from_overrides
from megatron_core.optimizer_param_scheduler import (
    OptimizerParamScheduler,
    ParamGroupOverride,
    combine_param_group_overrides,
    get_canonical_lr_for_logging,
)
from megatron_core.transformer import TransformerConfig


def _model(qk_layernorm: bool = False) -> GPTModel:
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                               use_cpu_initialization=True, add_bias_linear=True, qk_layernorm=qk_layernorm,
                               normalization="RMSNorm")
    return GPTModel(config, get_gpt_layer_local_spec(qk_layernorm=qk_layernorm), 64, 8,
                    share_embeddings_and_output_weights=False)


def _grouping(groups: list[dict]) -> set[tuple]:
    """Each group as (frozenset of param ids, wd_mult, lr_mult, max_lr, min_lr, default_config)."""
    return {(frozenset(id(p) for p in g["params"]), g["wd_mult"], g["lr_mult"], g["max_lr"], g["min_lr"],
             g["default_config"]) for g in groups}


def test_param_key_matches_any_of_its_parts():
    param = torch.nn.Parameter(torch.zeros(3, 4))
    param.is_embedding_or_output_parameter = True
    assert ParamKey(name="*.weight").matches(param, "decoder.layers.0.mlp.linear_fc1.weight")
    assert not ParamKey(name="*.bias").matches(param, "decoder.layers.0.mlp.linear_fc1.weight")
    assert ParamKey(name=("*.bias", "*fc1*")).matches(param, "decoder.layers.0.mlp.linear_fc1.weight")
    assert ParamKey(attr="is_embedding_or_output_parameter").matches(param, "x")
    assert not ParamKey(attr="sequence_parallel").matches(param, "x")
    assert ParamKey(predicate=ParamPredicate("2d", lambda p: p.dim() == 2)).matches(param, "x")
    assert ParamKey(with_name_predicate=ParamWithNamePredicate("x", lambda p, n: n == "x")).matches(param, "x")
    assert not ParamKey().matches(param, "x")
    # Predicates compare and hash by name: the same key built twice selects one group.
    a = ParamKey(predicate=ParamPredicate("s1", lambda p: p.dim() == 1))
    b = ParamKey(predicate=ParamPredicate("s1", lambda p: p.dim() == 1))
    assert a == b and len({a: 1, b: 2}) == 1


@pytest.mark.parametrize("decoupled", [None, 5e-4])
def test_standard_overrides_group_as_the_earlier_conditions(decoupled):
    model = _model()
    config = OptimizerConfig(lr=1e-3, min_lr=1e-5, weight_decay=0.1, decoupled_lr=decoupled,
                             decoupled_min_lr=1e-6 if decoupled else None)
    new = get_param_groups_from_overrides([model], config, get_standard_config_overrides(config))
    old = get_param_groups([model], config)
    assert _grouping(new) == _grouping(old)
    for group in new:
        assert group["lr"] == group["max_lr"] and group["weight_decay"] == pytest.approx(0.1 * group["wd_mult"])
        assert group["is_decoupled_lr"] == (decoupled is not None and group["max_lr"] == decoupled)


def test_apply_wd_to_qk_layernorm_keeps_weight_decay_on_qk_norms():
    model = _model(qk_layernorm=True)
    config = OptimizerConfig(lr=1e-3, weight_decay=0.1, apply_wd_to_qk_layernorm=True)
    groups = get_param_groups_from_overrides([model], config, get_standard_config_overrides(config))
    wd = {id(p): g["wd_mult"] for g in groups for p in g["params"]}
    for name, param in model.named_parameters():
        if "q_layernorm" in name or "k_layernorm" in name:
            assert wd[id(param)] == 1.0, name
        elif param.dim() == 1:
            assert wd[id(param)] == 0.0, name


def test_custom_override_gets_its_own_schedule_and_the_default_lr_is_logged():
    model = _model()
    config = OptimizerConfig(lr=1e-3, min_lr=0.0, weight_decay=0.1)
    overrides = get_standard_config_overrides(config)
    overrides[ParamKey(name="*.linear_fc1.weight")] = ParamGroupOverride(max_lr=1e-2, min_lr=1e-3, wd_mult=0.5)
    optimizer = get_megatron_optimizer(config, [model], overrides)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=0.0, lr_warmup_steps=0,
                                        lr_decay_steps=10, lr_decay_style="linear", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=10, wd_incr_style="constant")
    scheduler.step(5)
    fc1 = {id(m.mlp.linear_fc1.weight) for m in model.decoder.layers}
    for group in optimizer.param_groups:
        ids = {id(p) for p in group["params"]}
        if ids & fc1:
            assert ids == fc1 and not group["default_config"]
            assert group["lr"] == pytest.approx(1e-3 + 0.5 * (1e-2 - 1e-3))
            assert group["weight_decay"] == pytest.approx(0.05)
        elif group["wd_mult"] == 1.0:
            assert group["lr"] == pytest.approx(0.5e-3)
    assert get_canonical_lr_for_logging(optimizer.param_groups) == pytest.approx(0.5e-3)


def test_bad_overrides_raise():
    model = _model()
    config = OptimizerConfig(lr=1e-3)
    with pytest.raises(ValueError, match="conflicting param group overrides for 'wd_mult'"):
        get_megatron_optimizer(config, [model], {ParamKey(name="*.bias"): {"wd_mult": 0.0},
                                                 ParamKey(name="*layers.0*"): {"wd_mult": 1.0}})
    with pytest.raises(ValueError, match="sets optimizer='sgd'"):
        get_megatron_optimizer(config, [model], {ParamKey(name="*.bias"): {"optimizer": "sgd"}})
    with pytest.raises(TypeError, match="third argument is config_overrides"):
        get_megatron_optimizer(config, [model], lambda name, param: False)
    with pytest.raises(TypeError, match="keys must be ParamKey"):
        get_megatron_optimizer(config, [model], {"*.bias": {"wd_mult": 0.0}})
    with pytest.raises(ValueError, match="not both"):
        get_megatron_optimizer(config, [model], {}, lr_mult=2.0)
    assert combine_param_group_overrides([None, {"wd_mult": 0.0}, {"wd_mult": 0.0}]) == {"wd_mult": 0.0}


def test_earlier_keyword_conditions_still_work():
    model = _model()
    config = OptimizerConfig(lr=1e-3, weight_decay=0.1)
    optimizer = get_megatron_optimizer(config, [model], scale_lr_cond=lambda name, p: "output_layer" in name,
                                       lr_mult=3.0)
    scaled = [g for g in optimizer.param_groups if g["lr_mult"] == 3.0]
    assert [id(p) for g in scaled for p in g["params"]] == [id(model.output_layer.weight)]
    assert not scaled[0]["default_config"]


def test_empty_overrides_put_every_parameter_in_one_default_group():
    model = _model()
    groups = get_param_groups_from_overrides([model], OptimizerConfig(lr=1e-3, weight_decay=0.1), {})
    assert len(groups) == 1 and groups[0]["wd_mult"] == 1.0 and groups[0]["default_config"]


def test_dump_param_to_param_group_map(tmp_path):
    model = _model()
    config = OptimizerConfig(lr=1e-3, weight_decay=0.1)
    optimizer = get_megatron_optimizer(config, [model], dump_param_to_param_group_map=str(tmp_path / "map"))
    names = [name for name, _ in model.named_parameters()]
    loaded = {name: -1 for name in names}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "map"))
    index = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    assert loaded == {name: index[id(p)] for name, p in model.named_parameters()}


def test_dumped_names_use_global_layer_numbers(tmp_path):
    model = _model()
    for layer in model.decoder.layers:  # as the second of two pipeline stages of 2 layers each
        layer.layer_number += 2
    get_megatron_optimizer(OptimizerConfig(lr=1e-3), [model], dump_param_to_param_group_map=str(tmp_path / "map"))
    expected = [name.replace("layers.0.", "layers.2.").replace("layers.1.", "layers.3.")
                for name, _ in model.named_parameters()]
    loaded = {name: -1 for name in expected}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "map"))
    assert all(value >= 0 for value in loaded.values())
