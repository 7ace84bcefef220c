"""MIMO configuration: the model config and the per-rank role of each module."""

from megatron_core.models.mimo.config.base_configs import MimoModelConfig
from megatron_core.models.mimo.config.role import ModuleStageInfo, RankRole

__all__ = ["MimoModelConfig", "ModuleStageInfo", "RankRole"]
