"""Helpers Megatron-Core code imports from ``dist_checkpointing.dict_utils`` / ``.utils`` / ``.serialization`` and
``transformer.module``, against megatron-core 0.16.1 (the installed oracle) on the same inputs.

``nested_items_iter`` yields Megatron-Core's ``(container, key, value)`` (the ``(path, value)`` walk is
``nested_path_items``); ``dict_map`` / ``dict_map_with_key`` rewrite leaves in place; ``map_reduce`` groups;
``inspect_types`` prints the same lines; ``conversion_helper`` / ``fp32_to_float16`` / ``float16_to_fp32`` convert
nested tuples/lists of tensors; ``zip_strict`` refuses unequal lengths; ``CkptShardedMetadata`` is importable.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.dist_checkpointing import dict_utils, utils
from megatron_core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron_core.dist_checkpointing.serialization import CkptShardedMetadata
from megatron_core.transformer import module

oracle_dict_utils = pytest.importorskip("megatron.core.dist_checkpointing.dict_utils")
oracle_module = pytest.importorskip("megatron.core.transformer.module")


def _nested() -> dict:
    return {"a": 1, "b": [2, {"c": 3, "d": [4, 5]}], "e": {"f": torch.ones(2, 3), "g": "text" * 20}}


def test_nested_items_iter_yields_container_key_value():
    ours, theirs = _nested(), _nested()
    got = [(k, v) for _, k, v in dict_utils.nested_items_iter(ours)]
    want = [(k, v) for _, k, v in oracle_dict_utils.nested_items_iter(theirs)]
    assert [k for k, _ in got] == [k for k, _ in want] and len(got) == 7
    for container, key, value in dict_utils.nested_items_iter(ours):
        assert container[key] is value
    assert [path for path, _ in dict_utils.nested_path_items(ours)][:3] == [("a",), ("b", 0), ("b", 1, "c")]


def test_dict_map_and_dict_map_with_key_rewrite_leaves_in_place():
    def f(v):
        return v * 2 if isinstance(v, int) else v

    def g(k, v):
        return f"{k}:{v}" if isinstance(v, int) else v

    for ours_fn, theirs_fn, fn in ((dict_utils.dict_map, oracle_dict_utils.dict_map, f),
                                   (dict_utils.dict_map_with_key, oracle_dict_utils.dict_map_with_key, g)):
        ours, theirs = _nested(), _nested()
        assert ours_fn(fn, ours) is None
        theirs_fn(fn, theirs)
        assert repr(ours) == repr(theirs) and ours != _nested()


def test_map_reduce_groups_like_megatron():
    words = ["apple", "avocado", "banana", "blueberry", "cherry"]
    args = (lambda w: w[0], len, sum)
    assert dict_utils.map_reduce(words, *args) == oracle_dict_utils.map_reduce(words, *args) == {
        "a": 12, "b": 15, "c": 6}
    assert dict_utils.map_reduce([1, 2, 1]) == oracle_dict_utils.map_reduce([1, 2, 1])


def test_inspect_types_prints_the_same(capsys):
    dict_utils.inspect_types(_nested())
    ours = capsys.readouterr().out
    oracle_dict_utils.inspect_types(_nested())
    assert ours == capsys.readouterr().out and "Tensor of shape torch.Size([2, 3])" in ours


def test_float16_conversions_match_megatron():
    tensors = (torch.ones(2), [torch.ones(2, dtype=torch.bfloat16), 3, (torch.ones(1, dtype=torch.float16),)])
    for ours, theirs in ((module.float16_to_fp32(tensors), oracle_module.float16_to_fp32(tensors)),
                         (module.fp32_to_float16(tensors, lambda t: t.half()),
                          oracle_module.fp32_to_float16(tensors, lambda t: t.half()))):
        flat_ours, flat_theirs = [], []
        module.conversion_helper(ours, flat_ours.append)
        oracle_module.conversion_helper(theirs, flat_theirs.append)
        assert type(ours) is type(theirs) and type(ours[1]) is type(theirs[1])
        assert [getattr(v, "dtype", v) for v in flat_ours] == [getattr(v, "dtype", v) for v in flat_theirs]
    assert module.float16_to_fp32(torch.ones(1, dtype=torch.bfloat16)).dtype == torch.float32
    assert module.conversion_helper([1, (2, 3)], lambda v: v + 1) == [2, (3, 4)]


def test_zip_strict_and_metadata_type():
    assert list(utils.zip_strict([1, 2], "ab")) == [(1, "a"), (2, "b")]
    with pytest.raises(ValueError, match=r"unequal lengths \[2, 3\]"):
        utils.zip_strict([1, 2], [1, 2, 3])
    assert CkptShardedMetadata == dict[str, ShardedTensor | ShardedObject]
