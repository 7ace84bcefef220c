"""ModelParallelConfig(cross_entropy_fusion_impl='te'): Megatron-Core's warning; the native fused kernel runs."""

from __future__ import annotations

import pytest

from megatron_core import ModelParallelConfig


def test_te_impl_warns_and_native_is_silent(recwarn):
    with pytest.warns(UserWarning, match="known stability issues"):
        config = ModelParallelConfig(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
    assert config.cross_entropy_fusion_impl == "te"
    ModelParallelConfig(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native")
    assert not [w for w in recwarn if "stability" in str(w.message)]
    with pytest.raises(ValueError, match="must be 'native' or 'te'"):
        ModelParallelConfig(cross_entropy_fusion_impl="fast")
