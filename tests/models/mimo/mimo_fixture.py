"""A tiny MIMO vision-language model for the tests, on the LLaVA fixture's shapes.

CLIP tower (32x32 images, 8x8 patches, class token kept: 17 embeddings per image) and MLP projector as the
``"images"`` modality, a Llama-like RoPE ``GPTModel`` as the language model, image token ``IMAGE_TOKEN_ID``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.models.mimo import MimoModel, MimoModelConfig, VisionModalitySubmodules
from megatron_core.models.vision import CLIPViTModel, MultimodalProjector, get_vit_layer_with_local_spec
from megatron_core.transformer.spec_utils import ModuleSpec
from tests.models.multimodal import llava_fixture as lf

IMAGE_TOKEN_ID = lf.IMAGE_TOKEN_ID
VOCAB, MAX_SEQ, IMG = lf.VOCAB, lf.MAX_SEQ, lf.IMG
TOKENS_PER_IMAGE = lf.IMG_SEQ + 1  # the class token is kept


def language_spec(tp: int = 1, **config) -> ModuleSpec:
    """RoPE GPT language model spec (embedding scatter off, so sequence parallelism may be used)."""
    return ModuleSpec(module=GPTModel, params=dict(
        config=lf.language_config(tensor_model_parallel_size=tp, **config),
        transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=MAX_SEQ,
        position_embedding_type="rope", scatter_embedding_sequence_parallel=False))


def vision_spec(tp: int = 1, encoder_groups: Any = None) -> ModuleSpec:
    """``VisionModalitySubmodules`` with one CLIP encoder ``clip_encoder`` (``encoder_groups``: its
    ``pg_collection``) and one MLP input projection."""
    clip = ModuleSpec(module=CLIPViTModel, params=dict(pg_collection=encoder_groups,
        transformer_config=lf.vision_config(tensor_model_parallel_size=tp),
        transformer_layer_spec=get_vit_layer_with_local_spec(), patch_dim=lf.PATCH, img_h=IMG, img_w=IMG))
    projector = ModuleSpec(module=MultimodalProjector, params=dict(
        config=lf.projection_config(tensor_model_parallel_size=tp), submodules=lf.projection_spec(),
        projector_type="mlp", input_size=lf.V_HIDDEN))
    return ModuleSpec(module=VisionModalitySubmodules,
                      submodules={"encoders": {"clip_encoder": clip}, "input_projections": [projector]})


def config(tp: int = 1, grid_map: dict | None = None, encoder_groups: Any = None, **language) -> MimoModelConfig:
    """The MIMO config of the tiny VLM."""
    return MimoModelConfig(language_model_spec=language_spec(tp, **language),
                           modality_submodules_spec={"images": vision_spec(tp, encoder_groups)},
                           special_token_ids={"images": IMAGE_TOKEN_ID}, module_to_grid_map=grid_map)


def build(tp: int = 1, encoder_groups: Any = None, **language) -> MimoModel:
    """The tiny VLM as a ``MimoModel``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MimoModel(config(tp, encoder_groups=encoder_groups, **language))


def batch(images_per_sample: list[int], text_len: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [b, s], images [sum, 3, IMG, IMG])``: per sample, ``text_len`` random text tokens with
    ``n`` runs of ``TOKENS_PER_IMAGE`` image tokens placed after every other text token; padded with text."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in images_per_sample:
        text = torch.randint(0, VOCAB - 1, (text_len,), generator=gen).tolist()
        row = []
        for i, tok in enumerate(text):
            row.append(tok)
            if i % 2 == 0 and n > 0:
                row += [IMAGE_TOKEN_ID] * TOKENS_PER_IMAGE
                n -= 1
        row += [IMAGE_TOKEN_ID] * TOKENS_PER_IMAGE * n
        rows.append(row)
    length = max(len(r) for r in rows)
    length += -length % 4  # divisible by 2 * cp * tp for the parallel tests
    for r in rows:
        r += torch.randint(0, VOCAB - 1, (length - len(r),), generator=gen).tolist()
    return torch.tensor(rows), lf.images(sum(images_per_sample), seed=seed + 1)
