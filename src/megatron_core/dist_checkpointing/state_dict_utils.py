"""The steps ``save`` and ``load`` take on a sharded state dict before touching storage (Megatron-Core
``dist_checkpointing.state_dict_utils``).

:func:`save_preprocess` builds factories in place, drops non-persistent entries, splits the sharded
part from the common state and (optionally) validates both across ranks. :func:`load_preprocess`
works on a copy of the containers, so the caller's dict keeps its factories; its non-persistent part
keeps list positions as ``{index: value}`` dicts (undone by ``dict_utils.lists_like``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from megatron_core.dist_checkpointing.dict_utils import (
    dict_list_map_inplace,
    extract_matching_values,
    nested_values,
    without_matching,
)
from megatron_core.dist_checkpointing.mapping import (
    CommonStateDict,
    LocalNonpersistentObject,
    ShardedBase,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
)
from megatron_core.dist_checkpointing.utils import extract_sharded_base
from megatron_core.dist_checkpointing.validation import (
    validate_common_state_consistency,
    validate_sharding_integrity,
)


def save_preprocess(
    sharded_state_dict: ShardedStateDict,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Callable[[CommonStateDict], StateDict] | None = None,
    *,
    process_group: Any = None,
) -> tuple[ShardedStateDict, StateDict]:
    """``(sharded part, common state)`` of ``sharded_state_dict``, factories applied in place.

    ``LocalNonpersistentObject`` entries are dropped. With ``validate_access_integrity`` (collective
    over ``process_group``, not in Megatron-Core's signature) the shards of all ranks must tile every
    key exactly once (``CheckpointingException`` otherwise) and a common state differing between ranks
    is logged; ``preprocess_common_before_consistancy_check`` maps the common state before that check.
    """
    apply_factories(sharded_state_dict)
    sharded_part, _ = extract_sharded_base(sharded_state_dict)
    sharded_part = filter_out_empty_flatten_tensor(sharded_part)
    common_state_dict = without_matching(sharded_state_dict,
                                         lambda x: isinstance(x, (ShardedBase, LocalNonpersistentObject)))
    if validate_access_integrity:
        validate_sharding_integrity([x for x in nested_values(sharded_part) if isinstance(x, ShardedBase)],
                                    process_group)
        checked = common_state_dict
        if preprocess_common_before_consistancy_check is not None:
            checked = preprocess_common_before_consistancy_check(common_state_dict)
        validate_common_state_consistency(checked, process_group)
    return sharded_part, common_state_dict


def load_preprocess(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict, ShardedStateDict]:
    """``(sharded state dict with factories built, non-persistent objects unwrapped, the factories)``.

    ``sharded_state_dict`` itself is not changed (its containers are copied). The factories keep their
    positions (lists as ``{index: factory}``) and drop their data, ready for ``apply_factory_merges``.
    """
    sharded_state_dict, _ = extract_matching_values(sharded_state_dict, lambda x: True)
    sharded_state_dict = filter_out_empty_flatten_tensor(sharded_state_dict)
    sh_ten_factories, _ = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sharded_state_dict)
    dict_list_map_inplace(lambda f: dataclasses.replace(f, data=None), sh_ten_factories)
    nonpersistent_state_dict, sharded_state_dict = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, LocalNonpersistentObject), return_lists_as_dicts=True
    )
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent_state_dict)
    return sharded_state_dict, nonpersistent_state_dict, sh_ten_factories


def filter_out_empty_flatten_tensor(sharded_state_dict: dict | list) -> dict | list:
    """``sharded_state_dict`` without the ``ShardedTensor``s whose ``flattened_range`` is empty.

    Such shards (a rank holding none of a flattened parameter, as custom FSDP layouts produce) would
    make the checkpoint planner reject the tensor.
    """
    kept, _ = extract_matching_values(
        sharded_state_dict,
        lambda v: not (isinstance(v, ShardedTensor) and v.flattened_range is not None
                       and v.flattened_range.start == v.flattened_range.stop),
    )
    return kept
