"""``RADIOViTModel`` (fp32, CPU) against a direct computation from its own weights, and LLaVA with RADIO.

- The model equals a hand-written RADIO (patchify -> embedder -> position embeddings resampled from the grid
  -> class tokens -> plain pre-norm ViT layers -> ln_post) in eval mode at two image sizes (one smaller and one
  larger than the grid, so the grid is shrunk and enlarged) and in train mode (random CPE crops, drawn with the
  same seed and sampled here by hand-written bilinear interpolation; position-embedding dropout).
- The other CPE switches (no CPE, aspect-ratio select, interpolate only, ``force_cpe_eval_mode``,
  ``force_eval_mode``) give the grids their rules name.
- Dynamic resolution: two packed images equal each image encoded alone; video frames grouped into tubelets
  (one embedder or separate image / video embedders) equal each tubelet encoded alone; the checkpoint-compat
  hooks widen an image-only embedder.
- State-dict keys are Megatron-Core 0.19's (read off its ``radio.py``); ``fp8_pad_hook`` pads class tokens.
- A tiny LLaVA with ``"radio"`` / ``"radio-g"``: loss and gradients finite, the vision token count equals
  ``get_num_image_embeddings``; TP=2 equals one process (outputs and gradients).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import parallel_state, tensor_parallel
from megatron_core.models.vision import get_num_image_embeddings, get_vit_layer_with_local_spec
from megatron_core.models.vision.radio import RADIOViTModel, fp8_pad_hook
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.torch_norm import WrappedTorchNorm
from tests.dist_harness import run_on_ranks

HIDDEN, HEADS, FFN, LAYERS, PATCH, MAX_IMG, CTL = 32, 4, 64, 2, 4, 32, 3
TOL = dict(rtol=1e-5, atol=1e-5)


def _config(**overrides) -> TransformerConfig:
    fields = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                  add_bias_linear=True, add_qkv_bias=True, activation_func=F.gelu, layernorm_epsilon=1e-5,
                  hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
                  use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **overrides})


def _model(cfg: TransformerConfig | None = None, **kwargs) -> RADIOViTModel:
    kwargs = {"patch_dim": PATCH, "img_h": 16, "img_w": 24, "max_img_h": MAX_IMG, "max_img_w": MAX_IMG,
              "class_token_len": CTL, "ln_post_impl": WrappedTorchNorm, "embedder_bias": True, **kwargs}
    model = RADIOViTModel(cfg or _config(), get_vit_layer_with_local_spec(), **kwargs)
    _randomize(model, seed=1)
    return model


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm_scale = param.dim() == 1 and ("norm" in name or "ln_" in name) and name.endswith("weight")
            param.copy_(1.0 + 0.2 * noise if is_norm_scale else 0.2 * noise)


def _images(batch: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, h, w, generator=torch.Generator().manual_seed(seed))


# --- the direct computation ----------------------------------------------------------------------------------------
def _patches(images: torch.Tensor) -> torch.Tensor:
    """``[b, 3, H, W]`` -> ``[b, patches, 3*P*P]``, patches row-major, each flattened (channel, row, column)."""
    b = images.shape[0]
    cols = F.unfold(images, kernel_size=PATCH, stride=PATCH)  # [b, 3*P*P, patches], same flattening order
    return cols.transpose(1, 2).reshape(b, -1, 3 * PATCH * PATCH)


def _grid(state: dict) -> torch.Tensor:
    side = MAX_IMG // PATCH
    return state["position_embeddings"].reshape(side, side, HIDDEN)  # [R, C, h]


def _bilinear(grid: torch.Tensor, ys: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """``grid`` ``[R, C, h]`` at fractional pixel coordinates ``ys``, ``xs`` (inside the grid) -> ``[..., h]``."""
    y0, x0 = ys.floor().long().clamp(max=grid.shape[0] - 1), xs.floor().long().clamp(max=grid.shape[1] - 1)
    y1, x1 = (y0 + 1).clamp(max=grid.shape[0] - 1), (x0 + 1).clamp(max=grid.shape[1] - 1)
    wy, wx = (ys - y0)[..., None], (xs - x0)[..., None]
    return ((1 - wy) * (1 - wx) * grid[y0, x0] + (1 - wy) * wx * grid[y0, x1]
            + wy * (1 - wx) * grid[y1, x0] + wy * wx * grid[y1, x1])


def _train_pos(state: dict, rows: int, cols: int, batch: int) -> torch.Tensor:
    """RADIO's training CPE: per sample a random window (scale, aspect, offset drawn in that order) of the grid,
    sampled on a ``rows x cols`` lattice; ``[b, rows*cols, h]``."""
    scale = torch.rand(batch, 1, 1) * (1 - math.sqrt(0.1)) + math.sqrt(0.1)
    aspect = torch.exp(torch.rand(batch, 1, 1) * (2 * math.log(4 / 3)) - math.log(4 / 3))
    width, height = (scale * aspect).clamp(0, 1), (scale / aspect).clamp(0, 1)
    offset = torch.rand(batch, 1, 1, 2)
    left, top = offset[..., 0] * (1 - width), offset[..., 1] * (1 - height)
    grid = _grid(state)
    side = grid.shape[0] - 1  # align_corners=True: -1 and 1 are the centres of the edge cells
    out = []
    for i in range(batch):
        fx = left[i] + width[i] * torch.linspace(0, 1, cols)[None, :]
        fy = top[i] + height[i] * torch.linspace(0, 1, rows)[:, None]
        out.append(_bilinear(grid, (fy * side).expand(rows, cols), (fx * side).expand(rows, cols)))
    return torch.stack(out).reshape(batch, rows * cols, HIDDEN)


def _eval_pos(state: dict, rows: int, cols: int) -> torch.Tensor:
    """RADIO's eval CPE: the grid resized to ``max(rows, cols)`` squared, top-left ``rows x cols``."""
    grid = _grid(state).permute(2, 0, 1)[None]
    side = max(rows, cols)
    grid = F.interpolate(grid, size=(side, side), mode="bilinear", align_corners=False)
    return grid[0, :, :rows, :cols].reshape(HIDDEN, -1).t()[None]


