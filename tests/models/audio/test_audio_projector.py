"""``AudioProjection`` and ``PackedAudioEmbeddings`` (fp32, CPU): time stacking, masks and the projection against
plain torch on the projector's weights; packed projection; ``cu_seqlens`` / ``pad_to_lengths``; FLOP counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.models.audio import AudioProjection, PackedAudioEmbeddings
from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.mlp import MLPSubmodules

AUDIO, HIDDEN, FFN = 6, 8, 12


def _projection(projector_type: str, stack_factor: int) -> AudioProjection:
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=2,
                               add_bias_linear=True, activation_func=F.gelu, bias_activation_fusion=False,
                               use_cpu_initialization=True)
    projection = AudioProjection(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                                 projector_type, AUDIO, stack_factor=stack_factor)
    with torch.no_grad():
        for name, param in projection.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    return projection


def _plain(projection: AudioProjection, x: torch.Tensor) -> torch.Tensor:
    s = {k: v.detach() for k, v in projection.state_dict().items() if not k.endswith("_extra_state")}
    if projection.projector.projector_type == "affine":
        return x @ s["projector.encoder.weight"].T + s["projector.encoder.bias"]
    hidden = F.gelu(x @ s["projector.encoder.linear_fc1.weight"].T + s["projector.encoder.linear_fc1.bias"])
    return hidden @ s["projector.encoder.linear_fc2.weight"].T + s["projector.encoder.linear_fc2.bias"]


@pytest.mark.parametrize("projector_type", ["mlp", "affine"])
@pytest.mark.parametrize("stack_factor", [1, 3])
def test_stacked_projection_matches_plain_torch(projector_type: str, stack_factor: int):
    projection = _projection(projector_type, stack_factor)
    torch.manual_seed(1)
    x = torch.randn(2, 7, AUDIO)
    mask = torch.arange(7)[None, :] < torch.tensor([7, 4])[:, None]
    out, out_mask = projection(x, mask)
    steps = -(-7 // stack_factor)
    rows = []
    for b in range(2):
        frames = [x[b, t] * float(mask[b, t]) if t < 7 else torch.zeros(AUDIO) for t in range(steps * stack_factor)]
        rows.append(torch.stack([torch.cat(frames[s * stack_factor:(s + 1) * stack_factor]) for s in range(steps)]))
    expected = _plain(projection, torch.stack(rows)).transpose(0, 1)
    assert out.shape == (steps, 2, HIDDEN)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert out_mask.tolist() == [[True] * steps, [s * stack_factor < 4 for s in range(steps)]]
    no_mask_out, no_mask = projection(x)
    assert no_mask is None and no_mask_out.shape == out.shape


def test_packed_projection_and_errors():
    projection = _projection("mlp", 1)
    packed = PackedAudioEmbeddings(torch.randn(9, AUDIO), torch.tensor([5, 4]))
    out = projection.forward_packed(packed)
    torch.testing.assert_close(out.embeddings, _plain(projection, packed.embeddings), rtol=1e-5, atol=1e-5)
    assert out.lengths.dtype == torch.int32 and out.lengths.tolist() == [5, 4]
    with pytest.raises(ValueError, match="input_size"):
        projection(torch.randn(1, 3, AUDIO + 1))
    with pytest.raises(ValueError, match=r"\[total, hidden\]"):
        projection.forward_packed(PackedAudioEmbeddings(torch.randn(1, 9, AUDIO), torch.tensor([9])))
    with pytest.raises(NotImplementedError, match="stack_factor"):
        _projection("mlp", 2).forward_packed(packed)
    with pytest.raises(ValueError, match="stack_factor"):
        _projection("mlp", 0)


def test_packed_embeddings_helpers():
    embeddings = torch.arange(10, dtype=torch.float32).view(5, 2)
    packed = PackedAudioEmbeddings(embeddings, torch.tensor([3, 0, 2]))
    assert packed.cu_seqlens.tolist() == [0, 3, 3, 5] and packed.cu_seqlens.dtype == torch.int32
    assert packed.pad_to_lengths(torch.tensor([2, 0, 1])) is packed
    grown = packed.pad_to_lengths(torch.tensor([4, 1, 2]))
    assert grown.lengths.tolist() == [4, 1, 2]
    expected = torch.cat([embeddings[:3], torch.zeros(1, 2), torch.zeros(1, 2), embeddings[3:]])
    assert torch.equal(grown.embeddings, expected)


def test_projection_flops():
    lengths = torch.tensor([5, 3])
    mlp = _projection("mlp", 2).eval()
    forward = 2.0 * 10 * (2 * AUDIO) * FFN + 2.0 * 10 * FFN * HIDDEN
    flops = mlp.estimate_flops(lengths)
    assert flops["projection_forward"].item() == flops["projection_train"].item() == forward
    mlp.train()
    assert mlp.estimate_flops(lengths)["projection_train"].item() == 3 * forward
    assert mlp.estimate_flops(lengths, input_requires_grad=False)["projection_train"].item() == 2 * forward
    affine = _projection("affine", 1)
    assert affine.estimate_flops([5, 3], count_padded=False, include_backward=False)["projection_forward"].item() == \
        2.0 * 8 * AUDIO * HIDDEN
    assert affine.estimate_flops([])["projection_train"].item() == 0.0
