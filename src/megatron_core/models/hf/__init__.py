"""Hugging Face checkpoints in and out (Megatron-Bridge's ``AutoBridge`` idea, written for this library).

- :class:`AutoBridge`: ``from_hf_pretrained(dir)`` -> ``to_megatron_model()`` (this rank's TP/PP shard,
  each rank reading only its slices) and ``save_hf_pretrained(model, dir)`` (streaming, atomic export).
- :func:`import_hf_to_mcore` / :func:`export_mcore_to_hf`: HF directory <-> distributed checkpoint on
  disk from one process (the ``megatron-convert`` command).

Supported architectures: :data:`SUPPORTED`; not supported (with the reason): :data:`NOT_SUPPORTED`.
See ``docs/hf_conversion.md``.
"""

from megatron_core.models.hf.bridge import NOT_SUPPORTED, SUPPORTED, AutoBridge, read_hf_config
from megatron_core.models.hf.convert import export_mcore_to_hf, import_hf_to_mcore
from megatron_core.models.hf.safetensors_io import HFCheckpointReader, HFConversionError
from megatron_core.models.hf.tokenizer import HFDirectoryTokenizer

__all__ = ["NOT_SUPPORTED", "SUPPORTED", "AutoBridge", "HFCheckpointReader", "HFConversionError",
           "HFDirectoryTokenizer", "export_mcore_to_hf", "import_hf_to_mcore", "read_hf_config"]
