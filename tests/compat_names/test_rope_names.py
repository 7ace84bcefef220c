"""``models.common.embeddings.rope_utils`` and ``MultimodalRotaryEmbedding`` against megatron-core 0.16.1 and
Hugging Face's Qwen2-VL rotary embedding (fp32, same angles and inputs)."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_core.models.common.embeddings import rotary_pos_embedding as rope_path
from megatron_core.models.common.embeddings.rope_utils import (
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_with_cos_sin,
    get_pos_emb_on_this_cp_rank,
)
from megatron_core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron_core.transformer.rotary_pos_embedding import RotaryEmbedding


class FakeGroup:
    """A context-parallel group seen from one rank: only ``size()`` and ``rank()`` are read."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _config(interleaved: bool = False, mla: bool = False) -> types.SimpleNamespace:
    return types.SimpleNamespace(rotary_interleaved=interleaved, multi_latent_attention=mla, apply_rope_fusion=False,
                                 mrope_section=None)


def _angles(n: int, dim: int, interleaved: bool = False) -> torch.Tensor:
    return RotaryEmbedding(dim, 1.0, rotary_interleaved=interleaved, use_cpu_initialization=True)(n)


@pytest.fixture(scope="module")
def their_rope():
    return pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("mla", [False, True])
def test_sbhd_matches_megatron_core(their_rope, interleaved, mla):
    torch.manual_seed(0)
    t = torch.randn(6, 2, 3, 10)  # 8 rotated channels, 2 passed through
    freqs = _angles(6, 8, interleaved)
    ours = apply_rotary_pos_emb(t, freqs, _config(interleaved), mscale=0.8, cp_group=FakeGroup(1, 0),
                                mla_rotary_interleaved=mla)
    # 0.16.1 reads MLA's channel order from config.multi_latent_attention
    theirs = their_rope.apply_rotary_pos_emb(t, freqs, _config(interleaved, mla), mscale=0.8, cp_group=FakeGroup(1, 0))
    torch.testing.assert_close(ours, theirs)
    # mla_rotary_interleaved=None takes it from the config
    torch.testing.assert_close(apply_rotary_pos_emb(t, freqs, _config(interleaved, mla), mscale=0.8,
                                                    mla_rotary_interleaved=None), theirs)


@pytest.mark.parametrize("cp_rank", [0, 1])
@pytest.mark.parametrize("packed_freqs", [False, True])
def test_thd_matches_megatron_core(their_rope, cp_rank, packed_freqs):
    torch.manual_seed(1)
    cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)  # three documents, each a multiple of 2 * cp
    group = FakeGroup(2, cp_rank)
    t = torch.randn(12, 2, 8, requires_grad=True)  # this CP rank's half of the 24 packed tokens
    freqs = _angles(24 if packed_freqs else 12, 8)  # every packed token's angles, or the longest document's
    ours = apply_rotary_pos_emb(t, freqs, _config(), cu_seqlens=cu, cp_group=group)
    theirs = their_rope.apply_rotary_pos_emb(t, freqs, _config(), cu_seqlens=cu, cp_group=group)
    torch.testing.assert_close(ours, theirs)
    grad = torch.randn_like(ours)
    (g_ours,) = torch.autograd.grad(ours, t, grad)
    (g_theirs,) = torch.autograd.grad(theirs, t, grad)
    torch.testing.assert_close(g_ours, g_theirs)


def test_with_cos_sin_rotates_by_the_given_angles():
    torch.manual_seed(2)
    t = torch.randn(5, 2, 3, 12)
    angles = torch.rand(5, 4) * 6  # rot = 8 of the 12 channels
    for interleaved in (False, True):
        full = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
        expected = apply_rotary_pos_emb(t, full[:, None, None, :], _config(interleaved), cp_group=FakeGroup(1, 0))
        out = apply_rotary_pos_emb_with_cos_sin(t, angles.cos(), angles.sin(), rotary_interleaved=interleaved)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(out[..., 8:], t[..., 8:])
    with pytest.raises(ValueError, match=r"\[s, rot/2\]"):
        apply_rotary_pos_emb_with_cos_sin(t, angles.cos()[:3], angles.sin()[:3])


