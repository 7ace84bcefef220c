"""The ``fsdp_dtensor`` state-dict helpers on hand-built state dicts (expert renaming at EP=2, SwiGLU split)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_core.transformer.fsdp_dtensor_checkpoint import (
    expert_param_local_key,
    flatten_state_dict,
    get_ep_layer_offset,
    get_expert_index_from_key,
    get_global_unique_param_name,
    handle_experts_in_state_dict,
    handle_fp8_extra_state_case,
    handle_swiglu_in_state_dict,
    state_dict_differences,
)
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import build, llama_like

LOCAL_KEYS = ["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
              "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
              "decoder.layers.1.mlp.experts.linear_fc1.weight0_w",
              "decoder.layers.1.mlp.experts.linear_fc2.weight1",
              "decoder.layers.1.mlp.router.weight"]


def test_expert_index_parsing():
    assert [get_expert_index_from_key(k) for k in LOCAL_KEYS] == [0, 1, 0, 1, None]
    with pytest.raises(ValueError, match="cannot parse the expert index"):
        get_expert_index_from_key("decoder.layers.0.mlp.experts.linear_fc1.weight")


def _rename_round_trip() -> tuple[int, list[str], list[str]]:
    pgs = SimpleNamespace(ep=dist.group.WORLD)
    state = {k: torch.tensor(float(i)) for i, k in enumerate(LOCAL_KEYS)}
    renamed = handle_experts_in_state_dict(state, num_experts=4, pg_collection=pgs)
    back = [expert_param_local_key(k, 4, pgs) for k in renamed]
    assert [renamed[k].item() for k in renamed] == list(range(len(LOCAL_KEYS)))
    return get_ep_layer_offset(4, pgs), list(renamed), back


def test_expert_renaming_round_trip_at_ep2():
    (off0, keys0, back0), (off1, keys1, back1) = run_on_ranks(2, _rename_round_trip)
    assert (off0, off1) == (0, 2)
    assert keys0 == LOCAL_KEYS and back0 == LOCAL_KEYS and back1 == LOCAL_KEYS
    assert keys1 == ["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight",
                     "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight",
                     "decoder.layers.1.mlp.experts.linear_fc1.weight2_w",
                     "decoder.layers.1.mlp.experts.linear_fc2.weight3",
                     "decoder.layers.1.mlp.router.weight"]


def test_ep_offset_without_experts_or_ep_group():
    assert get_ep_layer_offset(None) == 0
    assert get_ep_layer_offset(6) == 0  # no EP group: one rank holds every expert


def test_swiglu_split_is_bitwise_and_in_place():
    torch.manual_seed(0)
    model = build(llama_like())
    sd = model.state_dict()
    handle_fp8_extra_state_case(sd)
    assert not any(k.endswith("_extra_state") for k in sd)
    key = "decoder.layers.0.mlp.linear_fc1.weight"
    fc1 = sd[key].clone()
    opt = {"state": {key: {"exp_avg": torch.randn_like(fc1), "step": torch.tensor(3.0)}}}
    exp_avg = opt["state"][key]["exp_avg"].clone()
    split, split_opt = handle_swiglu_in_state_dict(model, sd, opt)
    assert key not in split and "decoder.layers.0.mlp.linear_fc2.weight" in split
    assert torch.equal(torch.cat([split[key + "_w"], split[key + "_v"]]), fc1)
    assert torch.equal(torch.cat([split_opt["state"][key + "_w"]["exp_avg"],
                                  split_opt["state"][key + "_v"]["exp_avg"]]), exp_avg)
    assert split_opt["state"][key + "_v"]["step"].item() == 3.0
    with torch.no_grad():  # a load into the sections writes into the parameter
        split[key + "_v"].fill_(7.0)
    assert torch.all(model.decoder.layers[0].mlp.linear_fc1.weight[fc1.shape[0] // 2:] == 7.0)
    assert torch.equal(model.decoder.layers[0].mlp.linear_fc1.weight[:fc1.shape[0] // 2], fc1[:fc1.shape[0] // 2])


def test_non_gated_fc1_is_not_split():
    model = build(llama_like(gated_linear_unit=False))
    split, _ = handle_swiglu_in_state_dict(model, model.state_dict(), None)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in split


def test_flatten_and_differences():
    flat = flatten_state_dict({"a": {"b": 1, "c": [2, {"d": 3}]}})
    assert flat == {"a.b": 1, "a.c.0": 2, "a.c.1.d": 3}
    meta = {"x": SimpleNamespace(size=torch.Size([2])), "y": SimpleNamespace(size=torch.Size([3]))}
    only_meta, only_load, shapes = state_dict_differences(meta, {"x": torch.zeros(4), "z": torch.zeros(1)})
    assert only_meta == ["y"] and only_load == ["z"] and shapes == [("x", (2,), (4,))]


def test_global_unique_param_name_matches_the_optimizer_map():
    from megatron_core.optimizer.param_groups import _global_param_names

    model = build(llama_like())
    names = _global_param_names([model])
    for name, param in model.named_parameters():
        assert get_global_unique_param_name([model], param) == names[id(param)] == name
    with pytest.raises(ValueError, match="not found"):
        get_global_unique_param_name([model], torch.nn.Parameter(torch.zeros(1)))


def test_gdn_split_matches_the_sharded_checkpoint_sections():
    from megatron_core import tensor_parallel
    from megatron_core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron_core.transformer.fsdp_dtensor_checkpoint import handle_gdn_in_state_dict
    from megatron_core.transformer.torch_norm import WrappedTorchNorm
    from tests.ssm.gdn_hf import megatron_config

    torch.manual_seed(0)
    submodules = GatedDeltaNetSubmodules(in_proj=tensor_parallel.ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                         out_proj=tensor_parallel.RowParallelLinear)
    layer = GatedDeltaNet(megatron_config(), submodules, layer_number=1, conv_bias=True)
    sd = {k: v for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)}
    handle_fp8_extra_state_case(sd)
    opt = {"state": {"in_proj.weight": {"exp_avg": sd["in_proj.weight"] * 2, "step": torch.tensor(1.0)}}}
    split, split_opt = handle_gdn_in_state_dict(layer, sd, opt)
    reference = {}
    for key in ("in_proj.weight", "conv1d.weight", "conv1d.bias"):
        for sub in layer.sharded_state_dict()[key].build():
            reference[sub.key] = sub.data
    assert "in_proj.weight" not in split and "conv1d.weight" not in split
    for key, value in reference.items():
        assert torch.equal(split[key], value), key
    for name in ("query", "z", "alpha"):
        assert torch.equal(split_opt["state"][f"in_proj.weight.{name}"]["exp_avg"],
                           2 * reference[f"in_proj.weight.{name}"])


def test_global_names_rename_the_layer_and_the_expert_together():
    """A sequential expert in a later pipeline stage gets its global layer and expert index (both renames); the
    optimizer's parameter-group map uses the same names."""
    from megatron_core.optimizer.param_groups import _global_param_names
    from megatron_core.transformer.fsdp_dtensor_checkpoint import global_param_names

    experts = torch.nn.Module()
    experts.local_experts = torch.nn.ModuleList([torch.nn.Linear(2, 2, bias=False)])
    experts.ep_group = None  # one EP rank: local index = global index
    layer = torch.nn.Module()
    layer.layer_number = 3  # the first layer of this stage is the model's third
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = experts
    chunk = torch.nn.Module()
    chunk.decoder = torch.nn.Module()
    chunk.decoder.layers = torch.nn.ModuleList([layer])
    weight = experts.local_experts[0].weight
    want = "decoder.layers.2.mlp.experts.local_experts.0.weight"
    assert get_global_unique_param_name([chunk], weight) == want
    assert global_param_names([chunk])[id(weight)] == want == _global_param_names([chunk])[id(weight)]
