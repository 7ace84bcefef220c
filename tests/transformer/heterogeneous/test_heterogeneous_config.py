"""``HeterogeneousTransformerConfig``: parsing DeciLM ``block_configs`` (against Megatron-Core's parser),
per-layer configs, the two ``TransformerConfig`` flags, and bad input (each error names the values)."""

from __future__ import annotations

import json
import warnings

import pytest

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.heterogeneous.heterogeneous_config import (
    AttentionConfig,
    HeterogeneousTransformerConfig,
    MLPConfig,
)
from tests.transformer.heterogeneous.hetero_test_utils import BLOCKS, CONFIG, config, encoded_blocks


def _with_blocks(blocks: list[dict], **overrides) -> HeterogeneousTransformerConfig:
    return HeterogeneousTransformerConfig(**{**CONFIG, "num_layers": len(blocks), **overrides},
                                          heterogeneous_layers_config_encoded_json=json.dumps({"block_configs": blocks}))


def _attn(**fields) -> dict:
    return {"attention": {"no_op": False, "replace_with_linear": False, "n_heads_in_group": 2, **fields},
            "ffn": {"no_op": False, "replace_with_linear": False, "ffn_mult": 2.0}}


def _ffn(**fields) -> dict:
    return {"attention": {"no_op": False, "replace_with_linear": False, "n_heads_in_group": 2},
            "ffn": {"no_op": False, "replace_with_linear": False, "ffn_mult": 2.0, **fields}}


def test_blocks_parse_as_megatron_core_parses_them():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs_module = pytest.importorskip("megatron.core.transformer.heterogeneous.heterogeneous_config")
    theirs = theirs_module.HeterogeneousTransformerConfig(**CONFIG, heterogeneous_layers_config_encoded_json=
                                                          encoded_blocks())
    ours = config()
    assert ours.heterogeneous_block_specs and theirs.heterogeneous_block_specs
    assert [(b.attention.no_op, b.attention.replace_with_linear, b.attention.num_query_groups, b.mlp.no_op,
             b.mlp.replace_with_linear, b.mlp.ffn_hidden_size) for b in ours.per_block_parameters] == \
        [(b.attention.no_op, b.attention.replace_with_linear, b.attention.num_query_groups, b.mlp.no_op,
          b.mlp.replace_with_linear, b.mlp.ffn_hidden_size) for b in theirs.per_block_parameters]
    for n in range(1, len(BLOCKS) + 1):
        mine, theirs_n = ours.get_config_for_layer(n), theirs.get_config_for_layer(n)
        assert type(mine) is TransformerConfig
        assert (mine.num_query_groups, mine.ffn_hidden_size) == (theirs_n.num_query_groups, theirs_n.ffn_hidden_size)
        assert (mine.hidden_size, mine.normalization, mine.heterogeneous_block_specs) == (32, "RMSNorm", True)
    for mult, hidden in ((2.625, 8192), (1.5, 32), (5.25, 5120), (0.5, 4096)):
        assert MLPConfig.ffn_mult_to_intermediate_size(mult, hidden) == \
            theirs_module.MLPConfig.ffn_mult_to_intermediate_size(mult, hidden)


