"""``models.hybrid`` is the home of the hybrid model (Megatron-Core 0.19); the ssm / models.mamba paths
re-export the same objects, and ``MambaModel`` keeps the deprecated ``mamba_stack_spec`` keyword."""

from __future__ import annotations

import pytest
import torch

from megatron_core.models import hybrid
from megatron_core.models.hybrid import (
    hybrid_block,
    hybrid_layer_allocation,
    hybrid_layer_specs,
    hybrid_model,
)
from megatron_core.models.mamba import MambaModel, mamba_layer_specs, mamba_model
from megatron_core.ssm import mamba_block, mamba_hybrid_layer_allocation
from tests.models.mamba.mamba_test_utils import VOCAB, batch, config


def test_old_paths_reexport_the_same_objects():
    for old, new in ((mamba_block, hybrid_block), (mamba_hybrid_layer_allocation, hybrid_layer_allocation),
                     (mamba_layer_specs, hybrid_layer_specs)):
        assert old.__all__ == new.__all__
        for name in new.__all__:
            assert getattr(old, name) is getattr(new, name), name
    assert mamba_model.HybridModel is hybrid_model.HybridModel is hybrid.HybridModel
    assert hybrid.HybridStack is mamba_block.MambaStack
    assert mamba_layer_specs.mamba_stack_spec is hybrid_layer_specs.hybrid_stack_spec
    assert issubclass(MambaModel, hybrid.HybridModel)


def test_pattern_helpers_follow_megatron():
    assert hybrid_layer_allocation.get_hybrid_layer_counts("M-M-|M-M*-/MM/MM") == {
        "*": 1, "G": 0, "D": 0, "+": 0, "M": 8, "-": 4, "E": 0}
    assert hybrid_layer_allocation.get_hybrid_total_layer_count("M-M-|M-M*-/MM/MM") == 9
    assert hybrid_layer_allocation.get_hybrid_total_pipeline_segment_count("M-M-|M-M*-/MM/MM") == 2
    parsed = hybrid_layer_allocation.parse_hybrid_pattern("MMMM/*M/*M/*M")
    assert (parsed.main_pattern, parsed.mtp_pattern, parsed.mtp_num_depths) == ("MMMM", "*M", 3)


def test_mamba_model_is_hybrid_model_with_old_keyword():
    torch.manual_seed(7)
    new = hybrid.HybridModel(config("M*M-"), hybrid_layer_specs.hybrid_stack_spec, VOCAB, 32,
                             hybrid_layer_pattern="M*M-")
    torch.manual_seed(7)
    old = MambaModel(config("M*M-"), mamba_stack_spec=mamba_layer_specs.mamba_stack_spec, vocab_size=VOCAB,
                     max_sequence_length=32, hybrid_layer_pattern="M*M-")
    ids, pos, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(old(ids, pos, None), new(ids, pos, None), rtol=0, atol=0)
    with pytest.raises(ValueError, match="hybrid_stack_spec and mamba_stack_spec"):
        MambaModel(config("MM"), hybrid_layer_specs.hybrid_stack_spec, VOCAB, 32,
                   mamba_stack_spec=hybrid_layer_specs.hybrid_stack_spec)
