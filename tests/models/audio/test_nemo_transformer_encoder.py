"""``TransformerEncoder`` (SDPA backend, fp32 CPU) against the hand-written reference in encoder_reference.py.

Each pre-encoder (``conv``, ``depth_conv``, ``stacking`` with an explicitly silent frame) and each block option
(``qkv_bias``, ``qk_norm``, causal, causal with ``left_context``) is compared on the module's own weights (1e-5);
the explicit-softmax ``MultiHeadAttention`` agrees with SDPA and its KV cache with the full causal pass; activation
recomputation gives the same gradients; the optional kernels fail with ``ImportError`` naming their extra.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.models.audio._attention_masks import causal_disallow_mask
from megatron_core.models.audio.nemo_transformer_encoder import (
    GELU,
    LayerNorm,
    MultiHeadAttention,
    MultiHeadAttentionWithFA,
    MultiHeadAttentionWithSDPA,
    MultiHeadAttentionWithTE,
    TransformerEncoder,
    apply_rope,
    compute_rope_params,
)
from tests.models.audio import encoder_reference as ref

MELS, D, HEADS, LAYERS = 6, 16, 4, 2


def _have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _encoder(seed: int = 0, **kwargs) -> TransformerEncoder:
    torch.manual_seed(seed)
    options = dict(n_mels=MELS, d_model=D, n_heads=HEADS, n_layers=LAYERS, drop_rate=0.0, attn_impl="sdpa",
                   nan_debug=True)
    encoder = TransformerEncoder(**{**options, **kwargs}).eval()
    with torch.no_grad():  # move norms and biases off their initial values so that every term counts
        for name, param in encoder.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("pad_frame"):
                param.add_(0.3 * torch.randn_like(param))
    return encoder


def _inputs(frames: int = 13, lengths=(13, 9, 5)) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(len(lengths), MELS, frames), torch.tensor(lengths)


CASES = {
    "conv": dict(pre_encode="conv"),
    "depth_conv": dict(pre_encode="depth_conv"),
    "stacking": dict(pre_encode="stacking", subsampling_factor=3),
    "bias_qknorm": dict(pre_encode="conv", qkv_bias=True, qk_norm=True),
    "causal": dict(pre_encode="stacking", subsampling_factor=2, causal_mask=True),
    "left_context": dict(pre_encode="stacking", subsampling_factor=2, causal_mask=True, left_context=1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_encoder_matches_reference(case: str):
    options = CASES[case]
    encoder = _encoder(**options)
    x, lengths = _inputs()
    if options["pre_encode"] == "stacking":
        x[1, :, 2] = 0.0  # a silent frame inside a clip is replaced by pad_frame too, as in NeMo
    with torch.no_grad():
        out, out_lengths = encoder(x, lengths)
        packed, packed_lengths = encoder(x, lengths, return_packed=True)
    state = {k: v.detach() for k, v in encoder.state_dict().items()}
    expected, expected_lengths = ref.encoder(
        state, x, lengths, kind=options["pre_encode"], n_layers=LAYERS, heads=HEADS,
        factor=options.get("subsampling_factor", 4), causal=options.get("causal_mask", False),
        left_context=options.get("left_context"), qk_norm=options.get("qk_norm", False))
    assert out.shape == expected.shape and torch.equal(out_lengths, expected_lengths)
    valid = torch.arange(out.shape[-1])[None, :] < out_lengths[:, None]
    torch.testing.assert_close(out.transpose(1, 2)[valid], expected.transpose(1, 2)[valid], rtol=1e-5, atol=1e-5)
    if "left_context" not in options:  # padded rows that see no key at all are backend-defined
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed, out.transpose(1, 2)[valid], rtol=0, atol=0)
    assert torch.equal(packed_lengths, out_lengths)


def test_state_dict_keys_follow_nemo():
    keys = set(_encoder(pre_encode="depth_conv", qkv_bias=True, qk_norm=True, n_layers=1).state_dict())
    assert {"pre_encode.conv1.weight", "pre_encode.dw_conv2.weight", "pre_encode.pw_conv3.bias",
            "layers.0.pre_norm.scale", "layers.0.pre_norm.shift", "layers.0.mha.w_query.weight",
            "layers.0.mha.w_query.bias", "layers.0.mha.out_proj.bias", "layers.0.mha.q_norm.weight",
            "layers.0.mha.k_norm.bias", "layers.0.post_norm.scale", "layers.0.ffn.ffn.0.weight",
            "layers.0.ffn.ffn.2.bias", "layer_norm.weight", "final_norm.bias"} <= keys
    assert len(keys) == 10 + 4 + 20  # 5 convs; 2 encoder norms; the block: 4 norm, 8 projection, 4 qk-norm, 4 ffn
    stacking = set(_encoder(pre_encode="stacking", n_layers=0).state_dict())
    assert stacking == {"pre_encode.proj_out.weight", "pre_encode.pad_frame", "layer_norm.weight", "layer_norm.bias",
                        "final_norm.weight", "final_norm.bias"}


@pytest.mark.parametrize("left_context", [None, 2])
def test_explicit_attention_matches_sdpa_and_cache(left_context):
    torch.manual_seed(2)
    explicit = MultiHeadAttention(D, D, num_heads=HEADS, context_length=16, causal_mask=True, qkv_bias=True,
                                  left_context=left_context).eval()
    sdpa = MultiHeadAttentionWithSDPA(D, D, num_heads=HEADS, causal_mask=True, qkv_bias=True,
                                      left_context=left_context).eval()
    sdpa.load_state_dict({k: v for k, v in explicit.state_dict().items() if k != "mask"})
    x = torch.randn(2, 7, D)
    full = explicit(x)
    torch.testing.assert_close(full, sdpa(x), rtol=1e-5, atol=1e-5)
    expected = ref.attention(x, explicit.state_dict(), "", HEADS, torch.tensor([7, 7]), True, left_context, False)
    torch.testing.assert_close(full, expected, rtol=1e-5, atol=1e-5)
    steps = [explicit(x[:, :3], use_cache=True), explicit(x[:, 3:5], use_cache=True), explicit(x[:, 5:], use_cache=True)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    explicit.reset_cache()
    assert explicit.cache_k is None and "cache_k" not in explicit.state_dict()
    assert explicit.mask.shape == (16, 16) and "mask" in explicit.state_dict()
    long = torch.randn(1, 20, D)  # longer than the stored mask: built on the fly
    torch.testing.assert_close(explicit(long), sdpa(long), rtol=1e-5, atol=1e-5)


def test_masks_and_left_context_rules():
    hidden = causal_disallow_mask(3, 5, 1, None)
    assert hidden.tolist() == [[True, False, False, True, True], [True, True, False, False, True],
                               [True, True, True, False, False]]
    with pytest.raises(ValueError, match="left_context"):
        TransformerEncoder(n_mels=MELS, d_model=D, n_heads=HEADS, n_layers=1, left_context=3, attn_impl="sdpa")
    assert TransformerEncoder(n_mels=MELS, d_model=D, n_heads=HEADS, n_layers=1, left_context=-1,
                              attn_impl="sdpa").left_context is None
    with pytest.raises(ValueError, match="pre_encode"):
        TransformerEncoder(pre_encode="lstm", attn_impl="sdpa")
    with pytest.raises(ValueError, match="attn_impl"):
        TransformerEncoder(n_mels=MELS, d_model=D, n_heads=HEADS, n_layers=1, attn_impl="xformers")


def test_recompute_gives_same_gradients():
    x, lengths = _inputs()
    grads = []
    for recompute in (False, True):
        encoder = _encoder(recompute_layers=recompute).train()
        inputs = x.clone().requires_grad_(True)
        out, _ = encoder(inputs, lengths)
        out.square().sum().backward()
        grads.append([inputs.grad] + [p.grad for p in encoder.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_nan_debug_and_freeze():
    encoder = _encoder()
    x, lengths = _inputs()
    x[0, 0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="pre_encode"):
        encoder(x, lengths)
    encoder.freeze()
    assert not any(p.requires_grad for p in encoder.parameters())
    encoder.unfreeze()
    assert all(p.requires_grad for p in encoder.parameters())
    encoder.reset_cache()


def test_small_helpers():
    x = torch.linspace(-3, 3, 13)
    torch.testing.assert_close(GELU()(x), torch.nn.functional.gelu(x, approximate="tanh"))
    norm = LayerNorm(13)
    with torch.no_grad():
        norm.scale.uniform_(0.5, 1.5)
        norm.shift.normal_()
    torch.testing.assert_close(norm(x.to(torch.bfloat16)).float(), ref.layer_norm(x, norm.scale, norm.shift).detach(),
                               rtol=2e-2, atol=2e-2)
    cos, sin = compute_rope_params(4, theta_base=100, context_length=5)
    q = torch.randn(1, 1, 5, 4)
    rotated = apply_rope(q, cos, sin)
    for t in range(5):  # each pair (i, i + 2) turns by t / 100 ** (i / 2)
        for i in range(2):
            angle = torch.tensor(t / 100 ** (2 * i / 4))
            a, b = q[0, 0, t, i], q[0, 0, t, i + 2]
            torch.testing.assert_close(rotated[0, 0, t, i], a * torch.cos(angle) - b * torch.sin(angle))
            torch.testing.assert_close(rotated[0, 0, t, i + 2], b * torch.cos(angle) + a * torch.sin(angle))


@pytest.mark.skipif(_have("flash_attn"), reason="flash-attn is installed")
def test_flash_attention_backend_names_its_extra():
    attention = MultiHeadAttentionWithFA(D, D, num_heads=HEADS)
    with pytest.raises(ImportError, match=r"\[flash\]"):
        attention(torch.randn(1, 3, D))


@pytest.mark.skipif(_have("transformer_engine"), reason="Transformer Engine is installed")
def test_te_backend_names_its_extra_and_auto_falls_back():
    with pytest.raises(ImportError, match=r"\[te\]"):
        MultiHeadAttentionWithTE(D, D, num_heads=HEADS)
    assert TransformerEncoder(n_mels=MELS, d_model=D, n_heads=HEADS, n_layers=1).attn_impl == "sdpa"