def test_json_is_read_from_the_path_and_kept_encoded(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(encoded_blocks())
    cfg = HeterogeneousTransformerConfig(**CONFIG, heterogeneous_layers_config_path=str(path))
    assert cfg.heterogeneous_layers_config_encoded_json == encoded_blocks()
    assert [b.attention.num_query_groups for b in cfg.per_block_parameters] == [None, None, 2, 4, 4]


def test_inert_deci_fields_are_accepted_and_mlp_key_works():
    blocks = [{"attention": {"no_op": False, "replace_with_linear": False, "n_heads_in_group": 4, "sparsify": None,
                             "window_length": None, "num_sink_tokens": None, "unshifted_sink": False,
                             "use_prefill_window_in_sink_attention": False},
               "mlp": {"no_op": False, "replace_with_linear": False, "ffn_hidden_size": 96, "sparsify": None}}]
    (block,) = _with_blocks(blocks).per_block_parameters
    assert block.attention == AttentionConfig(num_query_groups=2) and block.mlp == MLPConfig(ffn_hidden_size=96)


@pytest.mark.parametrize("blocks,overrides,match", [
    ("{not json", {}, r"heterogeneous_layers_config_encoded_json is not valid JSON"),
    (json.dumps({"layers": []}), {}, r"must be a JSON object with a 'block_configs' list, got \['layers'\]"),
    (json.dumps({"block_configs": BLOCKS[:3]}), {}, r"block_configs has 3 blocks but num_layers is 5"),
    (json.dumps({"block_configs": [{**BLOCKS[0], "moe": {}}] + BLOCKS[1:]}), {},
     r"block_configs\[0\] has unknown fields \['moe'\]"),
], ids=["malformed", "no_block_configs", "count", "unknown_block_field"])
def test_bad_documents_name_the_problem(blocks: str, overrides: dict, match: str):
    with pytest.raises(ValueError, match=match):
        HeterogeneousTransformerConfig(**{**CONFIG, **overrides}, heterogeneous_layers_config_encoded_json=blocks)


@pytest.mark.parametrize("block,match", [
    (_attn(n_heads_in_grup=2), r"block_configs\[0\]\.attention has an unknown field 'n_heads_in_grup' \(2\)"),
    (_ffn(intermediate_size=96), r"block_configs\[0\]\.ffn has an unknown field 'intermediate_size' \(96\)"),
    (_attn(window_length=128), r"block_configs\[0\]\.attention\.window_length \(128\) is not supported"),
    (_attn(no_op=True, replace_with_linear=True, n_heads_in_group=None), r"no_op and replace_with_linear"),
    (_attn(n_heads_in_group=3), r"n_heads_in_group \(3\) must be a positive divisor of num_attention_heads \(8\)"),
    (_attn(num_query_groups=5), r"num_query_groups \(5\) must be a positive divisor"),
    (_attn(no_op=True), r"sets a query-group count \(4\) but its attention is no_op"),
    (_ffn(replace_with_linear=True), r"sets an FFN width \(256\) but its MLP is replace_with_linear"),
    (_ffn(ffn_mult=-1.0), r"ffn_mult \(-1\.0\) must be a positive number"),
    (_ffn(no_op="yes"), r"ffn\.no_op \('yes'\) must be true or false"),
], ids=["unknown_attention_field", "unknown_ffn_field", "window", "both_switches", "group_size", "groups",
        "groups_with_no_op", "width_with_linear", "negative_mult", "switch_type"])
def test_bad_blocks_name_the_field_and_value(block: dict, match: str):
    with pytest.raises(ValueError, match=match):
        _with_blocks([block])


def test_bad_sources_and_layer_numbers_raise(tmp_path):
    with pytest.raises(ValueError, match="both are empty"):
        HeterogeneousTransformerConfig(**CONFIG)
    with pytest.raises(ValueError, match=r"heterogeneous_layers_config_path \('.*missing.json'\) cannot be read"):
        HeterogeneousTransformerConfig(**CONFIG, heterogeneous_layers_config_path=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"block_configs\[2\]: num_query_groups \(2\) must be divisible by "
                                         r"tensor_model_parallel_size \(4\)"):
        config(tensor_model_parallel_size=4, num_attention_heads=8)
    with pytest.raises(ValueError, match=r"layer_number \(6\) must be in \[1, 5\]"):
        config().get_config_for_layer(6)


def test_plain_config_with_heterogeneous_flag_is_refused_by_the_block():
    cfg = TransformerConfig(**CONFIG, heterogeneous_block_specs=True)
    with pytest.raises(ValueError, match="heterogeneous_block_specs=True needs a config with per-layer configs"):
        GPTModel(cfg, get_gpt_layer_local_spec(), 64, 16)


def test_heterogeneous_dist_checkpoint_saves_each_layer_under_its_own_key():
    def keys(**flags) -> set[str]:
        model = GPTModel(TransformerConfig(**{**CONFIG, "num_layers": 2}, **flags), get_gpt_layer_local_spec(), 64, 16)
        return {v.key for v in model.sharded_state_dict().values() if hasattr(v, "key")}

    assert "decoder.layers.self_attention.linear_qkv.weight" in keys()
    split = keys(hetereogenous_dist_checkpoint=True)
    assert {"decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.1.mlp.linear_fc2.weight"} <= split
    assert not any(k.startswith("decoder.layers.self_attention") for k in split)
