"""PipelineParallelLayerLayout's Megatron-Core 0.19 surface: from_str, repr, LayerType layout, validation, queries."""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state as ps
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.enums import LayerType
from megatron_core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

E, T, M, L = LayerType.embedding, LayerType.decoder, LayerType.mtp, LayerType.loss


def test_from_str_equals_the_list_form_and_is_cached():
    text = "E|t|t*2|t||(t|)*2,t*2,L"
    as_list = [["embedding"], ["decoder"], ["decoder"] * 2, ["decoder"], [], ["decoder"], ["decoder"],
               ["decoder"] * 2 + ["loss"]]
    parsed, baseline = PipelineParallelLayerLayout.from_str(text, 4), PipelineParallelLayerLayout(as_list, 4)
    assert parsed.layout == baseline.layout == [[[E], []], [[T], [T]], [[T, T], [T]], [[T], [T, T, L]]]
    assert parsed.virtual_pipeline_model_parallel_size == baseline.virtual_pipeline_model_parallel_size == 2
    assert parsed.flatten_layout == [E] + [T] * 8 + [L]
    assert PipelineParallelLayerLayout.from_str(text, 4) is parsed
    assert PipelineParallelLayerLayout.get_num_stages_from_str("Et*3|(tt|)*29,m|L") == 32


def test_repr_is_the_input():
    assert repr(PipelineParallelLayerLayout("Et|t*4|t|tL", 2)) == "Et|t*4|t|tL"
    as_list = [["embedding", "decoder"], ["decoder"] * 4, ["decoder"], ["decoder", "loss"]]
    assert repr(PipelineParallelLayerLayout(as_list, 2)) == str(as_list)


def test_list_items_may_be_layer_types_names_or_symbols():
    layout = PipelineParallelLayerLayout([[E, " Decoder "], ["t", "L"]], 2)
    assert layout.layout == [[[E, T]], [[T, L]]]
    with pytest.raises(ValueError, match="not a valid LayerType"):
        PipelineParallelLayerLayout([["embedding"], ["transformer"]], 2)
    with pytest.raises(ValueError, match="list of lists"):
        PipelineParallelLayerLayout([[["embedding"]], "t"], 2)
    with pytest.raises(ValueError, match="unknown symbols"):
        PipelineParallelLayerLayout("Ex|tL", 2)


@pytest.mark.parametrize("layout, num_layers, mtp, match", [
    ([["decoder"] * 6, ["decoder", "loss"]], 7, None, "open with the embedding"),
    ([["embedding"] + ["decoder"] * 6, ["decoder"]], 7, None, "close with the loss"),
    ("Et|tL", 3, None, "places 2 decoder layers"),
    ("Et|tmL", 2, None, "places 1 MTP layers"),
    ("Em|ttL", 2, 1, "before MTP"),
    ("Et|m|m|L", 1, 2, "one stage"),
])
def test_validate_layer_layout(layout, num_layers, mtp, match):
    with pytest.raises(ValueError, match=match):
        PipelineParallelLayerLayout(layout, 2).validate_layer_layout(num_layers, mtp)


def test_validate_reports_mtp_before_the_last_rank():
    assert PipelineParallelLayerLayout("Et|t|m|L", 2).validate_layer_layout(2, 1) is True
    assert PipelineParallelLayerLayout("Et|tmL", 2).validate_layer_layout(2, 1) is False


def test_config_validates_and_derives_vpp():
    kw = dict(num_layers=7, hidden_size=16, num_attention_heads=2, pipeline_model_parallel_size=2,
              pipeline_dtype=torch.float32)
    cfg = TransformerConfig(pipeline_model_parallel_layout="Et|t*4|t|tL", **kw)
    assert isinstance(cfg.pipeline_model_parallel_layout, PipelineParallelLayerLayout)
    assert cfg.virtual_pipeline_model_parallel_size == 2
    with pytest.raises(ValueError, match="open with the embedding"):
        TransformerConfig(pipeline_model_parallel_layout=[["decoder"] * 6, ["decoder", "loss"]], **kw)


def test_layer_queries_follow_chunk_order():
    layout = PipelineParallelLayerLayout("Et|t*4|t|tL", 2)  # chunks: (v0,p0) (v0,p1) (v1,p0) (v1,p1)
    ps.set_virtual_pipeline_model_parallel_world_size(2)
    try:
        _check_queries(layout)
    finally:
        ps.set_virtual_pipeline_model_parallel_world_size(None)
    ps.set_pipeline_model_parallel_rank(1)
    try:  # without virtual pipeline parallelism the stage is 0 (as in Megatron-Core)
        assert layout.get_num_layers_to_build(vp_stage=1) == 4
    finally:
        ps.set_pipeline_model_parallel_rank(None)


def _check_queries(layout):
    assert [layout.get_num_layers_to_build(vp_stage=v, pp_rank=p) for v in (0, 1) for p in (0, 1)] == [1, 4, 1, 1]
    assert layout.get_layer_offset(vp_stage=1, pp_rank=1) == 6
    assert layout.get_layer_id_list(vp_stage=0, pp_rank=1) == [1, 2, 3, 4]
    assert layout.get_num_layers_to_build(LayerType.loss, vp_stage=1, pp_rank=1) == 1
    with pytest.raises(ValueError, match="vp_stage must be passed"):
        layout.get_num_layers_to_build(pp_rank=0)


def test_pretty_repr_merges_equal_ranks():
    text = PipelineParallelLayerLayout.from_str("Et*2|(tt|)*5,t|mL", 4).pretty_repr()
    assert text.splitlines() == [
        "                 VPP rank 0                 VPP rank 1",
        "PP rank 0        embedding,decoder*2        decoder*2",
        "PP rank 1        decoder*2                  decoder*2",
        "PP rank 2        decoder*2                  decoder",
        "PP rank 3        decoder*2                  mtp,loss",
    ]
    text = PipelineParallelLayerLayout([["embedding", "decoder"], ["decoder"], ["decoder"], ["decoder", "loss"]],
                                       4).pretty_repr()
    assert text.splitlines() == ["PP rank 0          embedding,decoder", "PP rank 1-2        decoder",
                                 "PP rank 3          decoder,loss"]
