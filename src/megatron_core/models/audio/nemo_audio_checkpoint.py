"""NeMo ``.nemo`` archives and checkpoint-local JSON configs of the audio encoder (``models.audio.nemo_audio_checkpoint``).

A ``.nemo`` archive (NeMo's ``SaveRestoreConnector`` format) holds ``model_config.yaml`` and ``model_weights.ckpt``,
the whole ASR model's state dict. These helpers read the encoder and preprocessor configs from it, check their
``_target_`` classes, and load the ``encoder.*`` tensors into a
:class:`~megatron_core.models.audio.nemo_transformer_audio_model.NemoTransformerAudioModel`. Unlike Megatron-Core,
reading never unpickles arbitrary objects (``weights_only=True``) and never writes outside the extraction directory
(see :mod:`megatron_core.models.audio._nemo_archive`). Megatron checkpoints carry the resolved configs as two JSON
files next to the weights, so a run can be rebuilt without the archive.
"""

from __future__ import annotations

import contextlib
import json
import os
import tarfile
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from megatron_core.models.audio._nemo_archive import (
    extract_member,
    load_model_config,
    load_weights,
    validate_archive,
)
from megatron_core.models.audio.audio_feature_config import NemoAudioFeatureConfig
from megatron_core.models.audio.nemo_transformer_audio_model import (
    NemoTransformerAudioConfig,
    NemoTransformerAudioModel,
)

__all__ = [
    "CHECKPOINT_NEMO_AUDIO_PREPROCESSOR_CONFIG_NAME", "CHECKPOINT_NEMO_TRANSFORMER_AUDIO_CONFIG_NAME",
    "MODEL_CONFIG_NAME", "MODEL_WEIGHTS_NAME", "extract_nemo_archive", "has_nemo_audio_configs_in_checkpoint_dir",
    "load_nemo_transformer_audio_weights", "nemo_audio_config_paths_from_checkpoint_dir",
    "nemo_audio_configs_from_archive", "nemo_audio_configs_from_checkpoint_dir", "nemo_audio_configs_from_json_paths",
    "nemo_audio_configs_from_path", "read_nemo_config", "resolve_nemo_audio_configs_from_args",
    "write_nemo_audio_configs_from_args_to_checkpoint_dir", "write_nemo_audio_configs_to_checkpoint_dir",
]

MODEL_CONFIG_NAME = "model_config.yaml"
MODEL_WEIGHTS_NAME = "model_weights.ckpt"
CHECKPOINT_NEMO_TRANSFORMER_AUDIO_CONFIG_NAME = "nemo_transformer_audio_config.json"
CHECKPOINT_NEMO_AUDIO_PREPROCESSOR_CONFIG_NAME = "nemo_audio_preprocessor_config.json"

# The flex-attention encoder has the same parameters as the plain one.
_KNOWN_ENCODER_TARGETS = {
    "nemo.collections.asr.modules.TransformerEncoder",
    "nemo.collections.asr.modules.transformer_encoder.TransformerEncoder",
    "nemo.collections.asr.modules.transformer_encoder_flex.TransformerEncoder",
}
_KNOWN_PREPROC_TARGETS = {
    "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
    "nemo.collections.asr.modules.audio_preprocessing.AudioToMelSpectrogramPreprocessor",
}
_STRUCTURAL_FIELDS = ("n_mels", "d_model", "n_heads", "n_layers", "pre_encode", "subsampling_factor", "qk_norm",
                      "qkv_bias")


