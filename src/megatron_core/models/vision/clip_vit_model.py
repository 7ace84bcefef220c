"""The CLIP-style vision transformer (Megatron-Core's ``CLIPViTModel``) and its token count.

An image ``[b, 3, h, w]`` is cut into ``patch_dim`` x ``patch_dim`` patches by a strided convolution
(``conv1``), optionally prefixed with ``class_token_len`` learned class tokens, given learned
absolute position embeddings, and run through a ``TransformerBlock`` with no final norm (the layer
spec decides the attention mask; the ViT specs use none). The output is ``[b, s, h]``, batch first.

``model_subtype`` picks the embedding details, as in Megatron-Core:

- ``"clip"``: bias-free conv, a norm after the position embeddings (``ln_pre``);
- ``"siglip"``: conv with bias, no class token, a norm on the output (``ln_post``);
- ``"internvit"`` / ``"internvit300M"``: conv with bias and no extra norms (their special layers come
  from the layer spec).

:func:`get_num_image_embeddings` gives the number of language-model tokens one image tile turns into,
also for Hugging Face SigLIP towers (``"hf://..."`` types, which LLaVA builds with ``models.huggingface``).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.device import get_current_device
from megatron_core.models.common.vision_module.vision_module import VisionModule
from megatron_core.transformer.enums import ModelType
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.torch_norm import WrappedTorchNorm
from megatron_core.transformer.transformer_block import TransformerBlock
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["CLIPViTModel", "get_num_image_embeddings"]

MODEL_SUBTYPES = ("clip", "siglip", "internvit", "internvit300M")


def _check_patch_grid(img_h: int, img_w: int, patch_dim: int) -> None:
    if patch_dim <= 0:
        raise ValueError(f"patch_dim ({patch_dim}) must be positive")
    for name, size in (("img_h", img_h), ("img_w", img_w)):
        if size <= 0 or size % patch_dim != 0:
            raise ValueError(f"{name} ({size}) must be a positive multiple of patch_dim ({patch_dim})")


class CLIPViTModel(VisionModule):
    """Vision transformer: patch conv, class token(s), position embeddings, norms, transformer layers."""

    def __init__(
        self,
        transformer_config: TransformerConfig,
        transformer_layer_spec: ModuleSpec,
        ln_pre_impl: ModuleSpec | type = WrappedTorchNorm,
        ln_post_impl: ModuleSpec | type = WrappedTorchNorm,
        add_class_token: bool = True,
        class_token_len: int = 1,
        patch_dim: int = 14,
        img_h: int = 336,
        img_w: int = 336,
        model_subtype: str = "clip",
        pg_collection: Any = None,
        vp_stage: int | None = None,
    ) -> None:
        if model_subtype not in MODEL_SUBTYPES:
            raise ValueError(f"model_subtype ({model_subtype!r}) must be one of {list(MODEL_SUBTYPES)}")
        if model_subtype == "siglip" and (add_class_token or class_token_len != 0):
            raise ValueError(
                f"model_subtype 'siglip' has no class token: got add_class_token={add_class_token}, "
                f"class_token_len={class_token_len} (use False and 0)"
            )
        if add_class_token and class_token_len <= 0:
            raise ValueError(f"class_token_len ({class_token_len}) must be positive when add_class_token=True")
        _check_patch_grid(img_h, img_w, patch_dim)
        super().__init__(config=transformer_config)
        self.model_type = ModelType.encoder_or_decoder
        self.visual_hidden_size = transformer_config.hidden_size
        self.patch_dim = patch_dim
        self.img_h = img_h
        self.img_w = img_w
        self.num_patches_per_dim_h = img_h // patch_dim
        self.num_patches_per_dim_w = img_w // patch_dim
        self.num_patches = self.num_patches_per_dim_h * self.num_patches_per_dim_w
        self.add_class_token = add_class_token
        self.class_token_len = class_token_len
        self.seq_length = self.num_patches + (class_token_len if add_class_token else 0)
        self.pg_collection = pg_collection
        self.vp_stage = vp_stage

        norm_args = dict(config=transformer_config, hidden_size=self.visual_hidden_size,
                         eps=transformer_config.layernorm_epsilon)
        self.ln_pre = build_module(ln_pre_impl, **norm_args) if model_subtype == "clip" else None
        self.ln_post = build_module(ln_post_impl, **norm_args) if model_subtype == "siglip" else None

        device = torch.device("cpu") if transformer_config.use_cpu_initialization else get_current_device()
        # CLIP's patch embedding has no bias; SigLIP's and InternViT's have one.
        self.conv1 = torch.nn.Conv2d(3, self.visual_hidden_size, kernel_size=patch_dim, stride=patch_dim,
                                     bias=model_subtype != "clip", device=device)
        # Not a checkpoint entry (Megatron-Core keeps it outside the state dict too); moves with the module.
        self.register_buffer("position_ids", torch.arange(self.seq_length, device=device).expand(1, -1),
                             persistent=False)
        self.position_embeddings = torch.nn.Embedding(
            self.seq_length, self.visual_hidden_size, dtype=transformer_config.params_dtype, device=device
        )
        if add_class_token:
            self.class_token = torch.nn.Parameter(torch.randn(
                1, class_token_len, self.visual_hidden_size, dtype=transformer_config.params_dtype, device=device
            ))
        self.decoder = TransformerBlock(
            config=transformer_config,
            spec=transformer_layer_spec,
            pre_process=True,
            post_process=False,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        """Hand ``input_tensor`` to the transformer block (pipeline receive buffer)."""
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encode images ``[b, 3, img_h, img_w]`` into ``[b, seq_length, hidden_size]``."""
        if x.dim() != 4 or tuple(x.shape[2:]) != (self.img_h, self.img_w):
            raise ValueError(
                f"CLIPViTModel expects images [b, 3, {self.img_h}, {self.img_w}], got shape {tuple(x.shape)}"
            )
        patches = self.conv1(x).flatten(2).transpose(1, 2)  # [b, h, gh, gw] -> [b, gh*gw, h]
        if self.add_class_token:
            patches = torch.cat([self.class_token.expand(patches.shape[0], -1, -1), patches], dim=1)
        hidden_bsh = patches + self.position_embeddings(self.position_ids)
        if self.ln_pre is not None:
            hidden_bsh = self.ln_pre(hidden_bsh)
        # The block is sequence-first; contiguous so that pipeline sends see a plain tensor.
        hidden_sbh = self.decoder(hidden_bsh.transpose(0, 1).contiguous(), attention_mask)
        hidden_bsh = hidden_sbh.transpose(0, 1).contiguous()
        if self.ln_post is not None:
            hidden_bsh = self.ln_post(hidden_bsh)
        return hidden_bsh


