"""Megatron-Core's ``megatron.core.utils`` names, for users: a facade over the modules that own them.

Nothing inside ``megatron_core`` imports this module (``tests/tools/test_import_graph.py`` enforces
it): the primitives live on the ground floor, ``megatron_core._ground``; the other helpers in the
layer that owns them. ``deprecated`` and ``experimental_api`` implement ``docs/api_policy.md``.
"""

# ruff: noqa: F401
from megatron_core._batch_utils import get_batch_on_this_tp_rank as get_batch_on_this_tp_rank
from megatron_core._ground.api_lifecycle import ExperimentalNotEnabledError as ExperimentalNotEnabledError
from megatron_core._ground.api_lifecycle import F as F
from megatron_core._ground.api_lifecycle import deprecated as deprecated
from megatron_core._ground.api_lifecycle import experimental_api as experimental_api
from megatron_core._ground.api_lifecycle import experimental_cls as experimental_cls
from megatron_core._ground.api_lifecycle import experimental_fn as experimental_fn
from megatron_core._ground.api_lifecycle import internal_api as internal_api
from megatron_core._ground.arithmetic import divide as divide
from megatron_core._ground.arithmetic import ensure_divisibility as ensure_divisibility
from megatron_core._ground.async_utils import get_asyncio_loop as get_asyncio_loop
from megatron_core._ground.async_utils import trace_async_exceptions as trace_async_exceptions
from megatron_core._ground.decorators import deprecate_args as deprecate_args
from megatron_core._ground.decorators import deprecate_inference_params as deprecate_inference_params
from megatron_core._ground.decorators import null_decorator as null_decorator
from megatron_core._ground.groups import get_pg_rank as get_pg_rank
from megatron_core._ground.groups import get_pg_size as get_pg_size
from megatron_core._ground.groups import get_pg_src_rank as get_pg_src_rank
from megatron_core._ground.init_methods import init_method_normal as init_method_normal
from megatron_core._ground.init_methods import mup_scaled_init_method_normal as mup_scaled_init_method_normal
from megatron_core._ground.init_methods import scaled_init_method_normal as scaled_init_method_normal
from megatron_core._ground.wrappers import unwrap_model as unwrap_model
from megatron_core._misc_utils import GlobalMemoryBuffer as GlobalMemoryBuffer
from megatron_core._misc_utils import MakeViewlessTensor as MakeViewlessTensor
from megatron_core._misc_utils import WrappedTensor as WrappedTensor
from megatron_core._misc_utils import accepts_parameter as accepts_parameter
from megatron_core._misc_utils import assert_viewless_tensor as assert_viewless_tensor
from megatron_core._misc_utils import get_model_type as get_model_type
from megatron_core._misc_utils import get_model_xattn as get_model_xattn
from megatron_core._misc_utils import is_submodule as is_submodule
from megatron_core._misc_utils import is_using_quantization_scales as is_using_quantization_scales
from megatron_core._misc_utils import log_on_each_pipeline_stage as log_on_each_pipeline_stage
from megatron_core._misc_utils import make_viewless_tensor as make_viewless_tensor
from megatron_core._misc_utils import round_up_to_nearest_multiple as round_up_to_nearest_multiple
from megatron_core._misc_utils import safely_set_viewless_tensor_data as safely_set_viewless_tensor_data
from megatron_core._model_utils import (
    check_param_hashes_across_dp_replicas as check_param_hashes_across_dp_replicas,
)
from megatron_core._model_utils import (
    get_data_parallel_group_if_dtensor as get_data_parallel_group_if_dtensor,
)
from megatron_core._model_utils import get_full_tensor_if_necessary as get_full_tensor_if_necessary
from megatron_core._model_utils import local_multi_tensor_applier as local_multi_tensor_applier
from megatron_core._model_utils import local_multi_tensor_l2_norm as local_multi_tensor_l2_norm
from megatron_core._model_utils import local_multi_tensor_scale as local_multi_tensor_scale
from megatron_core._model_utils import to_local_if_dtensor as to_local_if_dtensor
from megatron_core._nvtx import configure_nvtx_profiling as configure_nvtx_profiling
from megatron_core._nvtx import nvtx_decorator as nvtx_decorator
from megatron_core._nvtx import nvtx_range_pop as nvtx_range_pop
from megatron_core._nvtx import nvtx_range_push as nvtx_range_push
from megatron_core._packed_batch import (
    flatten_batch_for_packed_sequences as flatten_batch_for_packed_sequences,
)
from megatron_core._rank_utils import log_single_rank as log_single_rank
from megatron_core._straggler import StragglerDetector as StragglerDetector
from megatron_core._version_utils import HAVE_PACKAGING as HAVE_PACKAGING
from megatron_core._version_utils import get_causal_conv1d_version as get_causal_conv1d_version
from megatron_core._version_utils import get_fa_version as get_fa_version
from megatron_core._version_utils import get_flashinfer_version as get_flashinfer_version
from megatron_core._version_utils import get_mamba_version as get_mamba_version
from megatron_core._version_utils import get_te_version as get_te_version
from megatron_core._version_utils import get_torch_version as get_torch_version
from megatron_core._version_utils import is_causal_conv1d_min_version as is_causal_conv1d_min_version
from megatron_core._version_utils import is_fa_min_version as is_fa_min_version
from megatron_core._version_utils import is_flashinfer_min_version as is_flashinfer_min_version
from megatron_core._version_utils import is_mamba_min_version as is_mamba_min_version
from megatron_core._version_utils import is_te_min_version as is_te_min_version
from megatron_core._version_utils import is_torch_min_version as is_torch_min_version
from megatron_core._wrapped_model import get_attr_wrapped_model as get_attr_wrapped_model
from megatron_core._wrapped_model import get_model_config as get_model_config
from megatron_core.dist_checkpointing.sharded_module import (
    make_sharded_tensor_for_checkpoint as make_sharded_tensor_for_checkpoint,
)
from megatron_core.dist_checkpointing.sharded_module import (
    make_tp_sharded_tensor_for_checkpoint as make_tp_sharded_tensor_for_checkpoint,
)
from megatron_core.process_groups_config import (
    get_tensor_model_parallel_group_if_none as get_tensor_model_parallel_group_if_none,
)
from megatron_core.tensor_parallel.deferred_wgrad import (
    drain_embedding_wgrad_compute as drain_embedding_wgrad_compute,
)
from megatron_core.tensor_parallel.deferred_wgrad import (
    prepare_input_tensors_for_wgrad_compute as prepare_input_tensors_for_wgrad_compute,
)
from megatron_core.transformer.context_parallel_batch import (
    get_batch_on_this_cp_rank as get_batch_on_this_cp_rank,
)
