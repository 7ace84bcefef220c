"""The global registry of process groups (Megatron-Core's ``parallel_state``).

``initialize_model_parallel`` splits the world into two grids that share their pipeline groups:
the dense grid (tp, cp, dp, pp) and the expert grid (etp, ep, edp, pp). Each rank then finds its
groups through the getters. Works on gloo (CPU) and NCCL (GPU); code that wants no globals can use
:class:`ProcessGroupCollection` instead.

The package is split by purpose; every public name is importable from here:
:mod:`.initialize` (create / destroy the groups), :mod:`.model_groups` (dense-grid getters),
:mod:`.expert_groups` (expert-grid getters), :mod:`.registry` (the groups by name),
:mod:`.rank_generator` (the rank grid), :mod:`.hybrid_cp` (hybrid DP x CP groups), :mod:`.optimizer_instances`
(the partial distributed optimizer's groups), :mod:`.memory_buffer` and :mod:`.extras`.
"""

from __future__ import annotations

from megatron_core.parallel_state.expert_groups import (
    get_expert_data_parallel_group as get_expert_data_parallel_group,
)
from megatron_core.parallel_state.expert_groups import (
    get_expert_data_parallel_group_gloo as get_expert_data_parallel_group_gloo,
)
from megatron_core.parallel_state.expert_groups import (
    get_expert_data_parallel_rank as get_expert_data_parallel_rank,
)
from megatron_core.parallel_state.expert_groups import (
    get_expert_data_parallel_world_size as get_expert_data_parallel_world_size,
)
from megatron_core.parallel_state.expert_groups import (
    get_expert_model_parallel_group as get_expert_model_parallel_group,
)
from megatron_core.parallel_state.expert_groups import (
    get_expert_model_parallel_rank as get_expert_model_parallel_rank,
)
from megatron_core.parallel_state.expert_groups import (
    get_expert_model_parallel_src_rank as get_expert_model_parallel_src_rank,
)
from megatron_core.parallel_state.expert_groups import (
    get_expert_model_parallel_world_size as get_expert_model_parallel_world_size,
)
from megatron_core.parallel_state.expert_groups import (
    get_expert_tensor_and_model_parallel_group as get_expert_tensor_and_model_parallel_group,
)
from megatron_core.parallel_state.expert_groups import (
    get_expert_tensor_and_model_parallel_rank as get_expert_tensor_and_model_parallel_rank,
)
from megatron_core.parallel_state.expert_groups import (
    get_expert_tensor_and_model_parallel_world_size as get_expert_tensor_and_model_parallel_world_size,
)
from megatron_core.parallel_state.expert_groups import (
    get_expert_tensor_model_pipeline_parallel_group as get_expert_tensor_model_pipeline_parallel_group,
)
from megatron_core.parallel_state.expert_groups import (
    get_expert_tensor_parallel_group as get_expert_tensor_parallel_group,
)
from megatron_core.parallel_state.expert_groups import (
    get_expert_tensor_parallel_rank as get_expert_tensor_parallel_rank,
)
from megatron_core.parallel_state.expert_groups import (
    get_expert_tensor_parallel_world_size as get_expert_tensor_parallel_world_size,
)
from megatron_core.parallel_state.expert_groups import (
    set_expert_model_parallel_rank as set_expert_model_parallel_rank,
)
from megatron_core.parallel_state.expert_groups import (
    set_expert_model_parallel_world_size as set_expert_model_parallel_world_size,
)
from megatron_core.parallel_state.expert_groups import (
    set_expert_tensor_parallel_rank as set_expert_tensor_parallel_rank,
)
from megatron_core.parallel_state.expert_groups import (
    set_expert_tensor_parallel_world_size as set_expert_tensor_parallel_world_size,
)
from megatron_core.parallel_state.extras import create_all_gather_groups as create_all_gather_groups
from megatron_core.parallel_state.extras import create_group as create_group
from megatron_core.parallel_state.extras import destroy_global_memory_buffer as destroy_global_memory_buffer
from megatron_core.parallel_state.extras import get_nccl_options as get_nccl_options
from megatron_core.parallel_state.extras import overwrite_nccl_comm_cfgs as overwrite_nccl_comm_cfgs
from megatron_core.parallel_state.extras import update_pg_timeout as update_pg_timeout
from megatron_core.parallel_state.hybrid_cp import create_hybrid_dp_cp_groups as create_hybrid_dp_cp_groups
from megatron_core.parallel_state.hybrid_cp import (
    get_hybrid_data_context_parallel_groups as get_hybrid_data_context_parallel_groups,
)
from megatron_core.parallel_state.initialize import default_embedding_ranks as default_embedding_ranks
from megatron_core.parallel_state.initialize import (
    default_position_embedding_ranks as default_position_embedding_ranks,
)
from megatron_core.parallel_state.initialize import destroy_model_parallel as destroy_model_parallel
from megatron_core.parallel_state.initialize import (
    get_hierarchical_context_parallel_groups as get_hierarchical_context_parallel_groups,
)
from megatron_core.parallel_state.initialize import initialize_model_parallel as initialize_model_parallel
from megatron_core.parallel_state.initialize import set_embedding_ranks as set_embedding_ranks
from megatron_core.parallel_state.memory_buffer import GlobalMemoryBuffer as GlobalMemoryBuffer
from megatron_core.parallel_state.model_groups import get_amax_reduction_group as get_amax_reduction_group
from megatron_core.parallel_state.model_groups import (
    get_context_parallel_global_ranks as get_context_parallel_global_ranks,
)
from megatron_core.parallel_state.model_groups import get_context_parallel_group as get_context_parallel_group
from megatron_core.parallel_state.model_groups import get_context_parallel_rank as get_context_parallel_rank
from megatron_core.parallel_state.model_groups import (
    get_context_parallel_world_size as get_context_parallel_world_size,
)
from megatron_core.parallel_state.model_groups import get_data_parallel_group as get_data_parallel_group
from megatron_core.parallel_state.model_groups import (
    get_data_parallel_group_gloo as get_data_parallel_group_gloo,
)
from megatron_core.parallel_state.model_groups import get_data_parallel_rank as get_data_parallel_rank
from megatron_core.parallel_state.model_groups import get_data_parallel_src_rank as get_data_parallel_src_rank
from megatron_core.parallel_state.model_groups import (
    get_data_parallel_world_size as get_data_parallel_world_size,
)
from megatron_core.parallel_state.model_groups import get_embedding_group as get_embedding_group
from megatron_core.parallel_state.model_groups import get_model_parallel_group as get_model_parallel_group
from megatron_core.parallel_state.model_groups import (
    get_model_parallel_src_rank as get_model_parallel_src_rank,
)
from megatron_core.parallel_state.model_groups import (
    get_pipeline_model_parallel_first_rank as get_pipeline_model_parallel_first_rank,
)
from megatron_core.parallel_state.model_groups import (
    get_pipeline_model_parallel_group as get_pipeline_model_parallel_group,
)
from megatron_core.parallel_state.model_groups import (
    get_pipeline_model_parallel_last_rank as get_pipeline_model_parallel_last_rank,
)
from megatron_core.parallel_state.model_groups import (
    get_pipeline_model_parallel_next_rank as get_pipeline_model_parallel_next_rank,
)
from megatron_core.parallel_state.model_groups import (
    get_pipeline_model_parallel_prev_rank as get_pipeline_model_parallel_prev_rank,
)
from megatron_core.parallel_state.model_groups import (
    get_pipeline_model_parallel_rank as get_pipeline_model_parallel_rank,
)
from megatron_core.parallel_state.model_groups import (
    get_pipeline_model_parallel_world_size as get_pipeline_model_parallel_world_size,
)
from megatron_core.parallel_state.model_groups import (
    get_position_embedding_group as get_position_embedding_group,
)
from megatron_core.parallel_state.model_groups import (
    get_tensor_and_context_parallel_group as get_tensor_and_context_parallel_group,
)
from megatron_core.parallel_state.model_groups import (
    get_tensor_and_context_parallel_rank as get_tensor_and_context_parallel_rank,
)
from megatron_core.parallel_state.model_groups import (
    get_tensor_and_context_parallel_world_size as get_tensor_and_context_parallel_world_size,
)
from megatron_core.parallel_state.model_groups import (
    get_tensor_and_data_parallel_group as get_tensor_and_data_parallel_group,
)
from megatron_core.parallel_state.model_groups import (
    get_tensor_and_data_parallel_world_size as get_tensor_and_data_parallel_world_size,
)
from megatron_core.parallel_state.model_groups import (
    get_tensor_model_parallel_group as get_tensor_model_parallel_group,
)
from megatron_core.parallel_state.model_groups import (
    get_tensor_model_parallel_rank as get_tensor_model_parallel_rank,
)
from megatron_core.parallel_state.model_groups import (
    get_tensor_model_parallel_src_rank as get_tensor_model_parallel_src_rank,
)
from megatron_core.parallel_state.model_groups import (
    get_tensor_model_parallel_world_size as get_tensor_model_parallel_world_size,
)
from megatron_core.parallel_state.model_groups import (
    get_virtual_pipeline_model_parallel_rank as get_virtual_pipeline_model_parallel_rank,
)
from megatron_core.parallel_state.model_groups import (
    get_virtual_pipeline_model_parallel_world_size as get_virtual_pipeline_model_parallel_world_size,
)
from megatron_core.parallel_state.model_groups import is_pipeline_first_stage as is_pipeline_first_stage
from megatron_core.parallel_state.model_groups import is_pipeline_last_stage as is_pipeline_last_stage
from megatron_core.parallel_state.model_groups import is_rank_in_embedding_group as is_rank_in_embedding_group
from megatron_core.parallel_state.model_groups import (
    is_rank_in_position_embedding_group as is_rank_in_position_embedding_group,
)
from megatron_core.parallel_state.model_groups import set_data_parallel_rank as set_data_parallel_rank
from megatron_core.parallel_state.model_groups import (
    set_pipeline_model_parallel_rank as set_pipeline_model_parallel_rank,
)
from megatron_core.parallel_state.model_groups import (
    set_pipeline_model_parallel_world_size as set_pipeline_model_parallel_world_size,
)
from megatron_core.parallel_state.model_groups import (
    set_tensor_model_parallel_rank as set_tensor_model_parallel_rank,
)
from megatron_core.parallel_state.model_groups import (
    set_tensor_model_parallel_world_size as set_tensor_model_parallel_world_size,
)
from megatron_core.parallel_state.model_groups import (
    set_virtual_pipeline_model_parallel_rank as set_virtual_pipeline_model_parallel_rank,
)
from megatron_core.parallel_state.model_groups import (
    set_virtual_pipeline_model_parallel_world_size as set_virtual_pipeline_model_parallel_world_size,
)
from megatron_core.parallel_state.optimizer_instances import (
    create_hierarchical_groups as create_hierarchical_groups,
)
from megatron_core.parallel_state.optimizer_instances import (
    get_inter_distributed_optimizer_instance_group as get_inter_distributed_optimizer_instance_group,
)
from megatron_core.parallel_state.optimizer_instances import (
    get_intra_distributed_optimizer_instance_group as get_intra_distributed_optimizer_instance_group,
)
from megatron_core.parallel_state.rank_generator import ParallelConfigError as ParallelConfigError
from megatron_core.parallel_state.rank_generator import RankGenerator as RankGenerator
from megatron_core.parallel_state.rank_generator import (
    generate_masked_orthogonal_rank_groups as generate_masked_orthogonal_rank_groups,
)
from megatron_core.parallel_state.rank_summary import get_all_ranks as get_all_ranks
from megatron_core.parallel_state.registry import get_all_group_ranks as get_all_group_ranks
from megatron_core.parallel_state.registry import get_global_memory_buffer as get_global_memory_buffer
from megatron_core.parallel_state.registry import get_group_ranks as get_group_ranks
from megatron_core.parallel_state.registry import is_initialized as is_initialized
from megatron_core.parallel_state.registry import is_unitialized as is_unitialized
from megatron_core.parallel_state.registry import (
    model_parallel_is_initialized as model_parallel_is_initialized,
)
