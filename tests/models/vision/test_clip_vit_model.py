"""``CLIPViTModel``, fp32 on CPU, against Hugging Face's vision encoders and Megatron-Core's own model.

- "clip": Hugging Face ``CLIPVisionModel`` (random weights mapped in) gives the same last hidden state,
  and ``post_layernorm`` on its class token is the pooled output, as LLaVA reads CLIP.
- "siglip": Hugging Face ``SiglipVisionModel`` (no head) gives the same last hidden state (``ln_post``).
- The installed Megatron-Core's ``CLIPViTModel`` (local ViT spec) has the same state-dict keys and, on
  the same weights, the same output and gradients.
- Shapes, subtype-specific parameters, and bad arguments / input (``ValueError`` naming the values).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_core.activations import quick_gelu
from megatron_core.models.vision import CLIPViTModel, get_vit_layer_with_local_spec
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks
from tests.megatron_oracle import megatron_on_cpu

HIDDEN, HEADS, FFN, LAYERS, IMG, PATCH = 64, 4, 128, 2, 32, 8
TOL = dict(rtol=1e-4, atol=1e-4)


def _config(**overrides) -> TransformerConfig:
    fields = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                  add_bias_linear=True, add_qkv_bias=True, activation_func=quick_gelu, layernorm_epsilon=1e-5,
                  hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
                  use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **overrides})


def _model(cfg: TransformerConfig | None = None, **kwargs) -> CLIPViTModel:
    kwargs = {"patch_dim": PATCH, "img_h": IMG, "img_w": IMG, **kwargs}
    return CLIPViTModel(cfg or _config(), get_vit_layer_with_local_spec(), **kwargs)


def _images(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, IMG, IMG, generator=torch.Generator().manual_seed(seed))


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm scales around 1), so that no mapping mistake hides behind an init value."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm_scale = param.dim() == 1 and "norm" in name and name.endswith("weight")
            param.copy_(1.0 + 0.2 * noise if is_norm_scale else 0.2 * noise)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Megatron's fused layout with one query head per group: for each head, its q, k and v rows."""
    per_head = [t.reshape(HEADS, HIDDEN // HEADS, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(per_head, dim=1).reshape(3 * HIDDEN, *q.shape[1:])


def _from_hf(hf_state: dict[str, torch.Tensor], subtype: str) -> dict[str, torch.Tensor]:
    """Our state dict from a Hugging Face CLIP / SigLIP vision model's (``vision_model.`` prefix stripped)."""
    state = {
        "conv1.weight": hf_state["embeddings.patch_embedding.weight"],
        "position_embeddings.weight": hf_state["embeddings.position_embedding.weight"],
    }
    if subtype == "clip":
        state["class_token"] = hf_state["embeddings.class_embedding"].view(1, 1, HIDDEN)
        state["ln_pre.weight"], state["ln_pre.bias"] = hf_state["pre_layrnorm.weight"], hf_state["pre_layrnorm.bias"]
    else:
        state["conv1.bias"] = hf_state["embeddings.patch_embedding.bias"]
        state["ln_post.weight"] = hf_state["post_layernorm.weight"]
        state["ln_post.bias"] = hf_state["post_layernorm.bias"]
    for i in range(LAYERS):
        src, dst = f"encoder.layers.{i}.", f"decoder.layers.{i}."
        attn = src + "self_attn."
        for kind in ("weight", "bias"):
            state[f"{dst}self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                *(hf_state[f"{attn}{p}_proj.{kind}"] for p in "qkv"))
            state[f"{dst}self_attention.linear_proj.{kind}"] = hf_state[f"{attn}out_proj.{kind}"]
            state[f"{dst}input_layernorm.{kind}"] = hf_state[f"{src}layer_norm1.{kind}"]
            state[f"{dst}pre_mlp_layernorm.{kind}"] = hf_state[f"{src}layer_norm2.{kind}"]
            state[f"{dst}mlp.linear_fc1.{kind}"] = hf_state[f"{src}mlp.fc1.{kind}"]
            state[f"{dst}mlp.linear_fc2.{kind}"] = hf_state[f"{src}mlp.fc2.{kind}"]
    return state


def _load(model: CLIPViTModel, state: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)


def test_clip_matches_hugging_face_clip_vision_model():
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.CLIPVisionConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        image_size=IMG, patch_size=PATCH, hidden_act="quick_gelu", layer_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    hf = transformers.CLIPVisionModel(hf_cfg).eval()
    _randomize(hf, seed=1)
    ours = _model().eval()
    hf_state = {k.removeprefix("vision_model."): v for k, v in hf.state_dict().items()}
    _load(ours, _from_hf(hf_state, "clip"))
    images = _images()
    with torch.no_grad():
        want = hf(pixel_values=images)
        got = ours(images)
    assert got.shape == (2, (IMG // PATCH) ** 2 + 1, HIDDEN)
    torch.testing.assert_close(got, want.last_hidden_state, **TOL)
    # LLaVA applies CLIP's post-layernorm outside the encoder; on the class token it is HF's pooled output.
    post = dict(hf.named_modules())[next(k for k, _ in hf.named_modules() if k.endswith("post_layernorm"))]
    torch.testing.assert_close(post(got[:, 0]), want.pooler_output, **TOL)


def test_siglip_matches_hugging_face_siglip_vision_model():
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.SiglipVisionConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        image_size=IMG, patch_size=PATCH, layer_norm_eps=1e-6, vision_use_head=False,
    )
    torch.manual_seed(0)
    hf = transformers.SiglipVisionModel(hf_cfg).eval()
    _randomize(hf, seed=2)
    cfg = _config(activation_func=functools.partial(F.gelu, approximate="tanh"), layernorm_epsilon=1e-6)
    ours = _model(cfg, model_subtype="siglip", add_class_token=False, class_token_len=0).eval()
    hf_state = {k.removeprefix("vision_model."): v for k, v in hf.state_dict().items()}
    _load(ours, _from_hf(hf_state, "siglip"))
    images = _images(seed=3)
    with torch.no_grad():
        want = hf(pixel_values=images).last_hidden_state
        got = ours(images)
    assert got.shape == (2, (IMG // PATCH) ** 2, HIDDEN)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize(("subtype", "kwargs", "expected"), [
    ("clip", dict(class_token_len=2), {"class_token", "conv1.weight", "ln_pre.weight", "ln_pre.bias"}),
    ("siglip", dict(add_class_token=False, class_token_len=0), {"conv1.weight", "conv1.bias", "ln_post.weight",
                                                                "ln_post.bias"}),
    ("internvit", dict(), {"class_token", "conv1.weight", "conv1.bias"}),
    ("clip", dict(add_class_token=False), {"conv1.weight", "ln_pre.weight", "ln_pre.bias"}),
])
def test_subtype_parameters_and_sequence_length(subtype: str, kwargs: dict, expected: set):
    model = _model(model_subtype=subtype, img_h=24, img_w=40, **kwargs)
    keys = {k for k in model.state_dict() if not k.startswith("decoder.")} - {"position_embeddings.weight"}
    assert keys == expected
    tokens = (24 // PATCH) * (40 // PATCH) + (model.class_token_len if model.add_class_token else 0)
    assert model.seq_length == tokens and model.position_embeddings.weight.shape == (tokens, HIDDEN)
    assert "position_ids" not in model.state_dict()
    out = model(torch.randn(3, 3, 24, 40))
    assert out.shape == (3, tokens, HIDDEN)


def test_attention_is_not_causal():
    """Changing the last patch changes the class token's output: every token sees every other token."""
    model = _model().eval()
    images = _images(batch=1)
    changed = images.clone()
    changed[..., -PATCH:, -PATCH:] += 1.0
    with torch.no_grad():
        first, second = model(images), model(changed)
    assert not torch.allclose(first[:, 0], second[:, 0])


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(img_h=30), r"img_h \(30\) must be a positive multiple of patch_dim \(8\)"),
    (dict(img_w=36), r"img_w \(36\) must be a positive multiple of patch_dim \(8\)"),
    (dict(patch_dim=0), r"patch_dim \(0\) must be positive"),
    (dict(model_subtype="radio"), r"model_subtype \('radio'\) must be one of \['clip', 'siglip', 'internvit', "
                                  r"'internvit300M'\]"),
    (dict(model_subtype="siglip"), r"'siglip' has no class token: got add_class_token=True, class_token_len=1"),
    (dict(class_token_len=0), r"class_token_len \(0\) must be positive when add_class_token=True"),
])
def test_bad_arguments_name_the_values(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        _model(**kwargs)


def test_bad_image_shape_names_it():
    with pytest.raises(ValueError, match=r"expects images \[b, 3, 32, 32\], got shape \(2, 3, 32, 24\)"):
        _model()(torch.randn(2, 3, 32, 24))


# --- Megatron-Core as an oracle ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _tensor_cuda_is_identity():
    """Megatron-Core's CLIPViTModel moves its position ids with ``.cuda()``; on a CPU machine keep them in place."""
    saved = torch.Tensor.cuda
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = saved


def _compare_with_megatron() -> list[str]:
    with megatron_on_cpu(), _tensor_cuda_is_identity():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.models.vision.clip_vit_model import CLIPViTModel as TheirModel
            from megatron.core.models.vision.vit_layer_specs import (
                get_vit_layer_with_local_spec as their_spec,
            )
            from megatron.core.transformer.enums import AttnMaskType as TheirMaskType
            from megatron.core.transformer.torch_norm import WrappedTorchNorm as TheirNorm
            from megatron.core.transformer.transformer_config import TransformerConfig as TheirConfig

        fields = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                      add_bias_linear=True, add_qkv_bias=True, activation_func=quick_gelu, hidden_dropout=0.0,
                      attention_dropout=0.0, bias_activation_fusion=False, use_cpu_initialization=True)
        spec = their_spec()
        # 0.16's local ViT spec still says causal; 0.19 (the API mirrored here) has no mask.
        spec.submodules.self_attention.params["attn_mask_type"] = TheirMaskType.no_mask
        torch.manual_seed(4)
        theirs = TheirModel(TheirConfig(**fields), spec, ln_pre_impl=TheirNorm, patch_dim=PATCH, img_h=IMG,
                            img_w=IMG, class_token_len=2)
        _randomize(theirs, seed=5)
        ours = _model(class_token_len=2)
        assert set(ours.state_dict()) == set(theirs.state_dict())
        ours.load_state_dict(theirs.state_dict())
        images = _images()
        want, got = theirs(images), ours(images)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(6))
        (want * weights).sum().backward()
        (got * weights).sum().backward()
        their_params = dict(theirs.named_parameters())
        for name, param in ours.named_parameters():
            torch.testing.assert_close(param.grad, their_params[name].grad, rtol=1e-4, atol=5e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
        return sorted(ours.state_dict())


def test_matches_megatron_core_clip_vit_model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core.models.vision.clip_vit_model")
    (keys,) = run_on_ranks(1, _compare_with_megatron)
    layer = "decoder.layers.0."
    assert {k[len(layer):] for k in keys if k.startswith(layer) and not k.endswith("_extra_state")} == {
        f"{part}.{kind}" for kind in ("weight", "bias") for part in (
            "input_layernorm", "self_attention.linear_qkv", "self_attention.linear_proj", "pre_mlp_layernorm",
            "mlp.linear_fc1", "mlp.linear_fc2")
    }
