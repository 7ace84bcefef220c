"""The RADIO vision transformer (Megatron-Core's ``models.vision.radio``: ``RADIOViTModel``, ``fp8_pad_hook``).

An image ``[b, 3, H, W]`` is cut into ``patch_dim`` x ``patch_dim`` patches, each flattened channel-major
(``c, y, x``) and mapped to the hidden size by a linear ``embedder`` (a ``ColumnParallelLinear`` that gathers
its output, so every TP rank holds all features). RADIO's position embeddings are one learned grid for the
largest image (``max_img_h`` x ``max_img_w``) that is resampled to each input's patch grid, the "conditional
position embedding" (CPE); see :mod:`._radio_pos_embed`. ``class_token_len`` learned class (register) tokens
go first, then an optional ``ln_pre``, the ``TransformerBlock`` (no final norm) and an optional ``ln_post``.
The output is ``[b, s, h]``, batch first.

With ``dynamic_resolution=True`` the input is already patchified and packed, ``[1, sum(patches_i), 3*P*P]``,
with ``imgs_sizes`` giving each image's ``(H, W)``; each image gets its own position embeddings and class
tokens (placed before its patches) and attends only to itself (``packed_seq_params``, ``"thd"``). Video
(``temporal_patch_dim > 1``, dynamic resolution only) groups frames into tubelets first (:mod:`._radio_temporal`)
and the forward pass then returns ``(output, tubelet sizes, tubelets per item)``.

Surprising but Megatron's: ``class_token`` is ``[class_token_len, h]`` (no batch dimension) and
``mask_token`` is a parameter that the forward pass never reads.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from megatron_core.device import get_current_device
from megatron_core.models.common.vision_module.vision_module import VisionModule
from megatron_core.models.vision._radio_pos_embed import PosEmbedOptions, resample_pos_embed
from megatron_core.models.vision._radio_temporal import (
    group_frames,
    init_embedder_from_2d,
    init_video_embedder,
)
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.process_groups_config import get_tensor_model_parallel_group_if_none
from megatron_core.tensor_parallel.layers import ColumnParallelLinear
from megatron_core.transformer.enums import ModelType
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.transformer_block import TransformerBlock
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["RADIOViTModel", "fp8_pad_hook"]

_logger = logging.getLogger(__name__)


def _check_geometry(patch_dim: int, img_h: int, img_w: int, max_img_h: int, max_img_w: int) -> None:
    if patch_dim <= 0:
        raise ValueError(f"patch_dim ({patch_dim}) must be positive")
    for name, size in (("img_h", img_h), ("img_w", img_w)):
        if size <= 0 or size % patch_dim != 0:
            raise ValueError(f"{name} ({size}) must be a positive multiple of patch_dim ({patch_dim})")
    for name, size in (("max_img_h", max_img_h), ("max_img_w", max_img_w)):
        if size < patch_dim:
            raise ValueError(f"{name} ({size}) must be at least patch_dim ({patch_dim})")


def _patchify(images: torch.Tensor, patch_dim: int) -> torch.Tensor:
    """``[b, c, py*P, px*P]`` -> ``[b, py*px, c*P*P]``: patches row-major, each flattened channel, row, column."""
    b, c, h, w = images.shape
    py, px = h // patch_dim, w // patch_dim
    patches = images.reshape(b, c, py, patch_dim, px, patch_dim).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, py * px, c * patch_dim * patch_dim)


def _size_pairs(imgs_sizes: Any) -> list[tuple[int, int]]:
    if torch.is_tensor(imgs_sizes):
        return [(int(h), int(w)) for h, w in imgs_sizes.tolist()]
    return [(int(h), int(w)) for h, w in imgs_sizes]


class RADIOViTModel(VisionModule):
    """RADIO ViT: linear patch embedder, resampled (CPE) position embeddings, class tokens, transformer layers."""

    def __init__(
        self,
        transformer_config: TransformerConfig,
        transformer_layer_spec: ModuleSpec,
        ln_pre_impl: ModuleSpec | type | None = None,
        ln_post_impl: ModuleSpec | type | None = None,
        use_mask_token: bool = False,
        add_class_token: bool = True,
        class_token_len: int = 8,
        patch_dim: int = 16,
        img_h: int = 224,
        img_w: int = 224,
        max_img_h: int = 2048,
        max_img_w: int = 2048,
        pos_dropout: float = 0,
        has_cpe: bool = True,
        embedder_bias: bool = False,
        dynamic_resolution: bool = False,
        force_eval_mode: bool = False,
        force_cpe_eval_mode: bool = False,
        interpolate_only_cpe: bool = False,
        cpe_aspect_ratio_select: bool = False,
        interpolate_align_corners: bool = False,
        grid_sample_align_corners: bool = True,
        temporal_patch_dim: int = 1,
        temporal_ckpt_compat: bool = False,
        separate_video_embedder: bool = False,
        pg_collection: Any = None,
        vp_stage: int | None = None,
    ) -> None:
        if temporal_patch_dim < 1:
            raise ValueError(f"temporal_patch_dim ({temporal_patch_dim}) must be at least 1")
        if add_class_token and class_token_len <= 0:
            raise ValueError(f"class_token_len ({class_token_len}) must be positive when add_class_token=True")
        if not 0 <= pos_dropout < 1:
            raise ValueError(f"pos_dropout ({pos_dropout}) must be in [0, 1)")
        _check_geometry(patch_dim, img_h, img_w, max_img_h, max_img_w)
        super().__init__(config=transformer_config)
        self.model_type = ModelType.encoder_or_decoder
        self.visual_hidden_size = hidden = transformer_config.hidden_size
        self.patch_dim = patch_dim
        self.temporal_patch_dim = temporal_patch_dim
        self.img_h, self.img_w = img_h, img_w
        self.input_dims = (img_h // patch_dim, img_w // patch_dim)
        self.max_img_h, self.max_img_w = max_img_h, max_img_w
        self.max_num_rows = max_img_h // patch_dim
        self.max_num_cols = max_img_w // patch_dim
        self.max_num_patches = self.max_num_rows * self.max_num_cols
        self.add_class_token = add_class_token
        self.class_token_len = class_token_len
        self.seq_length = self.input_dims[0] * self.input_dims[1] + (class_token_len if add_class_token else 0)
        self.pos_dropout = pos_dropout
        self.has_cpe = has_cpe
        self.dynamic_resolution = dynamic_resolution
        self.force_eval_mode = force_eval_mode
        self.force_cpe_eval_mode = force_cpe_eval_mode
        self.interpolate_only_cpe = interpolate_only_cpe
        self.cpe_aspect_ratio_select = cpe_aspect_ratio_select
        self.interpolate_align_corners = interpolate_align_corners
        self.grid_sample_align_corners = grid_sample_align_corners
        self.separate_video_embedder = separate_video_embedder
        self.use_mask_token = use_mask_token
        self.pg_collection = pg_collection
        self.vp_stage = vp_stage
        tp_group = pg_collection.tp if pg_collection is not None else None
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group, check_initialized=False)

        dtype = transformer_config.params_dtype
        device = torch.device("cpu") if transformer_config.use_cpu_initialization else get_current_device()
        if use_mask_token:  # kept for checkpoints; the forward pass does not use it (nor does Megatron-Core's)
            self.mask_token = torch.nn.Parameter(torch.zeros(1, hidden, device=device))
        if add_class_token:
            self.class_token = torch.nn.Parameter(torch.randn(class_token_len, hidden, dtype=dtype, device=device))
            if transformer_config.fp8:
                self.register_load_state_dict_pre_hook(fp8_pad_hook)
        self.position_embeddings = torch.nn.Parameter(
            torch.randn(1, self.max_num_patches, hidden, dtype=dtype, device=device) * hidden**-0.5)

        # The embedder's input is the same on every rank and its output is gathered, never sequence-split.
        saved_sequence_parallel = transformer_config.sequence_parallel
        transformer_config.sequence_parallel = False
        try:
            def embedder(frames: int) -> ColumnParallelLinear:
                return ColumnParallelLinear(
                    3 * frames * patch_dim * patch_dim, hidden, config=transformer_config,
                    init_method=lambda weight: torch.nn.init.normal_(weight, mean=0.0, std=1.0),
                    bias=embedder_bias, gather_output=True, disable_grad_reduce=True, tp_group=tp_group,
                )

            self._separate_video = separate_video_embedder and temporal_patch_dim > 1
            self.embedder = embedder(1 if self._separate_video else temporal_patch_dim)
            if self._separate_video:
                self.video_embedder = embedder(temporal_patch_dim)
        finally:
            transformer_config.sequence_parallel = saved_sequence_parallel
        if temporal_ckpt_compat and temporal_patch_dim > 1:
            self.register_load_state_dict_pre_hook(
                self._state_dict_pre_hook_init_video_embedder if self._separate_video
                else self._state_dict_pre_hook_init_embedder)

        norm_args = dict(config=transformer_config, hidden_size=hidden, eps=transformer_config.layernorm_epsilon)
        self.ln_pre = build_module(ln_pre_impl, **norm_args) if ln_pre_impl is not None else None
        self.ln_post = build_module(ln_post_impl, **norm_args) if ln_post_impl is not None else None
        self.decoder = TransformerBlock(
            config=transformer_config,
            spec=transformer_layer_spec,
            pre_process=True,
            post_process=False,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
        self._warned_force_eval = False
        if force_eval_mode:
            self.eval()

    def train(self, mode: bool = True) -> RADIOViTModel:
        """Set train / eval mode; with ``force_eval_mode`` the model stays in eval mode (warns once)."""
        if mode and self.force_eval_mode:
            if not self._warned_force_eval:
                _logger.warning("RADIOViTModel has force_eval_mode=True: it stays in eval mode")
                self._warned_force_eval = True
            return self
        return super().train(mode)

    def _state_dict_pre_hook_init_embedder(self, module: torch.nn.Module, state_dict: dict, prefix: str,
                                           *args: Any) -> None:
        """Load pre-hook (``temporal_ckpt_compat``): widen an image-only embedder to tubelets."""
        init_embedder_from_2d(state_dict, prefix, self.temporal_patch_dim, self.patch_dim)

    def _state_dict_pre_hook_init_video_embedder(self, module: torch.nn.Module, state_dict: dict, prefix: str,
                                                 *args: Any) -> None:
        """Load pre-hook (``temporal_ckpt_compat``): derive a missing ``video_embedder`` from ``embedder``."""
        init_video_embedder(state_dict, prefix, self.temporal_patch_dim, self.patch_dim)

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        """Hand ``input_tensor`` to the transformer block (pipeline receive buffer)."""
        self.decoder.set_input_tensor(input_tensor)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        imgs_sizes: list[tuple[int, int]] | torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        num_frames: list[int] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any, list[int]]:
        """Encode images ``[b, 3, H, W]`` into ``[b, seq_length, h]``.

        With ``dynamic_resolution``: ``x`` ``[1, sum(patches_i), 3*P*P]`` and ``imgs_sizes`` ``(H_i, W_i)`` give
        ``[1, sum(class_token_len + patches_i), h]``; ``packed_seq_params`` (built from ``imgs_sizes`` when not
        given) describes the patches only, the class tokens are added to a copy of it. With
        ``temporal_patch_dim > 1``, ``imgs_sizes`` has one entry per frame, ``num_frames`` gives the frames of each
        item, and the result is ``(output over tubelets, tubelet sizes, tubelets per item)``.
        """
        if self.temporal_patch_dim > 1:
            if not self.dynamic_resolution or num_frames is None or imgs_sizes is None:
                raise ValueError("temporal_patch_dim > 1 needs dynamic_resolution=True and both imgs_sizes and "
                                 "num_frames (video frames are grouped into tubelets of packed patches)")
            sizes = _size_pairs(imgs_sizes)
            self._check_packed(x, sizes, 3 * self.patch_dim * self.patch_dim)
            grouped, sizes, num_frames, packed_seq_params, is_image = self._apply_temporal_grouping(
                x, sizes, list(num_frames), packed_seq_params, skip_image_duplication=self._separate_video)
            if self._separate_video:
                x = torch.cat([(self.embedder if image else self.video_embedder)(chunk)[0]
                               for chunk, image in zip(grouped, is_image)], dim=1)
            else:
                x = self.embedder(grouped)[0]
            out = self._encode_packed(x, attention_mask, sizes, packed_seq_params)
            if torch.is_tensor(imgs_sizes):
                sizes = torch.tensor(sizes, dtype=imgs_sizes.dtype, device=imgs_sizes.device)
            return out, sizes, num_frames
        if num_frames is not None:
            raise ValueError("num_frames is only for video inputs (temporal_patch_dim > 1)")
        if self.dynamic_resolution:
            return self._forward_dynamic(x, attention_mask, imgs_sizes, packed_seq_params)
        if imgs_sizes is not None:
            raise ValueError("imgs_sizes is only for dynamic_resolution=True")
        p = self.patch_dim
        if x.dim() != 4 or x.shape[1] != 3 or x.shape[2] % p or x.shape[3] % p or (
                (x.shape[2] // p) * (x.shape[3] // p) != self.input_dims[0] * self.input_dims[1]):
            raise ValueError(f"RADIOViTModel expects images [b, 3, H, W] with H, W multiples of patch_dim ({p}) and "
                             f"{self.input_dims[0] * self.input_dims[1]} patches (img_h={self.img_h}, "
                             f"img_w={self.img_w}), got shape {tuple(x.shape)}")
        hidden, _ = self.embedder(_patchify(x, p))
        hidden, _ = self.apply_pos_enc(hidden, input_size=tuple(x.shape[2:]))
        if self.add_class_token:
            hidden = torch.cat([self.class_token.expand(hidden.shape[0], -1, -1), hidden], dim=1)
        return self._encode(hidden, attention_mask, packed_seq_params)

    def _forward_dynamic(self, x: torch.Tensor, attention_mask: torch.Tensor | None, imgs_sizes: Any,
                         packed_seq_params: PackedSeqParams | None) -> torch.Tensor:
        """Packed patches of several images, each with its own position embeddings and class tokens."""
        if imgs_sizes is None:
            raise ValueError("dynamic_resolution=True needs imgs_sizes, the (H, W) of every packed image")
        sizes = _size_pairs(imgs_sizes)
        self._check_packed(x, sizes, 3 * self.patch_dim * self.patch_dim)
        return self._encode_packed(self.embedder(x)[0], attention_mask, sizes, packed_seq_params)

    def _check_packed(self, x: torch.Tensor, sizes: list[tuple[int, int]], width: int) -> None:
        total = sum((h // self.patch_dim) * (w // self.patch_dim) for h, w in sizes)
        if x.dim() != 3 or x.shape[0] != 1 or x.shape[2] != width or x.shape[1] != total:
            raise ValueError(f"dynamic_resolution input must be [1, {total}, {width}] (the patches of "
                             f"imgs_sizes={sizes}, patch_dim={self.patch_dim}), got shape {tuple(x.shape)}")

    def _apply_temporal_grouping(self, x: torch.Tensor, imgs_sizes: Any, num_frames: list[int],
                                 packed_seq_params: PackedSeqParams | None = None,
                                 skip_image_duplication: bool = False) -> tuple:
        """Frames -> tubelets: ``(tubelets, sizes, tubelets per item, packed params or None, is_image)``."""
        return group_frames(x, _size_pairs(imgs_sizes), num_frames, self.temporal_patch_dim, self.patch_dim,
                            packed_seq_params, skip_image_duplication)

    def _encode_packed(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                       sizes: list[tuple[int, int]], packed_seq_params: PackedSeqParams | None) -> torch.Tensor:
        """Embedded packed patches ``[1, n, h]`` -> per-image position embeddings and class tokens -> encoder."""
        seq_lens = [(h // self.patch_dim) * (w // self.patch_dim) for h, w in sizes]
        pieces = []
        for chunk, size in zip(torch.split(hidden, seq_lens, dim=1), sizes):
            chunk, _ = self.apply_pos_enc(chunk, input_size=size)
            if self.add_class_token:
                pieces.append(self.class_token.unsqueeze(0))
            pieces.append(chunk)
        hidden = torch.cat(pieces, dim=1)
        packed_seq_params = self._packed_with_class_tokens(packed_seq_params, seq_lens, hidden.device)
        return self._encode(hidden, attention_mask, packed_seq_params)

    def _packed_with_class_tokens(self, params: PackedSeqParams | None, seq_lens: list[int],
                                  device: torch.device) -> PackedSeqParams:
        """Document boundaries of the packed sequence with each image's class tokens in front of it.

        A new object: the caller's ``params`` (which attention caches layouts on) is left as it was.
        """
        if params is None:
            bounds = torch.tensor([0, *seq_lens], device=device).cumsum(0).to(torch.int32)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                                     max_seqlen_q=max(seq_lens), max_seqlen_kv=max(seq_lens))
        if not self.add_class_token:
            return params
        extra = self.class_token_len
        fields: dict[str, Any] = {}
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            cu = getattr(params, name)
            if cu is not None:
                fields[name] = cu + extra * torch.arange(cu.numel(), dtype=cu.dtype, device=cu.device)
        for name in ("max_seqlen_q", "max_seqlen_kv"):
            if getattr(params, name) is not None:
                fields[name] = getattr(params, name) + extra
        if params.total_tokens is not None:
            fields["total_tokens"] = params.total_tokens + extra * len(seq_lens)
        return dataclasses.replace(params, **fields, seq_idx=None)

    def _encode(self, hidden_bsh: torch.Tensor, attention_mask: torch.Tensor | None,
                packed_seq_params: PackedSeqParams | None) -> torch.Tensor:
        """``ln_pre`` -> transformer block (sequence first) -> ``ln_post``; ``[b, s, h]`` in and out."""
        if self.ln_pre is not None:
            hidden_bsh = self.ln_pre(hidden_bsh)
        # Contiguous so that pipeline sends see a plain tensor.
        hidden_sbh = self.decoder(hidden_bsh.transpose(0, 1).contiguous(), attention_mask=attention_mask,
                                  packed_seq_params=packed_seq_params)
        hidden_bsh = hidden_sbh.transpose(0, 1).contiguous()
        if self.ln_post is not None:
            hidden_bsh = self.ln_post(hidden_bsh)
        return hidden_bsh

    def apply_pos_enc(self, patches: torch.Tensor, patch_idxs: torch.Tensor | None = None,
                      input_size: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(patches + position embeddings, the embeddings)`` for ``patches`` ``[b, n, h]`` of an ``input_size``
        image; in training with ``pos_dropout`` each sample's embeddings are dropped with that probability."""
        pos_enc = self.get_pos_enc(patches.shape[0], patch_idxs, input_size)
        if self.training and self.pos_dropout > 0:
            keep = torch.rand(patches.shape[0], 1, 1, dtype=pos_enc.dtype, device=pos_enc.device) > self.pos_dropout
            return patches + torch.where(keep, pos_enc, 0), pos_enc
        return patches + pos_enc, pos_enc

    def get_pos_enc(self, batch_size: int, patch_idxs: torch.Tensor | None = None,
                    input_size: tuple[int, int] | None = None) -> torch.Tensor:
        """Position embeddings ``[1 or batch_size, n, h]`` for an ``input_size`` (default ``img_h, img_w``) image;
        ``patch_idxs`` ``[b, k]`` picks patches."""
        dims = self.input_dims if input_size is None else tuple(int(d) // self.patch_dim for d in input_size)
        pos_embed = self._get_pos_embeddings(batch_size, dims)
        if patch_idxs is None:
            return pos_embed
        index = patch_idxs.unsqueeze(-1).expand(-1, -1, pos_embed.shape[-1])
        return torch.gather(pos_embed.expand(patch_idxs.shape[0], -1, -1), dim=1, index=index)

    def _get_pos_embeddings(self, batch_size: int, input_dims: tuple[int, int]) -> torch.Tensor:
        """The learned grid resampled to ``input_dims`` patches (random crops in training, see CPE)."""
        if (self.max_num_rows, self.max_num_cols) == tuple(input_dims):
            return self.position_embeddings
        grid = self.position_embeddings.reshape(1, self.max_num_rows, self.max_num_cols, -1).permute(0, 3, 1, 2)
        options = PosEmbedOptions(
            has_cpe=self.has_cpe, interpolate_only_cpe=self.interpolate_only_cpe,
            cpe_aspect_ratio_select=self.cpe_aspect_ratio_select,
            random_crop=self.training and not self.force_cpe_eval_mode,
            interpolate_align_corners=self.interpolate_align_corners,
            grid_sample_align_corners=self.grid_sample_align_corners,
        )
        return resample_pos_embed(grid, tuple(input_dims), batch_size, options)


def fp8_pad_hook(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                 missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """Load pre-hook: pad a checkpoint's class tokens to the length FP8 needs (a multiple of 16, 32 for MXFP8).

    Random rows go in front (the checkpoint's tokens stay last), as Megatron-Core does; the key is
    ``prefix + "class_token"`` (``vision_model.class_token`` inside LLaVA).
    """
    key = prefix + "class_token"
    if key not in state_dict:
        return
    multiple = 32 if module.config.fp8_recipe == "mxfp8" else 16
    class_token = state_dict[key]
    short = -class_token.shape[0] % multiple
    if short:
        pad = torch.randn(short, class_token.shape[-1], dtype=class_token.dtype, device=class_token.device)
        state_dict[key] = torch.cat([pad, class_token], dim=0)
