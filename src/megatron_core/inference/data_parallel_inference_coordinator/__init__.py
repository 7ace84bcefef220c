"""Megatron-Core's data-parallel inference coordinator (``inference.data_parallel_inference_coordinator``).

:class:`DataParallelInferenceCoordinator` (coordinator.py) routes requests from
:class:`~megatron_core.inference.inference_client.InferenceClient` objects to the engines of each
data-parallel replica; its message handlers are in handlers.py, its control-signal state machine in
state.py and its engine choice in routing.py. Needs the ``coordinator`` extra (pyzmq, msgpack) when
used, not when imported.
"""

from .coordinator import DataParallelInferenceCoordinator
from .handlers import HANDLERS, message_handler
from .state import CONTROL_TRANSITIONS, ControlTransition, CoordinatorState

__all__ = ["CONTROL_TRANSITIONS", "HANDLERS", "ControlTransition", "CoordinatorState",
           "DataParallelInferenceCoordinator", "message_handler"]