def _layer(x: torch.Tensor, state: dict, prefix: str) -> torch.Tensor:
    """A pre-norm ViT layer, unmasked attention; Megatron's fused qkv rows are (head, [q, k, v], head_dim)."""
    def ln(t, name):
        return F.layer_norm(t, (HIDDEN,), state[f"{prefix}{name}.weight"], state[f"{prefix}{name}.bias"], 1e-5)

    b, s, _ = x.shape
    head_dim = HIDDEN // HEADS
    qkv = F.linear(ln(x, "input_layernorm"), state[f"{prefix}self_attention.linear_qkv.weight"],
                   state[f"{prefix}self_attention.linear_qkv.bias"]).reshape(b, s, HEADS, 3, head_dim)
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(head_dim), dim=-1)
    attn = (probs @ v).transpose(1, 2).reshape(b, s, HIDDEN)
    x = x + F.linear(attn, state[f"{prefix}self_attention.linear_proj.weight"],
                     state[f"{prefix}self_attention.linear_proj.bias"])
    hidden = F.gelu(F.linear(ln(x, "pre_mlp_layernorm"), state[f"{prefix}mlp.linear_fc1.weight"],
                             state[f"{prefix}mlp.linear_fc1.bias"]))
    return x + F.linear(hidden, state[f"{prefix}mlp.linear_fc2.weight"], state[f"{prefix}mlp.linear_fc2.bias"])


