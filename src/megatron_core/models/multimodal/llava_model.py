"""The LLaVA vision-language model (Megatron-Core's ``megatron.core.models.multimodal.llava_model``).

``vision_model`` (:class:`CLIPViTModel`: CLIP, SigLIP or InternViT; :class:`RADIOViTModel` for ``"radio"``,
``"radio-g"`` and ``"cradio-g"``; or, for ``vision_model_type="hf://..."``, a Hugging Face SigLIP tower built by
``models.huggingface.build_hf_model``) encodes the image tiles
``[tiles, 3, img_h, img_w]``; the class token(s) are dropped if asked, the tokens optionally
pixel-shuffled, and ``vision_projection`` (:class:`MultimodalProjector`) maps them to the language
width. In ``input_ids`` ``[b, t]`` every image is one ``image_token_index``; its embeddings
(``tiles * img_seq_len`` of them) are spliced in there, and the labels and loss mask are expanded
the same way (image positions get ``IGNORE_INDEX`` / 0), before ``language_model`` (:class:`GPTModel`)
runs on the combined ``[L, b, h]`` sequence. ``forward`` returns ``(loss or logits, expanded loss mask)``.

Sequence parallelism pads the combined sequence to a multiple of TP and scatters it; context
parallelism pads to a multiple of ``2 * CP`` (times TP with SP) and keeps this rank's load-balanced
chunks (``"sbhd"``, or the packed ``"thd"`` layout of ``packed_seq_params``). Pipeline stages follow
``add_encoder`` / ``add_decoder`` / ``pre_process`` / ``post_process`` as in Megatron-Core. Hybrid (Mamba)
language models, sound inputs and dynamic-resolution or video (temporal) inputs are refused with a ``ValueError``; Hugging Face vision models other than SigLIP with ``NotImplementedError``, as in
Megatron-Core.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any

import torch

from megatron_core._ground import get_pg_size
from megatron_core.models.gpt import GPTModel
from megatron_core.models.multimodal._hf_vision import build_hf_vision_model, is_hf_vision_type
from megatron_core.models.multimodal._pixel_shuffle import pixel_shuffle
from megatron_core.models.multimodal._sequence_sharding import shard_combined_sequence
from megatron_core.models.multimodal._token_splice import (
    IGNORE_INDEX,
    splice_embeddings,
    splice_labels,
    splice_layout,
)
from megatron_core.models.vision.clip_vit_model import CLIPViTModel, get_num_image_embeddings
from megatron_core.models.vision.multimodal_projector import MultimodalProjector
from megatron_core.models.vision.radio import RADIOViTModel
from megatron_core.process_groups_config import resolve_pg_collection
from megatron_core.tokenizers.vision.image_tokens import DEFAULT_IMAGE_TOKEN_INDEX, IMAGE_TOKEN
from megatron_core.transformer.enums import ModelType
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.torch_norm import WrappedTorchNorm
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = [
    "DEFAULT_IMAGE_TOKEN_INDEX",
    "DEFAULT_SOUND_TOKEN_INDEX",
    "IGNORE_INDEX",
    "IMAGE_TOKEN",
    "LLaVAModel",
    "SOUND_TOKEN",
    "VIDEO_TOKEN",
    "pixel_shuffle",
]

DEFAULT_SOUND_TOKEN_INDEX = -300
VIDEO_TOKEN = "<video>"
SOUND_TOKEN = "<so_embedding>"

_logger = logging.getLogger(__name__)
_CLIP_LIKE = ("clip", "siglip", "internvit")
_RADIO_TYPES = ("radio", "radio-g", "cradio-g")
_HYBRID_LANGUAGE_MODELS = ("nemotron5-hybrid", "nemotron6-moe")


class LLaVAModel(MegatronModule):
    """Vision encoder + projector + GPT language model, with image embeddings spliced in at image tokens."""

    def __init__(
        self,
        language_transformer_config: TransformerConfig,
        language_transformer_layer_spec: ModuleSpec,
        language_vocab_size: int,
        language_max_sequence_length: int,
        vision_transformer_config: TransformerConfig,
        vision_transformer_layer_spec: ModuleSpec,
        drop_vision_class_token: bool,
        vision_projection_config: TransformerConfig,
        vision_projection_layer_spec: ModuleSpec,
        vision_projection_type: str = "mlp",
        allow_missing_vision_projection_checkpoint: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        language_position_embedding_type: str = "learned_absolute",
        language_rotary_percent: float = 1.0,
        pre_process: bool = True,
        post_process: bool = True,
        add_encoder: bool = True,
        add_decoder: bool = True,
        img_h: int = 336,
        img_w: int = 336,
        patch_dim: int = 14,
        language_rotary_base: int = 10000,
        language_rope_scaling: bool = False,
        language_rope_scaling_factor: float = 8.0,
        hybrid_layer_pattern: str | None = None,
        fp16_lm_cross_entropy: bool = False,
        image_token_index: int = DEFAULT_IMAGE_TOKEN_INDEX,
        pixel_shuffle: bool = False,
        tile_tags: list | None = None,
        pg_collection: Any = None,
        max_num_tiles: int = 0,
        tokenizer_type: str = "",
        vp_stage: int | None = None,
        use_vision_backbone_fp8_arch: bool = False,
        dynamic_resolution: bool = False,
        sound_model: torch.nn.Module | None = None,
        sound_projection: torch.nn.Module | None = None,
        sound_token_index: int = DEFAULT_SOUND_TOKEN_INDEX,
        radio_force_eval_mode: bool = False,
        radio_force_cpe_eval_mode: bool = False,
        radio_interpolate_only_cpe: bool = False,
        radio_cpe_aspect_ratio_select: bool = False,
        radio_disable_cpe: bool = False,
        temporal_patch_dim: int = 1,
        separate_video_embedder: bool = False,
        temporal_ckpt_compat: bool = False,
    ) -> None:
        super().__init__(config=language_transformer_config)
        vision_model_type = getattr(vision_transformer_config, "vision_model_type", None)
        _check_supported(language_transformer_config, vision_transformer_config, vision_model_type,
                         drop_vision_class_token, sound_model, sound_projection, dynamic_resolution,
                         temporal_patch_dim, separate_video_embedder)
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = pre_process
        self.post_process = post_process
        self.add_encoder = add_encoder
        self.add_decoder = add_decoder
        self.vp_stage = vp_stage
        self.encoder_hidden_state = None
        self.vision_model = None
        self.vision_projection = None
        self.language_model = None
        self.sound_model = None
        self.sound_projection = None
        self.sound_token_index = sound_token_index
        self.dynamic_resolution = dynamic_resolution
        self.temporal_patch_dim = temporal_patch_dim
        self.pg_collection = resolve_pg_collection(pg_collection)
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights

        lm_config = language_transformer_config
        self.sequence_parallel_lm = lm_config.sequence_parallel
        self.tp_comm_overlap_lm = getattr(lm_config, "tp_comm_overlap", False)
        self.context_parallel_lm = lm_config.context_parallel_size
        self.tensor_model_parallel_size_lm = lm_config.tensor_model_parallel_size
        self.cp_group = self.pg_collection.cp if self.context_parallel_lm > 1 else None
        if self.cp_group is not None and get_pg_size(self.cp_group) != self.context_parallel_lm:
            raise ValueError(f"the context-parallel group has {get_pg_size(self.cp_group)} ranks but the language "
                             f"config's context_parallel_size is {self.context_parallel_lm}")
        self._language_max_sequence_length = language_max_sequence_length
        self._language_is_pipeline_parallel = lm_config.pipeline_model_parallel_size > 1

        if add_decoder:
            self.language_model = GPTModel(
                config=lm_config,
                transformer_layer_spec=language_transformer_layer_spec,
                vocab_size=language_vocab_size,
                max_sequence_length=language_max_sequence_length,
                parallel_output=parallel_output,
                position_embedding_type=language_position_embedding_type,
                rotary_percent=language_rotary_percent,
                pre_process=pre_process,
                post_process=post_process,
                rotary_base=language_rotary_base,
                rope_scaling=language_rope_scaling,
                rope_scaling_factor=language_rope_scaling_factor,
                fp16_lm_cross_entropy=fp16_lm_cross_entropy,
                scatter_embedding_sequence_parallel=False,  # scattered here, after the images are spliced in
                share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                pg_collection=self.pg_collection,
                vp_stage=vp_stage,
            )
            self.language_model.register_load_state_dict_post_hook(_ignore_extra_state_keys)

        self._drop_vision_class_token = drop_vision_class_token
        has_class_token = vision_model_type != "siglip"
        class_token_len = 1 if has_class_token else 0
        if vision_model_type in _RADIO_TYPES:
            class_token_len = _radio_class_token_len(vision_transformer_config, use_vision_backbone_fp8_arch,
                                                     drop_vision_class_token)
        # Counted before the encoder is built: this also rejects Hugging Face towers that are not SigLIP.
        self.img_seq_len = get_num_image_embeddings(
            img_h, img_w, patch_dim, vision_model_type, drop_vision_class_token, class_token_len, pixel_shuffle,
            tile_tags is not None, max_num_tiles, tokenizer_type,
        )
        if add_encoder:
            if is_hf_vision_type(vision_model_type):  # replicated over TP; its own groups are irrelevant
                self.vision_model = build_hf_vision_model(vision_transformer_config, img_h, img_w, patch_dim)
            elif vision_model_type in _RADIO_TYPES:
                self.vision_model = _build_radio(
                    vision_transformer_config, vision_transformer_layer_spec, img_h, img_w, patch_dim,
                    class_token_len, radio_force_eval_mode, radio_force_cpe_eval_mode, radio_interpolate_only_cpe,
                    radio_cpe_aspect_ratio_select, radio_disable_cpe,
                    _encoder_groups(self.pg_collection, vision_transformer_config), vp_stage,
                )
            else:
                self.vision_model = CLIPViTModel(
                    vision_transformer_config, vision_transformer_layer_spec, img_h=img_h, img_w=img_w,
                    class_token_len=class_token_len, patch_dim=patch_dim, model_subtype=vision_model_type,
                    add_class_token=has_class_token,
                    pg_collection=_encoder_groups(self.pg_collection, vision_transformer_config), vp_stage=vp_stage,
                )
            self.vision_model.register_load_state_dict_post_hook(_ignore_extra_state_keys)
            projection_input = vision_transformer_config.hidden_size * (4 if pixel_shuffle else 1)
            self.vision_projection = MultimodalProjector(
                vision_projection_config, vision_projection_layer_spec, vision_projection_type, projection_input,
                tp_group=self.pg_collection.tp,
            )
            if allow_missing_vision_projection_checkpoint:
                names = [f"vision_projection.{name}" for name in self.vision_projection.state_dict()]
                self.vision_projection.register_load_state_dict_post_hook(
                    functools.partial(_ignore_missing_keys, names))
            self.vision_projection.register_load_state_dict_post_hook(_ignore_extra_state_keys)

        self.image_token_index = image_token_index
        self._pixel_shuffle = pixel_shuffle
        self._tile_tags = tile_tags
        self._max_num_tiles = max_num_tiles

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """The language model's word embedding (tied with the output layer), for the embedding all-reduce."""
        return self.language_model.shared_embedding_or_output_weight() if self.add_decoder else None

    def set_input_tensor(self, input_tensor: torch.Tensor | list | None) -> None:
        """Hand the previous pipeline stage's output to the part of this stage that consumes it."""
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        if len(input_tensor) != 1:
            raise ValueError(f"LLaVAModel.set_input_tensor expects one tensor, got {len(input_tensor)}")
        if self.add_encoder:
            self.vision_model.set_input_tensor(input_tensor[0])
        elif self.pre_process:
            self.encoder_hidden_state = input_tensor[0]
        else:
            self.language_model.set_input_tensor(input_tensor[0])

    def freeze(self, freeze_language_model: bool, freeze_vision_model: bool, freeze_vision_projection: bool,
               freeze_sound_model: bool = False, freeze_sound_projection: bool = False) -> None:
        """Stop training the chosen parts (``requires_grad = False`` on their parameters)."""
        chosen = ((freeze_language_model, self.language_model), (freeze_vision_model, self.vision_model),
                  (freeze_vision_projection, self.vision_projection), (freeze_sound_model, self.sound_model),
                  (freeze_sound_projection, self.sound_projection))
        for freeze, module in chosen:
            if freeze and module is not None:
                for param in module.parameters():
                    param.requires_grad = False

    def _preprocess_data(
        self,
        image_embeddings: torch.Tensor | None,
        language_embeddings: torch.Tensor | None,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor | None,
        labels: torch.Tensor | None,
        use_inference_kv_cache: bool,
        inference_context: Any,
        image_token_index: int,
        num_image_tiles: torch.Tensor,
        *,
        inference_params: Any = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Combined embeddings, labels and loss mask of this stage (``None`` for what it does not need).

        ``language_embeddings`` are ``[b, t, h]``; the embeddings come back ``[L, b, h]`` (``[b, L, h]``
        with context parallelism, which splits along dim 1), the labels and loss mask ``[b, L]``.
        """
        inference_context = inference_context if inference_context is not None else inference_params
        if not self.add_decoder:
            raise ValueError("LLaVAModel._preprocess_data is only for stages with the language model (add_decoder)")
        if not self.pre_process and not self.post_process:
            return None, None, None
        if use_inference_kv_cache:  # the images are in the KV cache already: only the new text tokens
            embeddings = language_embeddings
            if embeddings is not None and self.context_parallel_lm == 1:
                embeddings = embeddings.transpose(0, 1).contiguous()
            return embeddings, labels, loss_mask
        has_labels = labels is not None and self.post_process
        if has_labels and loss_mask is None:
            raise ValueError("LLaVAModel: labels were given without a loss_mask (both are [b, text_seq_len])")
        min_length = self._language_max_sequence_length if (
            self._language_is_pipeline_parallel and inference_context is None) else 0
        layout = splice_layout(input_ids, image_token_index, num_image_tiles, self.img_seq_len, min_length)

        embeddings = None
        if self.pre_process:
            if not layout.num_tiles and image_embeddings is not None and image_embeddings.numel():
                if not getattr(self.vision_model, "_is_fsdp_managed_module", False):
                    raise ValueError(f"input_ids hold no image token but image embeddings of shape "
                                     f"{tuple(image_embeddings.shape)} were given")
                # FSDP runs a dummy image through the encoder on text-only batches; keep it in the graph.
                language_embeddings = language_embeddings + 0 * image_embeddings.flatten()[0]
                image_embeddings = None
            if image_embeddings is None:
                image_embeddings = language_embeddings.new_zeros(0, 0, 0)
            embeddings = splice_embeddings(layout, language_embeddings, image_embeddings, self.img_seq_len)
        new_labels = new_loss_mask = None
        if has_labels:
            new_labels, new_loss_mask = splice_labels(layout, labels, loss_mask)

        limit = self._language_max_sequence_length
        if embeddings is not None:
            embeddings = embeddings[:, :limit]
            if self.context_parallel_lm == 1:
                embeddings = embeddings.transpose(0, 1).contiguous()
        if new_labels is not None:
            new_labels, new_loss_mask = new_labels[:, :limit], new_loss_mask[:, :limit]
        return embeddings, new_labels, new_loss_mask

    def _process_embedding_token_parallel(
        self, combined_embeddings: torch.Tensor | None, new_labels: torch.Tensor | None,
        new_loss_mask: torch.Tensor | None, packed_seq_params: Any,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, Any]:
        """Pad the combined sequence for SP / CP, keep this CP rank's chunks and scatter it over TP (SP)."""
        if not self.pre_process and not self.post_process:
            return combined_embeddings, new_labels, new_loss_mask, packed_seq_params
        overlap = self.sequence_parallel_lm and self.tp_comm_overlap_lm
        combined_embeddings, new_labels, new_loss_mask = shard_combined_sequence(
            combined_embeddings, new_labels, new_loss_mask, packed_seq_params,
            sequence_parallel=self.sequence_parallel_lm, tp_size=self.tensor_model_parallel_size_lm,
            tp_group=self.pg_collection.tp, cp_group=self.cp_group,
            required_length=self._language_max_sequence_length if overlap else None,
        )
        return combined_embeddings, new_labels, new_loss_mask, packed_seq_params

    def _apply_tile_tagging(self, image_embeddings: torch.Tensor, num_image_tiles: torch.Tensor) -> torch.Tensor:
        """Prepend each tile's tag embeddings (NVLM): ``[img_seq_len, tiles, h]`` -> ``[tag_len + img_seq_len, tiles, h]``.

        The first ``tiles - 1`` tiles get tags ``0..tiles-2``, the last tile (the thumbnail) the last tag.
        """
        if num_image_tiles.numel() != 1:
            raise ValueError(f"tile tags support one image per batch, got {num_image_tiles.numel()} images "
                             f"(num_image_tiles={num_image_tiles.tolist()})")
        num_tiles = int(num_image_tiles[0])
        tags = self._tile_tags[:num_tiles - 1] + [self._tile_tags[-1]]
        tag_ids = torch.tensor(tags, dtype=torch.int64, device=image_embeddings.device)  # [tiles, tag_len]
        tag_embeddings = self.language_model.embedding(tag_ids, position_ids=None)  # [tag_len, tiles, h]
        return torch.cat([tag_embeddings.to(image_embeddings.dtype), image_embeddings])

    def _encode_images(self, images: torch.Tensor | None, input_ids: torch.Tensor, num_image_tiles: torch.Tensor,
                       image_token_index: int, inference_context: Any) -> torch.Tensor:
        """Image tiles ``[tiles, 3, h, w]`` -> projected embeddings ``[img_seq_len, tiles, h_language]``."""
        if images is None or images.shape[0] == 0:
            dtype = images.dtype if images is not None else self.config.params_dtype
            return torch.zeros(0, 0, 0, dtype=dtype, device=input_ids.device)
        tiles = self.vision_model(images)  # [tiles, s, h_vision]
        if self._drop_vision_class_token:
            tiles = tiles[:, self.vision_model.class_token_len:, :]
        if self._pixel_shuffle:
            tiles = pixel_shuffle(tiles)
        embeddings = self.vision_projection(tiles.transpose(0, 1).contiguous())  # [s, tiles, h_language]
        if self._tile_tags is not None and bool((input_ids == image_token_index).any()):
            embeddings = self._apply_tile_tagging(embeddings, num_image_tiles)
        if inference_context is not None:  # later decode steps find the images in the KV cache
            inference_context.key_value_memory_dict["image_tokens_count"] = embeddings.shape[0] * embeddings.shape[1]
        return embeddings

    def forward(
        self,
        images: torch.Tensor | None,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        inference_context: Any = None,
        num_image_tiles: list[int] | torch.Tensor | None = None,
        image_token_index: int | None = None,
        runtime_gather_output: bool | None = None,
        packed_seq_params: Any = None,
        vision_packed_seq_params: Any = None,
        sound_clips: torch.Tensor | None = None,
        sound_length: torch.Tensor | None = None,
        sound_timestamps: torch.Tensor | None = None,
        num_sound_clips: torch.Tensor | None = None,
        imgs_sizes: torch.Tensor | None = None,
        num_frames: list[int] | None = None,
        *,
        inference_params: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(loss [b, L] with labels, else logits [b, L, V]; loss mask [b, L])`` for images and text.

        ``images`` ``[tiles, 3, img_h, img_w]`` (all tiles of the batch), ``input_ids`` ``[b, t]`` with one
        ``image_token_index`` per image, ``num_image_tiles`` tiles per image (default 1 each), ``labels`` and
        ``loss_mask`` ``[b, t]``. A stage without the language model returns ``(image embeddings, loss_mask)``.
        """
        inference_context = inference_context if inference_context is not None else inference_params
        unsupported = {"vision_packed_seq_params": vision_packed_seq_params, "sound_clips": sound_clips,
                       "sound_length": sound_length, "sound_timestamps": sound_timestamps,
                       "num_sound_clips": num_sound_clips, "imgs_sizes": imgs_sizes, "num_frames": num_frames}
        given = sorted(name for name, value in unsupported.items() if value is not None)
        if given:
            raise ValueError(f"LLaVAModel.forward: {given} are not supported by this library (dynamic-resolution, "
                             "video and sound inputs); pass fixed-size image tiles only")
        if image_token_index is None:
            image_token_index = self.image_token_index
        if num_image_tiles is None:
            count = images.shape[0] if images is not None else 0
            num_image_tiles = torch.ones(count, dtype=torch.int, device=input_ids.device)
        else:
            num_image_tiles = torch.as_tensor(num_image_tiles, dtype=torch.int, device=input_ids.device).reshape(-1)
        if images is not None and self.add_encoder and int(num_image_tiles.sum()) != images.shape[0]:
            raise ValueError(f"images hold {images.shape[0]} tiles but num_image_tiles ({num_image_tiles.tolist()}) "
                             f"sums to {int(num_image_tiles.sum())}")
        use_kv_cache = inference_context is not None and (
            "image_tokens_count" in inference_context.key_value_memory_dict)

        if use_kv_cache:
            image_embeddings = None
        elif self.add_encoder:
            image_embeddings = self._encode_images(images, input_ids, num_image_tiles, image_token_index,
                                                   inference_context)
        else:
            image_embeddings = self.encoder_hidden_state
        if not self.add_decoder:
            return image_embeddings, loss_mask

        language_embeddings = None
        if self.pre_process:
            text_ids = input_ids.masked_fill(input_ids == image_token_index, 0)
            # Learned absolute positions count each image as one position; RoPE (in the language model)
            # numbers the combined sequence.
            language_embeddings = self.language_model.embedding(input_ids=text_ids, position_ids=position_ids)
            language_embeddings = language_embeddings.transpose(0, 1).contiguous()  # [b, t, h]

        combined, new_labels, new_loss_mask = self._preprocess_data(
            image_embeddings, language_embeddings, input_ids, loss_mask, labels, use_kv_cache, inference_context,
            image_token_index, num_image_tiles,
        )
        if self.context_parallel_lm > 1 or self.sequence_parallel_lm:
            combined, new_labels, new_loss_mask, packed_seq_params = self._process_embedding_token_parallel(
                combined, new_labels, new_loss_mask, packed_seq_params)
        output = self.language_model(
            input_ids=None, position_ids=None, attention_mask=attention_mask, decoder_input=combined,
            labels=new_labels, inference_context=inference_context, runtime_gather_output=runtime_gather_output,
            packed_seq_params=packed_seq_params,
        )
        return output, new_loss_mask


def _check_supported(language_config: TransformerConfig, vision_config: TransformerConfig,
                     vision_model_type: str | None, drop_vision_class_token: bool, sound_model: Any, sound_projection: Any,
                     dynamic_resolution: bool, temporal_patch_dim: int, separate_video_embedder: bool) -> None:
    """Refuse, by name, the LLaVA variants this library does not build."""
    if vision_model_type is None:
        raise ValueError("vision_transformer_config.vision_model_type must be set (one of 'clip', 'siglip', "
                         "'internvit', 'internvit300M', 'radio', 'radio-g', 'cradio-g', 'hf://<SigLIP model>'), as "
                         "Megatron-LM's multimodal configs do")
    if not (vision_model_type.startswith(_CLIP_LIKE) or vision_model_type in _RADIO_TYPES
            or is_hf_vision_type(vision_model_type)):
        raise ValueError(f"vision_model_type ({vision_model_type!r}) is not supported: this library builds CLIP, "
                         "SigLIP and InternViT encoders, RADIO ('radio', 'radio-g', 'cradio-g') and Hugging Face "
                         "'hf://' SigLIP towers")
    if (vision_model_type == "siglip" or is_hf_vision_type(vision_model_type)) and drop_vision_class_token:
        raise ValueError(f"vision_model_type {vision_model_type!r} has no class token: drop_vision_class_token "
                         "must be False (SigLIP encoders, the only Hugging Face towers LLaVA takes, have none)")
    if vision_config.context_parallel_size != 1:
        raise ValueError(f"vision_transformer_config.context_parallel_size ({vision_config.context_parallel_size}) "
                         "must be 1: context parallelism splits only the language model's sequence")
    language_model_type = getattr(language_config, "language_model_type", "") or ""
    if language_model_type.startswith(_HYBRID_LANGUAGE_MODELS):
        raise ValueError(f"language_model_type ({language_model_type!r}) needs the hybrid Mamba language model, "
                         "which this library does not provide; LLaVAModel builds a GPTModel")
    refused = {"sound_model": sound_model is not None, "sound_projection": sound_projection is not None,
               "dynamic_resolution": dynamic_resolution, "temporal_patch_dim > 1": temporal_patch_dim > 1,
               "separate_video_embedder": separate_video_embedder}
    named = [name for name, on in refused.items() if on]
    if named:
        raise ValueError(f"LLaVAModel: {named} are not supported by this library (sound, dynamic-resolution and "
                         "video inputs need encoders it does not provide)")


def _radio_class_token_len(vision_config: TransformerConfig, use_vision_backbone_fp8_arch: bool,
                           drop_vision_class_token: bool) -> int:
    """RADIO's class-token count as Megatron-Core picks it: ``vision_config.class_token_len`` if set, else 8
    (5 for ``"radio-g"``); 16 under FP8 (32 with MXFP8), which needs the token count padded."""
    vision_model_type = vision_config.vision_model_type
    default = 5 if vision_model_type == "radio-g" else 8
    length = getattr(vision_config, "class_token_len", default)
    if vision_config.fp8 or use_vision_backbone_fp8_arch:
        length = 32 if vision_config.fp8_recipe == "mxfp8" else 16
    # get_num_image_embeddings counts 8 class tokens for cradio-g whatever the encoder has.
    if vision_model_type == "cradio-g" and length != 8 and not drop_vision_class_token:
        raise ValueError(f"vision_model_type 'cradio-g' keeps its class tokens (drop_vision_class_token=False) "
                         f"but has class_token_len={length}: the image token count assumes 8, so drop the "
                         "class tokens or use 8")
    return length


def _build_radio(config: TransformerConfig, layer_spec: ModuleSpec, img_h: int, img_w: int, patch_dim: int,
                 class_token_len: int, force_eval_mode: bool, force_cpe_eval_mode: bool, interpolate_only_cpe: bool,
                 cpe_aspect_ratio_select: bool, disable_cpe: bool, pg_collection: Any,
                 vp_stage: int | None) -> RADIOViTModel:
    """The RADIO encoder with the per-type settings Megatron-Core uses: ``"radio"`` and ``"cradio-g"`` a
    2048-pixel position grid; ``"radio-g"`` a 1792-pixel one, an embedder bias, a mask token and ``ln_post``."""
    is_g = config.vision_model_type == "radio-g"
    max_img = 1792 if is_g else 2048
    return RADIOViTModel(
        config, layer_spec, ln_post_impl=WrappedTorchNorm if is_g else None, img_h=img_h, img_w=img_w,
        max_img_h=max_img, max_img_w=max_img, class_token_len=class_token_len, patch_dim=patch_dim,
        add_class_token=True, embedder_bias=is_g, use_mask_token=is_g, force_eval_mode=force_eval_mode,
        force_cpe_eval_mode=force_cpe_eval_mode, interpolate_only_cpe=interpolate_only_cpe,
        cpe_aspect_ratio_select=cpe_aspect_ratio_select, has_cpe=not disable_cpe, pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def _encoder_groups(pg_collection: Any, vision_config: TransformerConfig) -> Any:
    """The vision encoder's groups: the model's, without context parallelism (CP splits only the language
    model's combined sequence; every CP rank encodes all tiles) and, when its config says
    ``pipeline_model_parallel_size=1``, without pipeline parallelism (the encoder lives whole on its stage)."""
    drop_cp = get_pg_size(pg_collection.cp) > 1
    drop_pp = vision_config.pipeline_model_parallel_size == 1 and get_pg_size(pg_collection.pp) > 1
    if not (drop_cp or drop_pp):
        return pg_collection
    groups = copy.copy(pg_collection)
    if drop_cp:
        groups.cp, groups.tp_cp = None, pg_collection.tp
    if drop_pp:
        groups.pp = None
    return groups


def _ignore_missing_keys(names: list[str], module: torch.nn.Module, incompatible_keys: Any) -> None:
    """Load hook: accept checkpoints that lack ``names`` (e.g. a projection trained from scratch)."""
    for name in names:
        if name in incompatible_keys.missing_keys:
            _logger.warning("LLaVAModel: %s missing from the checkpoint (allowed)", name)
            incompatible_keys.missing_keys.remove(name)


def _ignore_extra_state_keys(module: torch.nn.Module, incompatible_keys: Any) -> None:
    """Load hook: checkpoints with or without Transformer Engine's ``_extra_state`` entries both load."""
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        for key in [k for k in keys if "extra_state" in k]:
            keys.remove(key)
