"""Megatron's data pipeline: ``.bin``/``.idx`` storage, GPT and blended datasets, samplers, tokenizers.

Files and samples are identical to Megatron-Core's (``megatron.core.datasets``); the C++ index
helpers are replaced by numpy (``helpers``). The tokenizers (``megatron_core.datasets.tokenizers``) live in
``megatron_core.tokenizers.legacy``.
"""

from megatron_core.datasets.blended_dataset import BlendedDataset
from megatron_core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron_core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_core.datasets.data_samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)
from megatron_core.datasets.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    MockGPTLowLevelDataset,
)
from megatron_core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from megatron_core.datasets.megatron_dataset import MegatronDataset
from megatron_core.datasets.utils import Split, get_blend_from_list, normalize
from megatron_core.tokenizers.legacy.megatron_tokenizer import MegatronTokenizer

__all__ = [
    "BlendedDataset",
    "BlendedMegatronDatasetBuilder",
    "BlendedMegatronDatasetConfig",
    "DType",
    "GPTDataset",
    "GPTDatasetConfig",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronDataset",
    "MegatronPretrainingRandomSampler",
    "MegatronPretrainingSampler",
    "MegatronTokenizer",
    "MockGPTDataset",
    "MockGPTLowLevelDataset",
    "Split",
    "build_pretraining_data_loader",
    "get_blend_from_list",
    "normalize",
]
