"""``get_num_image_embeddings``: hand-computed token counts, the installed Megatron-Core's answers, bad input."""

from __future__ import annotations

import warnings

import pytest

from megatron_core.models.vision import get_num_image_embeddings

# (img_h, img_w, patch, type, disable_class_token, class_token_len, pixel_shuffle, tile_tags, max_tiles, tokenizer)
CASES = [
    # 336/14 = 24 -> 576 patches + 1 class token.
    ((336, 336, 14, "clip", False, 1, False), 577),
    ((336, 336, 14, "clip", True, 1, False), 576),
    # Non-square: 448/14 * 224/14 = 32 * 16 = 512 patches, 8 class tokens.
    ((448, 224, 14, "internvit", False, 8, False), 520),
    # SigLIP never keeps a class token, whatever the flags say.
    ((384, 384, 16, "siglip", False, 1, False), 576),
    # Pixel shuffle keeps a quarter: 1025 // 4 (int of 256.25).
    ((448, 448, 14, "internvit300M", False, 1, True), 256),
    ((512, 512, 16, "radio", False, 8, True), 258),  # (1024 + 8) / 4
    ((512, 512, 16, "cradio-g", False, 1, False), 1032),  # cradio-g always has 8 class tokens
    # Tile tags: +5 for llama3p1/chatml/qwen, +6 for nemotron5; qwen pads two-digit tile numbers (+1).
    ((336, 336, 14, "clip", False, 1, False, True, 6, "llama3p1"), 582),
    ((336, 336, 14, "clip", False, 1, False, True, 12, "qwen2p5"), 583),
    ((336, 336, 14, "clip", False, 1, False, True, 12, "chatml"), 582),
    ((448, 448, 14, "siglip", False, 0, True, True, 40, "nemotron5-hybrid"), 262),  # 1024 / 4 + 6
]


@pytest.mark.parametrize(("args", "expected"), CASES)
def test_counts_match_hand_computed_values(args: tuple, expected: int):
    assert get_num_image_embeddings(*args) == expected


def test_counts_match_megatron_core():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = pytest.importorskip("megatron.core.models.vision.clip_vit_model").get_num_image_embeddings
    for args, _ in CASES:
        assert get_num_image_embeddings(*args) == theirs(*args), args


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(vision_model_type="vit-h"), r"vision_model_type \('vit-h'\) must be one of"),
    (dict(use_tile_tags=True, tokenizer_type="gpt2"), r"tokenizer_type in .* got 'gpt2'"),
    (dict(use_tile_tags=True), r"got None"),
    (dict(use_tile_tags=True, tokenizer_type="qwen2p0", max_num_tiles=128), r"max_num_tiles \(128\) must be at most"),
])
def test_bad_arguments_name_the_values(kwargs: dict, message: str):
    args = dict(img_h=336, img_w=336, patch_dim=14, vision_model_type="clip", disable_vision_class_token=False,
                class_token_len=1, pixel_shuffle=False)
    with pytest.raises(ValueError, match=message):
        get_num_image_embeddings(**{**args, **kwargs})