def _direct(state: dict, images: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Embed, add ``pos``, prepend the class tokens, run the layers and ``ln_post``."""
    return _encoder(state, F.linear(_patches(images), state["embedder.weight"], state["embedder.bias"]) + pos)


def _encoder(state: dict, x: torch.Tensor) -> torch.Tensor:
    """Class tokens, layers and ``ln_post`` on embedded patches ``[b, n, h]`` (position embeddings added)."""
    x = torch.cat([state["class_token"].expand(x.shape[0], -1, -1), x], dim=1)
    for i in range(LAYERS):
        x = _layer(x, state, f"decoder.layers.{i}.")
    return F.layer_norm(x, (HIDDEN,), state["ln_post.weight"], state["ln_post.bias"], 1e-5)


def _state(model: RADIOViTModel) -> dict:
    return {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


# --- the model -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("h", "w"), [(16, 24), (48, 40)])
def test_eval_matches_direct_computation(h: int, w: int):
    """16x24 (4x6 patches) shrinks the 8x8 grid to 6x6; 48x40 (12x10) enlarges it to 12x12."""
    model = _model(img_h=h, img_w=w).eval()
    images = _images(2, h, w)
    with torch.no_grad():
        got = model(images)
    want = _direct(_state(model), images, _eval_pos(_state(model), h // PATCH, w // PATCH))
    assert got.shape == (2, CTL + (h // PATCH) * (w // PATCH), HIDDEN) and model.seq_length == got.shape[1]
    torch.testing.assert_close(got, want, **TOL)


def test_image_of_the_grid_size_uses_the_grid_as_is():
    model = _model(img_h=MAX_IMG, img_w=MAX_IMG)
    images = _images(2, MAX_IMG, MAX_IMG)
    state = _state(model)
    for mode in (True, False):  # no crop in training either: the grid fits exactly
        model.train(mode)
        with torch.no_grad():
            torch.testing.assert_close(model(images), _direct(state, images, state["position_embeddings"]), **TOL)


@pytest.mark.parametrize("pos_dropout", [0.0, 0.5])
def test_train_matches_direct_computation_with_random_crops(pos_dropout: float):
    model = _model(pos_dropout=pos_dropout).train()
    images = _images(4, 16, 24, seed=3)
    torch.manual_seed(7)
    got = model(images)
    torch.manual_seed(7)
    pos = _train_pos(_state(model), 4, 6, 4)
    if pos_dropout:
        keep = torch.rand(4, 1, 1) > pos_dropout
        assert 0 < int(keep.sum()) < 4  # the seed drops some samples' embeddings and keeps others'
        pos = torch.where(keep, pos, 0)
    torch.testing.assert_close(got.detach(), _direct(_state(model), images, pos), **TOL)
    # Differently seeded crops give different outputs: the augmentation is live.
    torch.manual_seed(8)
    assert not torch.allclose(model(images), got)


def test_force_cpe_eval_mode_and_force_eval_mode():
    images = _images(2, 16, 24)
    cpe_eval = _model(force_cpe_eval_mode=True).train()
    want = _direct(_state(cpe_eval), images, _eval_pos(_state(cpe_eval), 4, 6))
    with torch.no_grad():
        torch.testing.assert_close(cpe_eval(images), want, **TOL)
    frozen = _model(force_eval_mode=True)
    frozen.train()
    assert not frozen.training and not any(m.training for m in frozen.modules())
    frozen.train(False)
    assert not frozen.training


def test_position_grid_rules():
    """No CPE crops the grid's top-left corner; aspect-ratio select crops the grid to the image's shape first;
    interpolate-only resizes the whole grid."""
    crop = _model(has_cpe=False)
    grid = crop.position_embeddings.detach().reshape(8, 8, HIDDEN)
    torch.testing.assert_close(crop.get_pos_enc(2)[0], grid[:4, :6].reshape(-1, HIDDEN))
    as_grid = grid.permute(2, 0, 1)[None]
    for kwargs in (dict(cpe_aspect_ratio_select=True), dict(has_cpe=False, cpe_aspect_ratio_select=True)):
        model = _model(**kwargs).eval()
        model.position_embeddings.data.copy_(crop.position_embeddings)
        # 4x6 patches, landscape: ceil(8 * 4 / 6) = 6 rows of the 8x8 grid, resized to 4x6.
        want = F.interpolate(as_grid[..., :6, :], size=(4, 6), mode="bilinear", align_corners=False)
        torch.testing.assert_close(model.get_pos_enc(1)[0], want[0].reshape(HIDDEN, -1).t())
    only = _model(interpolate_only_cpe=True).train()  # no random crop even in training
    only.position_embeddings.data.copy_(crop.position_embeddings)
    want = F.interpolate(as_grid, size=(4, 6), mode="bilinear", align_corners=False)
    torch.testing.assert_close(only.get_pos_enc(3)[0], want[0].reshape(HIDDEN, -1).t())
    idxs = torch.tensor([[0, 5], [2, 3]])
    picked = only.get_pos_enc(2, patch_idxs=idxs)
    torch.testing.assert_close(picked, torch.stack([only.get_pos_enc(1)[0][i] for i in idxs]))


def test_dynamic_resolution_equals_each_image_alone():
    sizes = [(16, 24), (8, 12)]
    packed = _model(dynamic_resolution=True).eval()
    images = [_images(1, h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    x = torch.cat([_patches(img) for img in images], dim=1)  # [1, 24 + 6, 48]
    lengths = [24, 6]
    bounds = torch.tensor([0, 24, 30], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds.clone(), max_seqlen_q=24,
                             max_seqlen_kv=24)
    with torch.no_grad():
        got = packed(x, imgs_sizes=torch.tensor(sizes), packed_seq_params=params)
        built = packed(x, imgs_sizes=sizes)  # packed_seq_params derived from imgs_sizes
    assert got.shape == (1, 2 * CTL + 30, HIDDEN)
    assert params.cu_seqlens_q.tolist() == [0, 24, 30] and params.max_seqlen_q == 24  # the caller's is untouched
    torch.testing.assert_close(built, got)
    offset = 0
    for (h, w), img, n in zip(sizes, images, lengths):
        alone = _model(img_h=h, img_w=w).eval()
        alone.load_state_dict(packed.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(got[:, offset:offset + CTL + n], alone(img), **TOL)
        offset += CTL + n


# --- video tubelets (temporal_patch_dim > 1) ------------------------------------------------------------------------
T = 2
VIDEO_SIZES = [(16, 24), (8, 12), (8, 12), (8, 12)]  # an image, then a video of 3 frames
NUM_FRAMES = [1, 3]


def _frames() -> list[torch.Tensor]:
    return [_patches(_images(1, h, w, seed=10 + i)) for i, (h, w) in enumerate(VIDEO_SIZES)]


def _video_model(**kwargs) -> RADIOViTModel:
    return _model(dynamic_resolution=True, temporal_patch_dim=T, **kwargs).eval()


def _check_tubelets(model: RADIOViTModel, tubelets: list[tuple[torch.Tensor, str, tuple[int, int]]]) -> None:
    """The packed video output equals each tubelet (features, embedder name, size) encoded alone."""
    frames = _frames()
    sizes = torch.tensor(VIDEO_SIZES)
    with torch.no_grad():
        out, new_sizes, new_num_frames = model(torch.cat(frames, dim=1), imgs_sizes=sizes, num_frames=NUM_FRAMES)
    assert new_sizes.tolist() == [[16, 24], [8, 12], [8, 12]] and new_num_frames == [1, 2]
    state = _state(model)
    offset = 0
    for features, embedder, (h, w) in tubelets:
        pos = _eval_pos(state, h // PATCH, w // PATCH)
        embedded = F.linear(features, state[f"{embedder}.weight"], state[f"{embedder}.bias"]) + pos
        n = CTL + features.shape[1]
        torch.testing.assert_close(out[:, offset:offset + n], _encoder(state, embedded), **TOL)
        offset += n
    assert offset == out.shape[1]


def test_video_frames_group_into_tubelets():
    """The image's features repeat T times; the video's frames pair up (0, 1), (2, 2): the last one repeats."""
    f = _frames()
    _check_tubelets(_video_model(), [(torch.cat([f[0], f[0]], -1), "embedder", (16, 24)),
                                     (torch.cat([f[1], f[2]], -1), "embedder", (8, 12)),
                                     (torch.cat([f[3], f[3]], -1), "embedder", (8, 12))])


def test_separate_video_embedder_embeds_images_alone():
    model = _video_model(separate_video_embedder=True)
    assert model.embedder.weight.shape == (HIDDEN, 48) and model.video_embedder.weight.shape == (HIDDEN, 96)
    assert {"video_embedder.weight", "video_embedder.bias"} <= set(model.state_dict())
    f = _frames()
    _check_tubelets(model, [(f[0], "embedder", (16, 24)), (torch.cat([f[1], f[2]], -1), "video_embedder", (8, 12)),
                            (torch.cat([f[3], f[3]], -1), "video_embedder", (8, 12))])


def test_temporal_checkpoint_compat_widens_an_image_embedder():
    image_state = _model(dynamic_resolution=True).state_dict()
    weight, bias = image_state["embedder.weight"], image_state["embedder.bias"]
    combined = _video_model(temporal_ckpt_compat=True)
    combined.load_state_dict(image_state)
    torch.testing.assert_close(combined.embedder.weight.detach(), torch.cat([weight, weight], dim=1) / T)
    separate = _video_model(separate_video_embedder=True, temporal_ckpt_compat=True)
    separate.load_state_dict(image_state)
    torch.testing.assert_close(separate.embedder.weight.detach(), weight)
    torch.testing.assert_close(separate.video_embedder.weight.detach(), torch.cat([weight, weight], dim=1) / T)
    torch.testing.assert_close(separate.video_embedder.bias.detach(), bias)
    # A combined tubelet checkpoint splits: the video embedder keeps it, the image one is its mean over frames.
    tubelet_state = dict(combined.state_dict())
    tubelet_state["embedder.weight"] = torch.randn(HIDDEN, T * 48)
    separate.load_state_dict(tubelet_state)
    torch.testing.assert_close(separate.video_embedder.weight.detach(), tubelet_state["embedder.weight"])
    torch.testing.assert_close(separate.embedder.weight.detach(),
                               tubelet_state["embedder.weight"].view(HIDDEN, T, 48).mean(1))
    with pytest.raises(RuntimeError, match="size mismatch"):  # without the compat hook the widths differ
        _video_model().load_state_dict(image_state)


def test_video_needs_dynamic_resolution_and_frame_counts():
    with pytest.raises(ValueError, match=r"temporal_patch_dim > 1 needs dynamic_resolution=True"):
        _model(temporal_patch_dim=T)(torch.randn(1, 3, 16, 24))
    with pytest.raises(ValueError, match=r"one entry per frame: got 4 entries but sum\(num_frames\) = 3"):
        _video_model()(torch.cat(_frames(), dim=1), imgs_sizes=VIDEO_SIZES, num_frames=[1, 2])
    with pytest.raises(ValueError, match=r"the frames of one video must have one size"):
        _video_model()(torch.cat(_frames(), dim=1), imgs_sizes=VIDEO_SIZES, num_frames=[2, 2])


def test_state_dict_keys_are_megatron_cores():
    """0.19's keys: class_token [ctl, h], position_embeddings [1, max patches, h], the optional mask_token
    [1, h], embedder (ColumnParallelLinear), ln_pre / ln_post, decoder.layers.* (no final norm)."""
    layer = {f"decoder.layers.{i}.{part}.{kind}" for i in range(LAYERS) for kind in ("weight", "bias") for part in (
        "input_layernorm", "self_attention.linear_qkv", "self_attention.linear_proj", "pre_mlp_layernorm",
        "mlp.linear_fc1", "mlp.linear_fc2")}
    plain = RADIOViTModel(_config(), get_vit_layer_with_local_spec(), patch_dim=PATCH, img_h=16, img_w=16,
                          max_img_h=MAX_IMG, max_img_w=MAX_IMG)
    keys = {k for k in plain.state_dict() if not k.endswith("_extra_state")}
    assert keys == {"class_token", "position_embeddings", "embedder.weight"} | layer
    assert "embedder._extra_state" in plain.state_dict()
    assert plain.class_token.shape == (8, HIDDEN) and plain.position_embeddings.shape == (1, 64, HIDDEN)
    assert plain.embedder.weight.shape == (HIDDEN, 3 * PATCH * PATCH)
    full = RADIOViTModel(_config(), get_vit_layer_with_local_spec(), patch_dim=PATCH, img_h=16, img_w=16,
                         max_img_h=MAX_IMG, max_img_w=MAX_IMG, ln_pre_impl=WrappedTorchNorm,
                         ln_post_impl=WrappedTorchNorm, use_mask_token=True, embedder_bias=True)
    extra = {k for k in full.state_dict() if not k.endswith("_extra_state")} - keys
    assert extra == {"mask_token", "embedder.bias", "ln_pre.weight", "ln_pre.bias", "ln_post.weight", "ln_post.bias"}
    assert full.mask_token.shape == (1, HIDDEN)
    no_class = RADIOViTModel(_config(), get_vit_layer_with_local_spec(), patch_dim=PATCH, img_h=16, img_w=16,
                             max_img_h=MAX_IMG, max_img_w=MAX_IMG, add_class_token=False)
    assert "class_token" not in no_class.state_dict() and no_class.seq_length == 16


def test_fp8_pad_hook_pads_class_tokens_in_front():
    tokens = torch.randn(5, HIDDEN)
    for recipe, length in (("delayed", 16), ("mxfp8", 32)):
        module = SimpleNamespace(config=SimpleNamespace(fp8_recipe=recipe))
        state = {"vision_model.class_token": tokens.clone()}
        fp8_pad_hook(module, state, "vision_model.", {}, True, [], [], [])
        assert state["vision_model.class_token"].shape == (length, HIDDEN)
        torch.testing.assert_close(state["vision_model.class_token"][-5:], tokens)
    state = {"vision_model.class_token": torch.randn(16, HIDDEN)}
    kept = state["vision_model.class_token"]
    fp8_pad_hook(SimpleNamespace(config=SimpleNamespace(fp8_recipe="delayed")), state, "vision_model.", {}, True,
                 [], [], [])
    assert state["vision_model.class_token"] is kept


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(temporal_patch_dim=0), r"temporal_patch_dim \(0\) must be at least 1"),
    (dict(img_h=18), r"img_h \(18\) must be a positive multiple of patch_dim \(4\)"),
    (dict(class_token_len=0), r"class_token_len \(0\) must be positive"),
    (dict(max_img_w=2), r"max_img_w \(2\) must be at least patch_dim \(4\)"),
    (dict(pos_dropout=1.0), r"pos_dropout \(1.0\) must be in \[0, 1\)"),
])
def test_bad_arguments_name_the_values(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        _model(**kwargs)


def test_bad_input_names_the_shapes():
    with pytest.raises(ValueError, match=r"24 patches \(img_h=16, img_w=24\), got shape \(1, 3, 16, 16\)"):
        _model()(torch.randn(1, 3, 16, 16))
    with pytest.raises(ValueError, match=r"must be \[1, 30, 48\] \(the patches of imgs_sizes=\[\(16, 24\), "
                                         r"\(8, 12\)\], patch_dim=4\), got shape \(1, 29, 48\)"):
        _model(dynamic_resolution=True)(torch.randn(1, 29, 48), imgs_sizes=[(16, 24), (8, 12)])
    with pytest.raises(ValueError, match="needs imgs_sizes"):
        _model(dynamic_resolution=True)(torch.randn(1, 24, 48))


@pytest.mark.gpu
def test_cuda_matches_cpu():
    """On the GPU (SDPA kernels, CUDA interpolation), fixed and dynamic resolution give the CPU's outputs."""
    sizes = [(16, 24), (8, 12)]
    x = torch.cat([_patches(_images(1, h, w, seed=i)) for i, (h, w) in enumerate(sizes)], dim=1)
    for kwargs, args in ((dict(img_h=48, img_w=40), (_images(2, 48, 40),)), (dict(dynamic_resolution=True), (x,))):
        model = _model(**kwargs).eval()
        extra = dict(imgs_sizes=sizes) if kwargs.get("dynamic_resolution") else {}
        with torch.no_grad():
            want = model(*args, **extra)
            got = model.cuda()(*(a.cuda() for a in args), **extra)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


# --- LLaVA with RADIO ----------------------------------------------------------------------------------------------
def _llava(vision_type: str, tp: int = 1, **kwargs):
    from megatron_core.models.gpt import get_gpt_layer_local_spec
    from megatron_core.models.multimodal.llava_model import LLaVAModel
    from tests.models.multimodal import llava_fixture as fx

    vision = fx.vision_config(tensor_model_parallel_size=tp, activation_func=F.gelu)
    vision.vision_model_type = vision_type
    if vision_type != "cradio-g":
        vision.class_token_len = 2
    args = dict(language_position_embedding_type="rope", img_h=fx.IMG, img_w=fx.IMG, patch_dim=fx.PATCH,
                image_token_index=fx.IMAGE_TOKEN_ID, drop_vision_class_token=False)
    args.update(kwargs)
    model = LLaVAModel(fx.language_config(tensor_model_parallel_size=tp), get_gpt_layer_local_spec(), fx.VOCAB,
                       fx.MAX_SEQ, vision, get_vit_layer_with_local_spec(),
                       vision_projection_config=fx.projection_config(tensor_model_parallel_size=tp),
                       vision_projection_layer_spec=fx.projection_spec(), **args)
    return model, fx


@pytest.mark.parametrize(("vision_type", "class_tokens"), [("radio", 2), ("radio-g", 2), ("cradio-g", 8)])
def test_llava_with_radio_trains(vision_type: str, class_tokens: int):
    model, fx = _llava(vision_type, radio_force_cpe_eval_mode=False)
    fx.randomize(model, seed=3)
    assert type(model.vision_model).__name__ == "RADIOViTModel"
    vision = model.vision_model
    assert vision.class_token_len == class_tokens
    is_g = vision_type == "radio-g"
    assert (vision.max_img_h, vision.ln_post is not None, vision.embedder.bias is not None,
            hasattr(vision, "mask_token")) == ((1792, True, True, True) if is_g else (2048, False, False, False))
    count = get_num_image_embeddings(fx.IMG, fx.IMG, fx.PATCH, vision_type, False, class_tokens, False)
    assert model.img_seq_len == count == (fx.IMG // fx.PATCH) ** 2 + class_tokens
    ids = torch.randint(1, fx.IMAGE_TOKEN_ID, (2, 8), generator=torch.Generator().manual_seed(1))
    ids[0, 2] = ids[1, 5] = fx.IMAGE_TOKEN_ID
    labels = torch.randint(0, fx.IMAGE_TOKEN_ID, (2, 8), generator=torch.Generator().manual_seed(2))
    model.train()
    with torch.no_grad():
        assert vision(fx.images(2)).shape == (2, count, fx.V_HIDDEN)
    loss, loss_mask = model(fx.images(2), ids, None, None, labels=labels, loss_mask=torch.ones(2, 8))
    assert loss.shape == loss_mask.shape == (2, 8 - 1 + count)
    assert float(loss_mask[0, 2:2 + count].sum()) == 0  # the image positions carry no loss
    (loss * loss_mask).sum().backward()
    assert torch.isfinite(loss).all()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads.pop("vision_model.mask_token", None) is None  # a checkpoint entry the forward pass never reads
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["vision_model.embedder.weight"].abs().sum() > 0 and grads["vision_model.class_token"].abs().sum() > 0


def test_llava_radio_options_reach_the_encoder():
    model, _ = _llava("radio", radio_force_eval_mode=True, radio_interpolate_only_cpe=True,
                      radio_cpe_aspect_ratio_select=True, radio_disable_cpe=True, radio_force_cpe_eval_mode=True)
    vision = model.vision_model
    assert (vision.force_eval_mode, vision.interpolate_only_cpe, vision.cpe_aspect_ratio_select, vision.has_cpe,
            vision.force_cpe_eval_mode) == (True, True, True, False, True)
    model.train()
    assert not vision.training
    fp8, _ = _llava("radio", use_vision_backbone_fp8_arch=True)
    assert fp8.vision_model.class_token_len == 16 and fp8.img_seq_len == 16 + 16


def test_llava_refuses_cradio_g_with_other_class_token_counts():
    with pytest.raises(ValueError, match=r"'cradio-g' keeps its class tokens .* class_token_len=16"):
        _llava("cradio-g", use_vision_backbone_fp8_arch=True)
    dropped, _ = _llava("cradio-g", use_vision_backbone_fp8_arch=True, drop_vision_class_token=True)
    assert dropped.img_seq_len == 16


# --- TP=2 ----------------------------------------------------------------------------------------------------------
TP = 2
COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias", "embedder.weight",
          "embedder.bias")
ROW = ("linear_proj.weight", "linear_fc2.weight")


def _split_dim(name: str) -> int | None:
    return 0 if name.endswith(COLUMN) else 1 if name.endswith(ROW) else None


def _run(model: RADIOViTModel, images: torch.Tensor, train: bool) -> tuple[torch.Tensor, dict]:
    model.train(train)
    torch.manual_seed(11)
    out = model(images)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * weights).sum().backward()
    grads = {k: v.grad.detach().clone() for k, v in model.named_parameters()}
    model.zero_grad()
    return out.detach(), grads


