"""An explicit bundle of process groups (Megatron-Core's ``ProcessGroupCollection``).

Code that wants no globals builds one by hand (``pgs = ProcessGroupCollection(); pgs.tp = ...``)
or fills it from ``parallel_state`` with :meth:`ProcessGroupCollection.use_mpu_process_groups`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from megatron_core import parallel_state

_GROUP_GETTERS = {
    "tp": lambda: parallel_state.get_tensor_model_parallel_group(),
    "pp": lambda: parallel_state.get_pipeline_model_parallel_group(),
    "mp": lambda: parallel_state.get_model_parallel_group(),
    "embd": lambda: parallel_state.get_embedding_group(check_initialized=False),
    "pos_embd": lambda: parallel_state.get_position_embedding_group(check_initialized=False),
    "cp": lambda: parallel_state.get_context_parallel_group(),
    "tp_cp": lambda: parallel_state.get_tensor_and_context_parallel_group(),
    "ep": lambda: parallel_state.get_expert_model_parallel_group(),
    "expt_tp": lambda: parallel_state.get_expert_tensor_parallel_group(),
    "tp_ep": lambda: parallel_state.get_expert_tensor_and_model_parallel_group(),
    "tp_ep_pp": lambda: parallel_state.get_expert_tensor_model_pipeline_parallel_group(),
    "tp_dp_cp": lambda: parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True),
    "dp": lambda: parallel_state.get_data_parallel_group(),
    "dp_cp": lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
    "expt_dp": lambda: parallel_state.get_expert_data_parallel_group(),
}


def _group_field() -> Any:
    return field(init=False, default=None)


@dataclass
class ProcessGroupCollection:
    """Process groups by role; every field is set after construction. Unset roles are ``None``."""

    tp: Any = _group_field()
    pp: Any = _group_field()
    mp: Any = _group_field()
    embd: Any = _group_field()
    pos_embd: Any = _group_field()
    cp: Any = _group_field()
    tp_cp: Any = _group_field()
    ep: Any = _group_field()
    expt_tp: Any = _group_field()
    tp_ep: Any = _group_field()
    tp_ep_pp: Any = _group_field()
    tp_dp_cp: Any = _group_field()
    dp: Any = _group_field()
    dp_cp: Any = _group_field()
    expt_dp: Any = _group_field()

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: list[str] | None = None) -> ProcessGroupCollection:
        """A collection filled from ``parallel_state``; ``required_pgs`` limits which roles are read."""
        names = [f.name for f in fields(cls)]
        wanted = names if required_pgs is None else list(required_pgs)
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise ValueError(f"unknown process group names {unknown}; known: {names}")
        pgs = cls()
        for name in wanted:
            setattr(pgs, name, _GROUP_GETTERS[name]())
        return pgs
