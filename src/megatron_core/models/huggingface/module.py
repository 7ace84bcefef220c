"""Hugging Face models as ``MegatronModule`` s (Megatron-Core's ``models/huggingface/module.py``).

``HuggingFaceModule`` is the base of the wrappers: a ``MegatronModule`` holding a ``transformers`` model,
replicated on every tensor-parallel rank. Every parameter of a module assigned to it is marked
``average_gradients_across_tp_domain``, so ``finalize_model_grads`` averages the replicas' gradients over TP
and the copies cannot drift apart. Model paths carry a scheme: ``hf://<name or directory>`` (read with
``transformers``; a local directory needs no network) or ``nemo://<name>`` (Parakeet sound encoders only).
``get_hf_model_type`` names the family of a path and ``build_hf_model`` builds its wrapper.
"""

from __future__ import annotations

from typing import Any

from megatron_core.models.huggingface._base import HuggingFaceModule
from megatron_core.models.huggingface._optional import HAVE_TRANSFORMERS, transformers_attr

__all__ = ["HAVE_TRANSFORMERS", "AutoHuggingFaceModel", "HuggingFaceModule", "build_hf_model", "get_hf_model_type"]


class AutoHuggingFaceModel(HuggingFaceModule):
    """Any ``transformers.AutoModel``, loaded from ``config.huggingface_model_name_or_path``.

    ``forward`` passes its arguments to the model unchanged and returns the model's own output.
    """

    def __init__(self, config: Any) -> None:
        auto_model = transformers_attr("transformers", "AutoModel", "AutoHuggingFaceModel")
        super().__init__(config)
        self.model = auto_model.from_pretrained(config.huggingface_model_name_or_path)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward."""
        return self.model(*args, **kwargs)


def _is_parakeet_id(model_id: str) -> bool:
    """A path segment starts with ``parakeet`` (``nvidia/parakeet-tdt-0.6b-v2``; not ``org/myparakeet-x``)."""
    return any(segment.startswith("parakeet") for segment in model_id.split("/"))


def get_hf_model_type(model_path: str) -> str:
    """The family of a ``hf://`` or ``nemo://`` model path: ``"qwen"``, ``"siglip"`` or ``"parakeet"``.

    Parakeet is recognised from the path (scheme ``nemo://`` or ``hf://``, case-insensitive, and a path segment
    starting with ``parakeet``) without reading any config. Other ``nemo://`` paths raise
    ``NotImplementedError``; other ``hf://`` paths are classified by the first entry of the model's
    ``architectures`` (read with ``transformers.AutoConfig``), and an architecture that is neither Qwen nor
    SigLIP raises ``NotImplementedError``. A path without the ``hf://`` scheme raises ``IndexError``, as in
    Megatron-Core.
    """
    auto_config = transformers_attr("transformers", "AutoConfig", "get_hf_model_type")
    lowered = model_path.lower()
    if lowered.startswith(("nemo://", "hf://")):
        if _is_parakeet_id(lowered.split("://", 1)[1]):
            return "parakeet"
        if lowered.startswith("nemo://"):
            raise NotImplementedError(
                f"the nemo:// scheme is supported for Parakeet models only (a path segment starting with "
                f"'parakeet'), got {model_path}"
            )
    hf_config = auto_config.from_pretrained(model_path.split("hf://")[1])
    architecture = hf_config.architectures[0].lower()
    if "qwen" in architecture:
        return "qwen"
    if "siglip" in architecture:
        return "siglip"
    raise NotImplementedError(f"unsupported huggingface model {architecture} (at {model_path}): "
                              "supported are Qwen, SigLIP and Parakeet")


def build_hf_model(config: Any, model_path: str) -> HuggingFaceModule:
    """The wrapper of ``model_path``'s family, built from ``config``.

    Each wrapper reads its own path from ``config``: ``language_model_type`` (Qwen), ``vision_model_type``
    (SigLIP) or ``sound_model_type`` (Parakeet); ``model_path`` only chooses the family.
    """
    model_type = get_hf_model_type(model_path)
    if "qwen" in model_type:
        from megatron_core.models.huggingface import qwen_model

        return qwen_model.QwenHuggingFaceModel(config)
    if "siglip" in model_type:
        from megatron_core.models.huggingface import clip_model

        return clip_model.SiglipHuggingFaceModel(config)
    if "parakeet" in model_type:
        from megatron_core.models.huggingface import fastconformer_model

        return fastconformer_model.ParakeetHuggingFaceModel(config)
    raise NotImplementedError(f"unsupported huggingface model type {model_type!r} (from {model_path})")