def _check_tp() -> list[str]:
    images = _images(2, 16, 24, seed=5)
    reference = _model()
    state = {k: v.detach().clone() for k, v in reference.named_parameters()}
    expected = {mode: _run(reference, images, mode) for mode in (False, True)}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    checked = []
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        rank = parallel_state.get_tensor_model_parallel_rank()
        group = parallel_state.get_tensor_model_parallel_group()
        model = _model(_config(tensor_model_parallel_size=TP))
        with torch.no_grad():
            for name, param in model.named_parameters():
                dim = _split_dim(name)
                param.copy_(state[name] if dim is None else state[name].chunk(TP, dim=dim)[rank])
        for mode, (ref_out, ref_grads) in expected.items():
            out, grads = _run(model, images, mode)
            torch.testing.assert_close(out, ref_out, **TOL)
            for name, grad in grads.items():
                dim = _split_dim(name)
                if dim is not None:
                    pieces = [torch.empty_like(grad) for _ in range(TP)]
                    dist.all_gather(pieces, grad.contiguous(), group=group)
                    grad = torch.cat(pieces, dim=dim)
                ref = ref_grads[name]
                torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()),
                                           msg=lambda m, n=name: f"{n}: {m}")
            checked.append("train" if mode else "eval")
    finally:
        parallel_state.destroy_model_parallel()
    return checked


def test_tp2_matches_single_process():
    assert run_on_ranks(TP, _check_tp) == [["eval", "train"]] * TP
