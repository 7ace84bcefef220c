"""``inference.shards_spec``: the multi-shard layout string, its normalisation and its refusals."""

from __future__ import annotations

import pytest

from megatron_core.inference.shards_spec import (
    VALID_KEYS,
    InferenceShardSpec,
    normalize_shard_specs,
    parse_inference_shards_spec,
    spec_declares_disaggregation,
)


def test_parse_in_rank_order_with_defaults_and_roles():
    specs = parse_inference_shards_spec(" tp=4 , role=Prefill + tp=2,dp=2,role=decode; ep=2,dp=2,expt_tp=1 ", 10)
    assert specs == [InferenceShardSpec(tp=4, expt_tp=4, role="prefill"),
                     InferenceShardSpec(tp=2, dp=2, expt_tp=2, role="decode"),
                     InferenceShardSpec(ep=2, dp=2, expt_tp=1)]
    assert [s.world_size for s in specs] == [4, 4, 2]
    assert specs[0].to_dict() == {"tp": 4, "pp": 1, "ep": 1, "dp": 1, "expt_tp": 4, "role": "prefill"}
    assert specs[2].to_dict() == {"tp": 1, "pp": 1, "ep": 2, "dp": 2, "expt_tp": 1}
    assert VALID_KEYS == ("tp", "pp", "ep", "expt_tp", "dp", "cp", "role")


def test_normalize_accepts_strings_specs_and_dicts():
    expected = [InferenceShardSpec(tp=2, role="prefill"), InferenceShardSpec(pp=2, role="decode")]
    assert normalize_shard_specs("tp=2,role=prefill;pp=2,role=decode", 4) == expected
    assert normalize_shard_specs(expected, 4) == expected
    assert normalize_shard_specs([{"tp": 2, "role": "prefill"}, {"pp": 2, "role": "decode"}], 4) == expected


def test_disaggregation_is_declared_by_a_role_key_only():
    assert spec_declares_disaggregation("tp=2,role=prefill+tp=1")
    assert spec_declares_disaggregation("tp=1; role = decode")
    assert not spec_declares_disaggregation("tp=2,dp=1+tp=1,dp=2")
    assert not spec_declares_disaggregation("")
    assert not spec_declares_disaggregation(None)


@pytest.mark.parametrize("spec, world, message", [
    ("tp=2,role=prefill+tp=1", 4, "the shards use 2 + 1 = 3 ranks but world_size is 4"),
    ("tp=2,foo=1", 2, "key 'foo' in shard 'tp=2,foo=1' is not one of tp, pp, ep, expt_tp, dp, cp, role"),
    ("tp=2,pp", 2, "entry 'pp' in shard 'tp=2,pp' must be key=value"),
    ("tp=two", 2, "tp='two' in shard 'tp=two' must be an integer"),
    ("tp=2,role=encode", 2, "role='encode' in shard 'tp=2,role=encode' must be one of prefill, decode"),
    ("tp=2,tp=1", 2, "key 'tp' is set twice in shard 'tp=2,tp=1'"),
    ("tp=0", 0, "tp=0 must be a positive integer"),
    ("tp=2,cp=2", 4, "cp=2 must be 1"),
    ("tp=2,ep=4", 2, "expt_tp=2 x ep=4 x pp=1 = 8 must divide the shard's tp=2 x pp=1 x dp=1 = 2 ranks"),
    (" + ; ", 0, "no shard given"),
], ids=["rank_total", "unknown_key", "no_equals", "not_int", "bad_role", "repeated", "zero", "cp", "experts",
        "empty"])
def test_refusals_name_key_value_and_rule(spec, world, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        parse_inference_shards_spec(spec, world)


def test_normalize_refuses_unknown_dict_keys_and_other_types():
    with pytest.raises(ValueError, match=r"shard 1 has unknown keys \['size'\]"):
        normalize_shard_specs([{"tp": 1}, {"size": 2}], 3)
    with pytest.raises(ValueError, match=r"shard 0 is a int; expected an InferenceShardSpec"):
        normalize_shard_specs([2], 2)
    with pytest.raises(ValueError, match=r"the shards use 2 ranks but world_size is 3"):
        normalize_shard_specs([InferenceShardSpec(tp=2)], 3)
