"""The ground floor: primitives every layer of ``megatron_core`` may import.

Nothing here imports a module of ``megatron_core`` above this floor (``tools/import_graph.py``
checks it). ``megatron_core.utils`` re-exports these names at Megatron-Core's paths for users;
code inside the package imports them from here.
"""

from megatron_core._ground.api_lifecycle import ExperimentalNotEnabledError, deprecated, experimental_api
from megatron_core._ground.arithmetic import divide, ensure_divisibility
from megatron_core._ground.groups import get_pg_rank, get_pg_size, get_pg_src_rank
from megatron_core._ground.init_methods import (
    init_method_normal,
    mup_scaled_init_method_normal,
    scaled_init_method_normal,
)
from megatron_core._ground.wrappers import (
    fsdp_unit_types,
    module_chain,
    register_fsdp_unit,
    register_wrapper,
    unwrap_model,
    wrapper_depth,
)

__all__ = [
    "ExperimentalNotEnabledError", "deprecated", "divide", "ensure_divisibility", "experimental_api", "get_pg_rank",
    "fsdp_unit_types", "get_pg_size", "get_pg_src_rank", "init_method_normal", "module_chain",
    "mup_scaled_init_method_normal", "register_fsdp_unit", "register_wrapper", "scaled_init_method_normal",
    "unwrap_model", "wrapper_depth",
]
