"""Which layers each pipeline rank / virtual stage builds, with global layer offsets."""

from __future__ import annotations

import pytest
import torch

from megatron_core.transformer import TransformerConfig, get_num_layers_to_build, get_transformer_layer_offset


def _cfg(num_layers, pp, vpp=None, **kw):
    return TransformerConfig(
        num_layers=num_layers, hidden_size=16, num_attention_heads=2, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32, **kw,
    )


def _assignment(cfg):
    """Global layer indices per (vp_stage, pp_rank), checked to cover 0..num_layers-1 exactly once."""
    vpp = cfg.virtual_pipeline_model_parallel_size or 1
    out = {}
    for v in range(vpp):
        for p in range(cfg.pipeline_model_parallel_size):
            kwargs = dict(pp_rank=p, vp_stage=v if vpp > 1 else None)
            n = get_num_layers_to_build(cfg, **kwargs)
            offset = get_transformer_layer_offset(cfg, **kwargs)
            out[(v, p)] = list(range(offset, offset + n))
    flat = [i for v in range(vpp) for p in range(cfg.pipeline_model_parallel_size) for i in out[(v, p)]]
    assert flat == list(range(cfg.num_layers))
    return out


def test_even_split():
    assert _assignment(_cfg(8, 4)) == {(0, p): [2 * p, 2 * p + 1] for p in range(4)}


def test_even_split_with_virtual_stages():
    got = _assignment(_cfg(8, 2, vpp=2))
    assert got == {(0, 0): [0, 1], (0, 1): [2, 3], (1, 0): [4, 5], (1, 1): [6, 7]}


def test_uneven_first_last():
    got = _assignment(_cfg(8, 4, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=3))
    assert [len(got[(0, p)]) for p in range(4)] == [1, 2, 2, 3]


def test_account_for_embedding_and_loss():
    got = _assignment(_cfg(6, 4, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True))
    assert [len(got[(0, p)]) for p in range(4)] == [1, 2, 2, 1]


def test_explicit_layout():
    cfg = _cfg(5, 2, pipeline_model_parallel_layout="Et|(tt|)*1t|tL")
    got = _assignment(cfg)
    assert got == {(0, 0): [0], (0, 1): [1, 2], (1, 0): [3], (1, 1): [4]}
    cfg = _cfg(3, 2, pipeline_model_parallel_layout=[["embedding", "decoder"], ["decoder", "decoder", "loss"]])
    assert _assignment(cfg) == {(0, 0): [0], (0, 1): [1, 2]}


def test_missing_vp_stage_raises():
    with pytest.raises(ValueError, match="vp_stage must be given"):
        get_num_layers_to_build(_cfg(8, 2, vpp=2), pp_rank=0)
