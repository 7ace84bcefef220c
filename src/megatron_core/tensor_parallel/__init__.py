"""Tensor and sequence parallelism (Megatron-Core's ``megatron.core.tensor_parallel``).

Column/row-parallel linear layers and the vocab-parallel embedding (:mod:`.layers`), the
communication mappings (:mod:`.mappings`), vocab-parallel cross entropy, the RNG tracker and
activation recompute (:mod:`.random`), batch broadcast (:mod:`.data`) and splitting helpers.
"""

from megatron_core.tensor_parallel.cross_entropy import (
    VocabParallelCrossEntropy,
    vocab_parallel_cross_entropy,
)
from megatron_core.tensor_parallel.data import broadcast_data
from megatron_core.tensor_parallel.inference_layers import (
    InferenceColumnParallelLinear,
    InferenceLayerNormColumnParallelLinear,
    InferenceRowParallelLinear,
)
from megatron_core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    linear_with_grad_accumulation_and_async_allreduce,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron_core.tensor_parallel.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    all_to_all,
    all_to_all_hp2sp,
    all_to_all_sp2hp,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_core.tensor_parallel.random import (
    CheckpointWithoutOutput,
    CudaRNGStatesTracker,
    checkpoint,
    convert_cuda_rng_state,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    is_graph_safe_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron_core.tensor_parallel.utils import (
    VocabUtility,
    gather_split_1d_tensor,
    pad_vocab_size,
    split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks,
)

__all__ = [
    # cross_entropy.py
    "VocabParallelCrossEntropy",
    "vocab_parallel_cross_entropy",
    # data.py
    "broadcast_data",
    # inference_layers.py
    "InferenceColumnParallelLinear",
    "InferenceLayerNormColumnParallelLinear",
    "InferenceRowParallelLinear",
    # layers.py
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_tensor_model_parallel_attributes",
    "linear_with_grad_accumulation_and_async_allreduce",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    # mappings.py
    "all_gather_last_dim_from_tensor_parallel_region",
    "all_to_all",
    "all_to_all_hp2sp",
    "all_to_all_sp2hp",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    # random.py
    "CheckpointWithoutOutput",
    "CudaRNGStatesTracker",
    "checkpoint",
    "convert_cuda_rng_state",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "is_graph_safe_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    # utils.py
    "VocabUtility",
    "gather_split_1d_tensor",
    "pad_vocab_size",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
]
