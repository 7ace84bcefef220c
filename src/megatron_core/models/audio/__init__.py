"""NeMo-style audio encoders (Megatron-Core's ``models.audio``): log-mel preprocessing, the transformer audio tower,
its projection into a language model, packed audio embeddings and ``.nemo`` checkpoint loading.

Everything runs on torch alone; flash-attention, Transformer Engine and OmegaConf are imported when first used.
"""

from megatron_core.models.audio.audio_feature_config import (
    NemoAudioFeatureConfig,
    NemoTransformerAudioTokenEstimator,
    ceil_div,
)
from megatron_core.models.audio.audio_processor import NemoAudioProcessor
from megatron_core.models.audio.audio_projector import AudioProjection
from megatron_core.models.audio.nemo_audio_checkpoint import (
    CHECKPOINT_NEMO_AUDIO_PREPROCESSOR_CONFIG_NAME,
    CHECKPOINT_NEMO_TRANSFORMER_AUDIO_CONFIG_NAME,
    extract_nemo_archive,
    has_nemo_audio_configs_in_checkpoint_dir,
    load_nemo_transformer_audio_weights,
    nemo_audio_configs_from_archive,
    nemo_audio_configs_from_checkpoint_dir,
    nemo_audio_configs_from_json_paths,
    nemo_audio_configs_from_path,
    read_nemo_config,
    resolve_nemo_audio_configs_from_args,
    write_nemo_audio_configs_from_args_to_checkpoint_dir,
    write_nemo_audio_configs_to_checkpoint_dir,
)
from megatron_core.models.audio.nemo_transformer_audio_model import (
    NemoTransformerAudioConfig,
    NemoTransformerAudioModel,
)
from megatron_core.models.audio.packed_audio import PackedAudioEmbeddings

__all__ = [
    "AudioProjection",
    "CHECKPOINT_NEMO_AUDIO_PREPROCESSOR_CONFIG_NAME",
    "CHECKPOINT_NEMO_TRANSFORMER_AUDIO_CONFIG_NAME",
    "NemoAudioFeatureConfig",
    "NemoAudioProcessor",
    "NemoTransformerAudioConfig",
    "NemoTransformerAudioModel",
    "NemoTransformerAudioTokenEstimator",
    "PackedAudioEmbeddings",
    "ceil_div",
    "extract_nemo_archive",
    "has_nemo_audio_configs_in_checkpoint_dir",
    "load_nemo_transformer_audio_weights",
    "nemo_audio_configs_from_archive",
    "nemo_audio_configs_from_checkpoint_dir",
    "nemo_audio_configs_from_json_paths",
    "nemo_audio_configs_from_path",
    "read_nemo_config",
    "resolve_nemo_audio_configs_from_args",
    "write_nemo_audio_configs_from_args_to_checkpoint_dir",
    "write_nemo_audio_configs_to_checkpoint_dir",
]
