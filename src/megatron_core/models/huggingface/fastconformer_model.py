"""Parakeet (FastConformer) sound encoders as a ``MegatronModule`` (Megatron-Core's ``ParakeetHuggingFaceModel``).

Two backends, chosen by the scheme of ``config.sound_model_type``:

- ``nemo://<name>``: NVIDIA NeMo's ASR model (``pip install 'nemo_toolkit[asr]'``); its preprocessor turns
  audio into features and its encoder returns ``[b, h, t]``, transposed here to ``[b, t, h]``. Loading a NeMo
  model is slow, so ``get_nemo_sound_model`` keeps one (preprocessor, encoder) pair per model id for the
  process: wrappers of the same id share the encoder's parameters.
- ``hf://<name or directory>``: ``transformers``' ``AutoFeatureExtractor`` and ``AutoModel`` (a
  ``ParakeetEncoder``).

``forward(sound_clips, sound_lengths)`` returns ``(hidden [b, t, h], lengths [b])``. With the ``hf://`` backend
the lengths are the feature extractor's frame counts (its attention mask summed), as in Megatron-Core.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.models.huggingface._base import HuggingFaceModule
from megatron_core.models.huggingface._optional import import_nemo_asr, transformers_attr

__all__ = ["ParakeetHuggingFaceModel", "get_nemo_sound_model"]

# One NeMo (preprocessor, encoder) pair per ``nemo://`` model id.
_NEMO_SOUND_MODEL_CACHE: dict[str, tuple[Any, Any]] = {}


def get_nemo_sound_model(sound_model_type: str) -> tuple[Any, Any]:
    """``(preprocessor, encoder)`` of the NeMo ASR model ``"nemo://<name>"``, loaded once per id and cached.

    The encoder is set up for training inside Megatron: no cross-rank sync of the longest audio length (an
    extra collective that can hang) and PyTorch's SDPA in every self-attention.
    """
    if sound_model_type not in _NEMO_SOUND_MODEL_CACHE:
        nemo_asr = import_nemo_asr("ParakeetHuggingFaceModel")
        asr_model = nemo_asr.models.ASRModel.from_pretrained(model_name=sound_model_type.split("nemo://")[1])
        asr_model.encoder.sync_max_audio_length = False
        for layer in asr_model.encoder.layers:
            layer.self_attn.use_pytorch_sdpa = True
        _NEMO_SOUND_MODEL_CACHE[sound_model_type] = (asr_model.preprocessor, asr_model.encoder)
    return _NEMO_SOUND_MODEL_CACHE[sound_model_type]


class ParakeetHuggingFaceModel(HuggingFaceModule):
    """A Parakeet encoder and its feature extractor, from ``config.sound_model_type`` (``nemo://`` or ``hf://``).

    Reads ``config.hidden_dropout`` (the NeMo encoder's dropout probability) and
    ``config.recompute_granularity`` (any value but ``None`` turns on activation checkpointing: PyTorch's
    ``checkpoint_wrapper`` around the NeMo encoder; ``activation_checkpointing_enable()``, or
    ``gradient_checkpointing_enable()`` before transformers 5, on the HF one).
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.use_nemo = config.sound_model_type.startswith("nemo://")
        if self.use_nemo:
            self.feature_extractor, self.model = get_nemo_sound_model(config.sound_model_type)
            for module in self.model.modules():
                if type(module).__name__.lower() == "dropout":
                    module.p = config.hidden_dropout
            if config.recompute_granularity is not None:
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

                self.model = checkpoint_wrapper(self.model)
        elif config.sound_model_type.startswith("hf://"):
            what = "ParakeetHuggingFaceModel"
            feature_extractor = transformers_attr("transformers", "AutoFeatureExtractor", what)
            auto_model = transformers_attr("transformers", "AutoModel", what)
            path = config.sound_model_type.split("hf://")[1]
            self.feature_extractor = feature_extractor.from_pretrained(path)
            self.model = auto_model.from_pretrained(path)
            if config.recompute_granularity is not None:
                # transformers 5 renamed gradient_checkpointing_enable (now deprecated) to activation_...
                enable = getattr(self.model, "activation_checkpointing_enable", None)
                (enable or self.model.gradient_checkpointing_enable)()
        else:
            raise ValueError(f"Unknown sound model type: {config.sound_model_type} "
                             "(sound_model_type must start with 'nemo://' or 'hf://')")

    def _model_dtype(self) -> torch.dtype:
        """The encoder's parameter dtype (bf16 for an encoder without parameters)."""
        for param in self.model.parameters():
            return param.dtype
        return torch.bfloat16

    def _sampling_rate(self) -> int:
        """The sampling rate the feature extractor expects (16 kHz unless it says otherwise)."""
        return int(getattr(self.feature_extractor, "sampling_rate", 16000))

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden [b, t, h], lengths [b])`` for ``args[0]`` (audio ``[b, samples]``) and ``args[1]`` (its
        lengths ``[b]``; read by the NeMo backend only). With the ``hf://`` backend, keyword arguments go to
        the feature extractor."""
        if self.use_nemo:
            features, feature_lengths = self.feature_extractor(input_signal=args[0], length=args[1])[:2]
            hidden_bht, lengths = self.model(audio_signal=features, length=feature_lengths)[:2]
            return hidden_bht.permute(0, 2, 1), lengths
        features = self.feature_extractor(args[0], **kwargs, return_tensors="pt", sampling_rate=self._sampling_rate(),
                                          return_attention_mask=True)
        output = self.model(features.input_features.to(self._model_dtype()), features.attention_mask)
        lengths = features.attention_mask.sum(dim=-1).to(output.last_hidden_state.device)
        return output.last_hidden_state, lengths
