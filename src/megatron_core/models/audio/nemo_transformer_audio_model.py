"""The NeMo transformer audio tower as a Megatron module (Megatron-Core's ``models.audio.nemo_transformer_audio_model``).

``NemoTransformerAudioModel`` wraps :class:`~megatron_core.models.audio.nemo_transformer_encoder.TransformerEncoder`
(keys ``encoder.*``) for LLaVA-style models: ``forward(features [b, t, n_mels], mask [b, t])`` returns embeddings
``[b, t', d_model]`` and their validity mask ``[b, t']``; ``forward_packed`` returns only the valid rows as
:class:`~megatron_core.models.audio.packed_audio.PackedAudioEmbeddings`. Features are cast to the encoder's
parameter dtype first (the loader emits fp32 mels; the tower may live in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from megatron_core.models.audio._audio_flops import attention_pairs, post_subsample_lengths, pre_encode_flops
from megatron_core.models.audio.nemo_transformer_encoder import TransformerEncoder
from megatron_core.models.audio.packed_audio import PackedAudioEmbeddings
from megatron_core.transformer.module import MegatronModule

__all__ = ["NemoTransformerAudioConfig", "NemoTransformerAudioModel"]


@dataclass
class NemoTransformerAudioConfig:
    """Hyperparameters of the NeMo transformer audio encoder.

    ``attn_impl`` (``"auto"``, ``"te"``, ``"sdpa"``, ``"fa"``), ``recompute_layers`` and ``left_context`` change how
    it runs, not its parameters: a checkpoint loads whatever they are.
    """

    n_mels: int = 80
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 17
    drop_rate: float = 0.1
    qkv_bias: bool = False
    causal_mask: bool = False
    pre_encode: str = "conv"
    nan_debug: bool = False
    qk_norm: bool = False
    subsampling_factor: int = 4
    attn_impl: str = "auto"
    recompute_layers: bool = False
    left_context: int | None = None

    @property
    def output_embedding_dim(self) -> int:
        """Width of the encoder's output embeddings (``d_model``)."""
        return self.d_model

    @property
    def encoder_time_stride(self) -> int:
        """Mel frames per encoder step: 4 for the convolutional pre-encoders, else ``subsampling_factor``."""
        return 4 if self.pre_encode in ("conv", "depth_conv") else self.subsampling_factor

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NemoTransformerAudioConfig:
        """The config from ``data``; keys that are not fields (``_target_``, NeMo-only options) are dropped."""
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})


class NemoTransformerAudioModel(MegatronModule):
    """Audio encoder for multimodal models (module docstring)."""

    def __init__(self, config: NemoTransformerAudioConfig) -> None:
        super().__init__(config=config)
        self.encoder = TransformerEncoder(
            n_mels=config.n_mels, d_model=config.d_model, n_heads=config.n_heads, n_layers=config.n_layers,
            drop_rate=config.drop_rate, qkv_bias=config.qkv_bias, causal_mask=config.causal_mask,
            pre_encode=config.pre_encode, nan_debug=config.nan_debug, qk_norm=config.qk_norm,
            subsampling_factor=config.subsampling_factor, attn_impl=config.attn_impl,
            recompute_layers=config.recompute_layers, left_context=config.left_context)

    def estimate_flops(self, input_seq_lengths: torch.Tensor, max_input_frames: int | None = None,
                       include_backward: bool | None = None) -> dict[str, torch.Tensor]:
        """GEMM FLOPs of the tower on clips of ``input_seq_lengths`` mel frames (padded to ``max_input_frames``).

        Returns float64 tensors ``nemo_forward``, ``nemo_train`` (3x forward when the backward is counted; by
        default when training with trainable parameters), ``pre_encode_forward`` and ``transformer_forward``.
        """
        lengths = torch.as_tensor(input_seq_lengths)
        zero = torch.zeros((), dtype=torch.float64, device=lengths.device)
        if lengths.numel() == 0:
            return {"nemo_forward": zero, "nemo_train": zero, "pre_encode_forward": zero,
                    "transformer_forward": zero}
        lengths = lengths.to(torch.long).clamp(min=0)
        frames = int(lengths.max()) if max_input_frames is None else int(max_input_frames)
        cfg = self.config
        pre_encode = zero + float(pre_encode_flops(cfg.pre_encode, int(cfg.subsampling_factor), int(cfg.n_mels),
                                                   int(cfg.d_model), lengths.numel(), max(0, frames)))
        steps = post_subsample_lengths(cfg.pre_encode, int(cfg.subsampling_factor), lengths)
        d_model = float(cfg.d_model)
        per_layer = (24.0 * steps.to(torch.float64).sum() * d_model * d_model
                     + 4.0 * attention_pairs(steps, cfg.causal_mask, cfg.left_context) * d_model)
        transformer = float(cfg.n_layers) * per_layer
        forward = pre_encode + transformer
        if include_backward is None:
            include_backward = self.training and any(p.requires_grad for p in self.parameters())
        return {"nemo_forward": forward, "nemo_train": forward * (3.0 if include_backward else 1.0),
                "pre_encode_forward": pre_encode, "transformer_forward": transformer}

    def _encoder_input(self, input_features: torch.Tensor, attention_mask: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        if input_features.ndim != 3:
            raise ValueError(f"input_features must be [b, t, n_mels], got shape {tuple(input_features.shape)}")
        batch, frames, feat = input_features.shape
        if feat != self.config.n_mels:
            raise ValueError(f"input_features' last dim ({feat}) must equal n_mels ({self.config.n_mels})")
        if attention_mask is None:
            lengths = torch.full((batch,), frames, dtype=torch.long, device=input_features.device)
        else:
            lengths = attention_mask.to(torch.long).sum(dim=-1)
        audio_bct = input_features.transpose(1, 2).contiguous()
        dtype = next(self.encoder.parameters(), audio_bct).dtype
        return audio_bct.to(dtype), lengths

    def forward(self, input_features: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mel features ``[b, t, n_mels]`` (valid frames where ``attention_mask``) -> ``([b, t', d], mask [b, t'])``."""
        audio_bct, lengths = self._encoder_input(input_features, attention_mask)
        encoded, lengths_out = self.encoder(audio_bct, lengths)
        encoded = encoded.transpose(1, 2).contiguous()
        steps = torch.arange(encoded.shape[1], device=encoded.device)[None, :]
        return encoded, steps < lengths_out.to(encoded.device)[:, None]

    def forward_packed(self, input_features: torch.Tensor, attention_mask: torch.Tensor | None = None
                       ) -> PackedAudioEmbeddings:
        """Like :meth:`forward`, keeping only the valid embeddings, packed clip after clip."""
        audio_bct, lengths = self._encoder_input(input_features, attention_mask)
        packed, lengths_out = self.encoder(audio_bct, lengths, return_packed=True)
        return PackedAudioEmbeddings(embeddings=packed, lengths=lengths_out.to(dtype=torch.int32, device=packed.device))