def _load_json(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _preprocessor_config(path: str | Path | None) -> NemoAudioFeatureConfig:
    return NemoAudioFeatureConfig.from_dict(_load_json(path)) if path else NemoAudioFeatureConfig()


def nemo_audio_config_paths_from_checkpoint_dir(checkpoint_dir: str | Path) -> tuple[Path, Path]:
    """``(encoder JSON, preprocessor JSON)`` paths inside a checkpoint iteration directory."""
    checkpoint_dir = Path(checkpoint_dir)
    return (checkpoint_dir / CHECKPOINT_NEMO_TRANSFORMER_AUDIO_CONFIG_NAME,
            checkpoint_dir / CHECKPOINT_NEMO_AUDIO_PREPROCESSOR_CONFIG_NAME)


def has_nemo_audio_configs_in_checkpoint_dir(checkpoint_dir: str | Path) -> bool:
    """Whether both audio config JSON files are in ``checkpoint_dir``."""
    return all(path.is_file() for path in nemo_audio_config_paths_from_checkpoint_dir(checkpoint_dir))


def nemo_audio_configs_from_json_paths(encoder_config_path: str | Path,
                                       preprocessor_config_path: str | Path | None = None
                                       ) -> tuple[NemoTransformerAudioConfig, NemoAudioFeatureConfig]:
    """Encoder and preprocessor configs from JSON files (preprocessor defaults without a path)."""
    return (NemoTransformerAudioConfig.from_dict(_load_json(encoder_config_path)),
            _preprocessor_config(preprocessor_config_path))


def nemo_audio_configs_from_checkpoint_dir(checkpoint_dir: str | Path
                                           ) -> tuple[NemoTransformerAudioConfig, NemoAudioFeatureConfig]:
    """The configs saved next to a Megatron checkpoint; ``FileNotFoundError`` when either file is missing."""
    encoder_path, preproc_path = nemo_audio_config_paths_from_checkpoint_dir(checkpoint_dir)
    if not (encoder_path.is_file() and preproc_path.is_file()):
        raise FileNotFoundError(f"Missing checkpoint-local NeMo audio config files in {checkpoint_dir}: "
                                f"{encoder_path.name}, {preproc_path.name}")
    return nemo_audio_configs_from_json_paths(encoder_path, preproc_path)


def resolve_nemo_audio_configs_from_args(args: Any) -> tuple[NemoTransformerAudioConfig, NemoAudioFeatureConfig]:
    """The audio configs a training run uses, from its arguments.

    Source: ``load_audio_from`` when it names a ``.nemo`` archive, else the ``nemo_transformer_audio_config`` /
    ``nemo_audio_preprocessor_config`` JSON files, else the defaults. Then the runtime overrides
    ``nemo_transformer_audio_attn_impl``, ``nemo_transformer_audio_left_context`` (negative: unlimited) and
    ``recompute_audio`` are written into the encoder config, so that saved configs describe the model that ran.
    """
    nemo_path = getattr(args, "load_audio_from", None)
    if nemo_path and str(nemo_path).endswith(".nemo"):
        encoder_cfg, preproc_cfg = nemo_audio_configs_from_path(nemo_path)
    else:
        encoder_path = getattr(args, "nemo_transformer_audio_config", None)
        preproc_path = getattr(args, "nemo_audio_preprocessor_config", None)
        if encoder_path:
            encoder_cfg, preproc_cfg = nemo_audio_configs_from_json_paths(encoder_path, preproc_path)
        else:
            encoder_cfg, preproc_cfg = NemoTransformerAudioConfig(), _preprocessor_config(preproc_path)
    attn_impl = getattr(args, "nemo_transformer_audio_attn_impl", None)
    if attn_impl:
        encoder_cfg.attn_impl = attn_impl
    left_context = getattr(args, "nemo_transformer_audio_left_context", None)
    if left_context is not None:
        encoder_cfg.left_context = None if left_context < 0 else left_context
    encoder_cfg.recompute_layers = bool(getattr(args, "recompute_audio", False))
    return encoder_cfg, preproc_cfg


def write_nemo_audio_configs_to_checkpoint_dir(checkpoint_dir: str | Path, encoder_cfg: NemoTransformerAudioConfig,
                                               preproc_cfg: NemoAudioFeatureConfig) -> tuple[Path, Path]:
    """Save both configs as JSON in ``checkpoint_dir`` (created if needed); their paths."""
    Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    encoder_path, preproc_path = nemo_audio_config_paths_from_checkpoint_dir(checkpoint_dir)
    _write_json(encoder_path, asdict(encoder_cfg))
    _write_json(preproc_path, asdict(preproc_cfg))
    return encoder_path, preproc_path


def write_nemo_audio_configs_from_args_to_checkpoint_dir(args: Any, checkpoint_dir: str | Path
                                                         ) -> tuple[Path, Path] | None:
    """Save the configs resolved from ``args`` when ``args.audio_model_type == "nemo_transformer"``, else ``None``."""
    if (getattr(args, "audio_model_type", "") or "") != "nemo_transformer":
        return None
    return write_nemo_audio_configs_to_checkpoint_dir(checkpoint_dir, *resolve_nemo_audio_configs_from_args(args))


def read_nemo_config(nemo_path: str | Path) -> dict[str, Any]:
    """The ``model`` block of a ``.nemo`` archive's ``model_config.yaml`` as a plain dict (weights untouched)."""
    nemo_path = Path(nemo_path)
    validate_archive(nemo_path)
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(nemo_path, "r:") as tar:
        return load_model_config(extract_member(tar, MODEL_CONFIG_NAME, tmp))


def extract_nemo_archive(nemo_path: str | Path, out_dir: str | Path | None = None
                         ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(model config dict, full state dict)`` of a ``.nemo`` archive.

    The two members are written under ``out_dir`` (kept) or a temporary directory (removed afterwards).
    """
    nemo_path = Path(nemo_path)
    validate_archive(nemo_path)
    scratch = tempfile.TemporaryDirectory() if out_dir is None else contextlib.nullcontext(str(out_dir))
    with scratch as target:
        os.makedirs(target, exist_ok=True)
        with tarfile.open(nemo_path, "r:") as tar:
            cfg_path = extract_member(tar, MODEL_CONFIG_NAME, target)
            weights_path = extract_member(tar, MODEL_WEIGHTS_NAME, target)
        cfg = load_model_config(cfg_path)
        state = load_weights(weights_path)
    if not isinstance(state, dict):
        raise ValueError(f"{MODEL_WEIGHTS_NAME} in {nemo_path} holds a {type(state).__name__}, not a state dict")
    return cfg, state


def _without_private(block: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in block.items() if not key.startswith("_")}


def _split_audio_configs(cfg: dict[str, Any], nemo_path: str | Path
                         ) -> tuple[NemoTransformerAudioConfig, NemoAudioFeatureConfig]:
    """The encoder and preprocessor blocks as our configs, after checking their ``_target_`` classes."""
    for block in ("encoder", "preprocessor"):
        if block not in cfg:
            raise ValueError(f"{nemo_path}: model_config.yaml has no '{block}' block")
    encoder, preprocessor = dict(cfg["encoder"]), dict(cfg["preprocessor"])
    if "causal_mask" not in encoder and encoder.get("attn_mode") == "causal":
        encoder["causal_mask"] = True
    for name, block, known in (("encoder", encoder, _KNOWN_ENCODER_TARGETS),
                               ("preprocessor", preprocessor, _KNOWN_PREPROC_TARGETS)):
        target = block.get("_target_", "")
        if target and target not in known:
            raise ValueError(f"{nemo_path}: {name}._target_={target!r} is not supported; supported: {sorted(known)}")
    return (NemoTransformerAudioConfig.from_dict(_without_private(encoder)),
            NemoAudioFeatureConfig.from_dict(_without_private(preprocessor)))


def nemo_audio_configs_from_path(nemo_path: str | Path) -> tuple[NemoTransformerAudioConfig, NemoAudioFeatureConfig]:
    """Encoder and preprocessor configs of a ``.nemo`` archive, reading only its YAML (cheap on every rank)."""
    return _split_audio_configs(read_nemo_config(nemo_path), nemo_path)


def nemo_audio_configs_from_archive(nemo_path: str | Path
                                    ) -> tuple[NemoTransformerAudioConfig, NemoAudioFeatureConfig,
                                               dict[str, torch.Tensor]]:
    """Encoder config, preprocessor config and the encoder's tensors (``encoder.`` prefix removed) of an archive."""
    cfg, full_state = extract_nemo_archive(nemo_path)
    encoder_cfg, preproc_cfg = _split_audio_configs(cfg, nemo_path)
    encoder_state = {key[len("encoder."):]: value for key, value in full_state.items()
                     if key.startswith("encoder.") and isinstance(value, torch.Tensor)}
    if not encoder_state:
        prefixes = sorted({key.split(".", 1)[0] for key in full_state})
        raise ValueError(f"{nemo_path}: {MODEL_WEIGHTS_NAME} has no 'encoder.' tensors; top-level prefixes: {prefixes}")
    return encoder_cfg, preproc_cfg, encoder_state


def _validate_encoder_cfg(model_cfg: NemoTransformerAudioConfig, ckpt_cfg: NemoTransformerAudioConfig,
                          ckpt_path: str | Path) -> None:
    mismatches = [f"{name}: model={getattr(model_cfg, name)!r} ckpt={getattr(ckpt_cfg, name)!r}"
                  for name in _STRUCTURAL_FIELDS if getattr(model_cfg, name) != getattr(ckpt_cfg, name)]
    if mismatches:
        raise ValueError(f"Encoder config mismatch when loading {ckpt_path}:\n  " + "\n  ".join(mismatches)
                         + "\nBuild the audio model from the archive's config (nemo_audio_configs_from_archive) or "
                         "pass a matching --nemo-transformer-audio-config JSON.")


def load_nemo_transformer_audio_weights(audio_module: torch.nn.Module, ckpt_path: str | Path, *,
                                        strict: bool = False) -> tuple[list[str], list[str]]:
    """Load a ``.nemo`` archive's encoder weights into ``audio_module`` (a ``NemoTransformerAudioModel``).

    ``ValueError`` when a structural field (``n_mels``, ``d_model``, ``n_heads``, ``n_layers``, ``pre_encode``,
    ``subsampling_factor``, ``qk_norm``, ``qkv_bias``) differs. Returns ``(missing, unexpected)`` keys without
    Transformer Engine ``_extra_state`` entries; ``strict`` raises ``RuntimeError`` when either is non-empty.
    """
    if not isinstance(audio_module, NemoTransformerAudioModel):
        raise TypeError(f"Expected NemoTransformerAudioModel, got {type(audio_module)}")
    encoder_cfg, _, encoder_state = nemo_audio_configs_from_archive(ckpt_path)
    _validate_encoder_cfg(audio_module.config, encoder_cfg, ckpt_path)
    missing, unexpected = audio_module.encoder.load_state_dict(encoder_state, strict=False)
    missing = [key for key in missing if "_extra_state" not in key]
    unexpected = [key for key in unexpected if "_extra_state" not in key]
    if strict and (missing or unexpected):
        raise RuntimeError(f"strict load failed for {ckpt_path}: missing={missing[:20]} "
                           f"unexpected={unexpected[:20]}")
    return missing, unexpected