def test_pos_emb_on_this_cp_rank_and_reexports():
    emb = torch.arange(16.0).view(2, 8, 1)  # sequence on dim 1
    assert get_pos_emb_on_this_cp_rank(emb, 1, FakeGroup(2, 0))[0, :, 0].tolist() == [0, 1, 6, 7]
    assert get_pos_emb_on_this_cp_rank(emb, -2, FakeGroup(2, 1))[1, :, 0].tolist() == [10, 11, 12, 13]
    with pytest.raises(ValueError, match="divisible"):
        get_pos_emb_on_this_cp_rank(emb, 1, FakeGroup(3, 0))
    with pytest.raises(ValueError, match="cp_group"):
        get_pos_emb_on_this_cp_rank(emb, 1, None)
    assert rope_path.apply_rotary_pos_emb is apply_rotary_pos_emb
    assert rope_path.get_pos_emb_on_this_cp_rank is get_pos_emb_on_this_cp_rank


def _positions() -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randint(0, 40, (3, 2, 6))


def test_mrope_matches_megatron_core(monkeypatch):
    their = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # 0.16.1 builds inv_freq on the GPU
    ref = their.MultimodalRotaryEmbedding(16, 1.0, seq_len_interpolation_factor=2.0, rotary_base=500)
    ours = MultimodalRotaryEmbedding(16, 1.0, seq_len_interpolation_factor=2.0, rotary_base=500)
    torch.testing.assert_close(ours(_positions(), [2, 3, 3]), ref(_positions(), [2, 3, 3]))


def test_mrope_rotation_matches_hugging_face_qwen2_vl():
    hf = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig

    section = [4, 6, 6]
    config = Qwen2VLTextConfig(hidden_size=64, num_attention_heads=2, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": section})
    positions = _positions()
    q = torch.randn(2, 2, 6, 32)  # [b, heads, s, head_dim]
    cos, sin = hf.Qwen2VLRotaryEmbedding(config)(q, positions)
    expected, _ = hf.apply_rotary_pos_emb(q, q, cos, sin)
    angles = MultimodalRotaryEmbedding(32, 1.0)(positions, section)
    assert angles.shape == (6, 2, 1, 32)
    ours = apply_rotary_pos_emb(q.permute(2, 0, 1, 3), angles, _config(), cp_group=FakeGroup(1, 0))
    torch.testing.assert_close(ours.permute(1, 2, 0, 3), expected)


def test_mrope_layouts_and_checks():
    positions = _positions()
    plain = MultimodalRotaryEmbedding(16, 1.0)(positions, [2, 3, 3])
    pairs = MultimodalRotaryEmbedding(16, 1.0, rotary_interleaved=True)(positions, [2, 3, 3])
    # Frequency i uses the component of its section: 0, 1 -> temporal, 2-4 -> height, 5-7 -> width.
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    component = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
    chosen = positions.float()[component, :, :].permute(2, 1, 0) * inv_freq  # [s, b, 8]
    torch.testing.assert_close(plain[:, :, 0], torch.cat((chosen, chosen), -1))
    torch.testing.assert_close(pairs[:, :, 0], chosen.repeat_interleave(2, -1))
    with pytest.raises(ValueError, match="sum to rot_dim / 2"):
        MultimodalRotaryEmbedding(16, 1.0)(positions, [2, 2, 2])
    with pytest.raises(ValueError, match=r"\[3, batch, seq\]"):
        MultimodalRotaryEmbedding(16, 1.0)(positions[:2], [2, 3, 3])
    module = MultimodalRotaryEmbedding(16, 1.0).to(torch.bfloat16)
    assert module.inv_freq.dtype == torch.float32 and "inv_freq" not in module.state_dict()
