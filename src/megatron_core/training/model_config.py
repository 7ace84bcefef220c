"""The whole model configuration recorded as JSON in a checkpoint (``model_config``), for inference to rebuild the
model; the code is in :mod:`megatron_core.models.common.model_config_record` (the HF converter, below training,
writes it too). Not in Megatron-Core (which rebuilds from ``args``).
"""

from megatron_core.models.common.model_config_record import (
    FORMAT_VERSION,
    MODEL_CONFIG_KEY,
    model_config_record,
    model_config_record_for,
    parse_model_config,
    transformer_config_from_record,
)

__all__ = [
    "FORMAT_VERSION", "MODEL_CONFIG_KEY", "model_config_record", "model_config_record_for", "parse_model_config",
    "transformer_config_from_record",
]