_TILE_TAG_TOKENS = {"llama3p1": 5, "chatml": 5, "qwen2p0": 5, "qwen2p5": 5}


def _keeps_class_token(vision_model_type: str, disable_vision_class_token: bool) -> bool:
    if vision_model_type == "siglip":
        return False
    if vision_model_type in ("clip", "internvit", "internvit300M", "cradio-g") or vision_model_type.startswith(
        "radio"
    ):
        return not disable_vision_class_token
    if vision_model_type.startswith("hf://"):
        # Classified by the model's config (transformers reads it); only SigLIP towers, which have no class token.
        from megatron_core.models.huggingface.module import get_hf_model_type

        family = get_hf_model_type(vision_model_type)
        if "siglip" in family:
            return False
        raise NotImplementedError(
            f"unsupported huggingface vision model: {vision_model_type} (a {family!r} model; Hugging Face vision "
            "models must be SigLIP ones)"
        )
    raise ValueError(
        f"vision_model_type ({vision_model_type!r}) must be one of ['clip', 'siglip', 'internvit', 'internvit300M', "
        "'radio*', 'cradio-g', 'hf://<SigLIP model>']"
    )


def _tile_tag_tokens(tokenizer_type: str | None, max_num_tiles: int) -> int:
    """Tokens the tile tags add to each tile for ``tokenizer_type``."""
    if tokenizer_type in _TILE_TAG_TOKENS:
        count = _TILE_TAG_TOKENS[tokenizer_type]
    elif tokenizer_type is not None and tokenizer_type.startswith("nemotron5"):
        count = 6
    else:
        raise ValueError(
            f"use_tile_tags needs tokenizer_type in {sorted(_TILE_TAG_TOKENS)} or 'nemotron5*', got {tokenizer_type!r}"
        )
    if max_num_tiles > 100:
        raise ValueError(f"max_num_tiles ({max_num_tiles}) must be at most 100 with use_tile_tags")
    # Two-digit tile numbers take one more (padding) token with Qwen tokenizers.
    if 10 < max_num_tiles < 100 and tokenizer_type.startswith("qwen"):
        count += 1
    return count


def get_num_image_embeddings(
    img_h: int,
    img_w: int,
    patch_dim: int,
    vision_model_type: str,
    disable_vision_class_token: bool,
    class_token_len: int,
    pixel_shuffle: bool,
    use_tile_tags: bool = False,
    max_num_tiles: int = 0,
    tokenizer_type: str | None = None,
) -> int:
    """Language-model tokens per image tile: patches (+ class tokens), /4 with pixel shuffle, + tile tags.

    ``"cradio-g"`` always has 8 class tokens; SigLIP never keeps one. A ``"hf://<name or directory>"`` type is
    classified with ``models.huggingface.module.get_hf_model_type`` (which reads the model's config with
    ``transformers``): a SigLIP model keeps no class token, any other family raises ``NotImplementedError``.
    """
    if vision_model_type == "cradio-g":
        class_token_len = 8
    keep_class_token = _keeps_class_token(vision_model_type, disable_vision_class_token)
    num_patches = (img_h // patch_dim) * (img_w // patch_dim)
    count = num_patches + (class_token_len if keep_class_token else 0)
    if pixel_shuffle:
        count = int(count * 0.25)
    if use_tile_tags:
        count += _tile_tag_tokens(tokenizer_type, max_num_tiles)
    return count
