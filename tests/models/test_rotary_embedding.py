"""``RotaryEmbedding`` keeps ``inv_freq`` in fp32 and on the module's device."""

from __future__ import annotations

import torch

from megatron_core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


def _rope() -> RotaryEmbedding:
    return RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)


def test_dtype_cast_keeps_inv_freq_fp32() -> None:
    rope = _rope()
    before = rope.inv_freq.clone()
    rope.to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float32
    assert torch.equal(rope.inv_freq, before)


def test_device_move_takes_inv_freq_along() -> None:
    rope = _rope()
    rope(8)
    rope.to("meta")
    assert rope.inv_freq.device.type == "meta" and rope.inv_freq.dtype == torch.float32
    assert not rope._cache  # angles cached for the old device are dropped
