"""The coordinator's control-signal state machine (Megatron-Core's ``data_parallel_inference_coordinator.state``).

The coordinator accepts a control signal only in the states its :class:`ControlTransition` lists,
moves to the transition's new state and forwards the signal to every engine; a signal that is
redundant in the current state (PAUSE while paused) is dropped silently, any other out-of-order
signal is dropped with a warning. After forwarding STOP the coordinator is RUNNING again, ready
for engines that connect later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from megatron_core.inference.headers import Headers

__all__ = ["CONTROL_TRANSITIONS", "ControlTransition", "CoordinatorState"]


class CoordinatorState(Enum):
    """What the coordinator last told the engines."""

    RUNNING = auto()
    PAUSED = auto()
    SUSPENDED = auto()
    STOPPING = auto()


@dataclass(frozen=True)
class ControlTransition:
    """One control signal's rule: the states it applies in (``allowed_from``), the state it leads to
    (``new_state``; ``None`` keeps the state) and the states where it is a silent no-op (``idempotent_in``)."""

    allowed_from: frozenset
    new_state: CoordinatorState | None
    idempotent_in: frozenset = field(default_factory=frozenset)


_S = CoordinatorState

CONTROL_TRANSITIONS = {
    Headers.PAUSE: ControlTransition(frozenset({_S.RUNNING}), _S.PAUSED, frozenset({_S.PAUSED, _S.SUSPENDED})),
    Headers.UNPAUSE: ControlTransition(frozenset({_S.PAUSED}), _S.RUNNING),
    Headers.SUSPEND: ControlTransition(frozenset({_S.PAUSED}), _S.SUSPENDED),
    Headers.RESUME: ControlTransition(frozenset({_S.SUSPENDED}), _S.PAUSED),
    Headers.STOP: ControlTransition(frozenset({_S.PAUSED, _S.SUSPENDED}), _S.STOPPING),
    Headers.SET_GENERATION_EPOCH: ControlTransition(frozenset(_S), None),
}
"""Control header -> its :class:`ControlTransition`."""
