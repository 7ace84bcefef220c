"""Audio-to-language projection (Megatron-Core's ``AudioProjection``, ``models.audio.audio_projector``).

``stack_factor`` consecutive encoder embeddings ``[b, t, input_size]`` are concatenated (time zero-padded to a
multiple of it; masked positions zeroed first) into ``[b, ceil(t / k), k * input_size]`` and mapped to the
language model's ``hidden_size`` by a :class:`~megatron_core.models.vision.multimodal_projector.MultimodalProjector`
(keys ``projector.encoder.*``). The output is ``[t', b, hidden]`` (sequence first) with the stacked mask ``[b, t']``:
a stack is valid when any of its frames is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_core.models.audio.packed_audio import PackedAudioEmbeddings
from megatron_core.models.vision.multimodal_projector import MultimodalProjector
from megatron_core.transformer.mlp import MLPSubmodules
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["AudioProjection"]


class AudioProjection(MegatronModule):
    """Stack audio embeddings in time and project them to ``config.hidden_size`` (module docstring)."""

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules, projector_type: str, input_size: int,
                 stack_factor: int = 1, tp_group: Any = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if stack_factor < 1:
            raise ValueError(f"stack_factor must be >= 1, got {stack_factor}")
        self.input_size = input_size
        self.stack_factor = stack_factor
        self.output_size = config.hidden_size
        self.projector = MultimodalProjector(config=config, submodules=submodules, projector_type=projector_type,
                                             input_size=input_size * stack_factor, tp_group=tp_group,
                                             pg_collection=pg_collection)

    def _stack_features(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[b, t, h]`` -> ``[b, ceil(t / k), k h]`` and the stacked mask (``None`` without a mask)."""
        batch, time, hidden = hidden_states.shape
        if hidden != self.input_size:
            raise ValueError(f"hidden_states' last dim ({hidden}) must equal input_size ({self.input_size})")
        if attention_mask is not None:
            attention_mask = attention_mask.to(dtype=torch.bool, device=hidden_states.device)
            hidden_states = hidden_states * attention_mask.unsqueeze(-1).to(hidden_states.dtype)
        pad = (-time) % self.stack_factor
        if pad:
            hidden_states = F.pad(hidden_states, (0, 0, 0, pad))
            if attention_mask is not None:
                attention_mask = F.pad(attention_mask, (0, pad), value=False)
        stacks = hidden_states.shape[1] // self.stack_factor
        stacked = hidden_states.reshape(batch, stacks, self.stack_factor * hidden)
        if attention_mask is None:
            return stacked, None
        return stacked, attention_mask.reshape(batch, stacks, self.stack_factor).any(dim=-1)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[b, t, input_size]`` (+ mask ``[b, t]``) -> ``([t', b, hidden_size], mask [b, t'] or None)``."""
        stacked, mask = self._stack_features(hidden_states, attention_mask)
        return self.projector(stacked.permute(1, 0, 2).contiguous()), mask

    def forward_packed(self, packed_states: PackedAudioEmbeddings) -> PackedAudioEmbeddings:
        """Project packed embeddings ``[total, input_size]``, keeping the packing (``stack_factor`` 1 only)."""
        if self.stack_factor != 1:
            raise NotImplementedError(f"packed audio projection supports stack_factor 1 only, got {self.stack_factor}")
        embeddings = packed_states.embeddings
        if embeddings.ndim != 2:
            raise ValueError(f"packed audio embeddings must be [total, hidden], got {tuple(embeddings.shape)}")
        if embeddings.shape[-1] != self.input_size:
            raise ValueError(f"packed embeddings' last dim ({embeddings.shape[-1]}) must equal input_size "
                             f"({self.input_size})")
        projected = self.projector(embeddings.unsqueeze(1)).squeeze(1)
        return PackedAudioEmbeddings(embeddings=projected,
                                     lengths=packed_states.lengths.to(dtype=torch.int32, device=projected.device))

    def estimate_flops(self, output_seq_lengths: torch.Tensor, include_backward: bool | None = None,
                       input_requires_grad: bool | None = None, count_padded: bool = True
                       ) -> dict[str, torch.Tensor]:
        """GEMM FLOPs of the projection over ``output_seq_lengths`` projected tokens per clip.

        ``count_padded`` counts ``max(lengths) * clips`` tokens (what :meth:`forward` computes), else their sum.
        Returns float64 ``projection_forward`` and ``projection_train`` (forward plus one forward's worth for the
        weight gradients and one for the input gradients, each when counted).
        """
        lengths = torch.as_tensor(output_seq_lengths)
        zero = torch.zeros((), dtype=torch.float64, device=lengths.device)
        if lengths.numel() == 0:
            return {"projection_forward": zero, "projection_train": zero}
        lengths = lengths.to(torch.long).clamp(min=0).to(torch.float64)
        tokens = lengths.max() * float(lengths.numel()) if count_padded else lengths.sum()
        fan_in, fan_out = self.input_size * self.stack_factor, self.output_size
        projector_type = self.projector.projector_type
        if projector_type == "affine":
            forward = 2.0 * tokens * fan_in * fan_out
        elif projector_type == "mlp":
            ffn = self.config.ffn_hidden_size
            if ffn is None:
                raise ValueError("the audio projection's MLP needs config.ffn_hidden_size")
            fc1_out = ffn * (2 if getattr(self.config, "gated_linear_unit", False) else 1)
            forward = 2.0 * tokens * fan_in * fc1_out + 2.0 * tokens * ffn * fan_out
        else:
            raise ValueError(f"projector_type ({projector_type!r}) must be 'affine' or 'mlp'")
        params_trainable = any(p.requires_grad for p in self.parameters())
        if input_requires_grad is None:
            input_requires_grad = params_trainable
        if include_backward is None:
            include_backward = self.training and (params_trainable or input_requires_grad)
        factor = 1.0 + (float(params_trainable) + float(input_requires_grad) if include_backward else 0.0)
        return {"projection_forward": forward, "projection_train": forward * factor}
