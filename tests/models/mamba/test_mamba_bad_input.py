"""Bad hybrid patterns and Mamba sizes raise ValueError naming the values; inference contexts are refused."""

from __future__ import annotations

import pytest

from megatron_core.models.mamba import MambaModel
from megatron_core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron_core.ssm.mamba_hybrid_layer_allocation import get_hybrid_layer_counts, parse_hybrid_pattern
from tests.models.mamba.mamba_test_utils import VOCAB, batch, build, config


def test_unknown_symbol_is_named():
    with pytest.raises(ValueError, match=r"'X' at position 1"):
        parse_hybrid_pattern("MX*")
    with pytest.raises(ValueError, match=r"'X'"):
        build("MXM")


def test_pattern_length_must_match_num_layers():
    with pytest.raises(ValueError, match=r"'M\*M' has 3 layers but config.num_layers is 4"):
        MambaModel(config("M*M-"), mamba_stack_spec, VOCAB, 32, hybrid_layer_pattern="M*M")


def test_mtp_depths_must_agree():
    with pytest.raises(ValueError, match=r"depth 1 is 'MM' and depth 2 is 'M\*'"):
        parse_hybrid_pattern("M*M*/MM/M*")
    assert get_hybrid_layer_counts("M-M-|M-M*-/MM/MM")["M"] == 8


def test_heads_not_divisible_by_groups():
    with pytest.raises(ValueError, match=r"heads \(4\) must be divisible by config.mamba_num_groups \(3\)"):
        build("MM", mamba_num_groups=3)


def test_non_dynamic_inference_context_refused():
    """Only the dynamic context (with its Mamba state slots) serves the Mamba layers."""
    model = build("MM")
    ids, pos, _ = batch()
    with pytest.raises(NotImplementedError, match="served by the dynamic engine"):
        model(ids, pos, None, inference_context=object())
