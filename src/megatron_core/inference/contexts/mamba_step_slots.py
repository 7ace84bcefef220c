"""The Mamba side of a dynamic-context step: which state slot each fed row reads and writes.

Part of :class:`~.dynamic_context.DynamicInferenceContext` for hybrid models (Megatron-Core's
``attention_context/mamba_metadata.py`` holds the same per-step indices). The slots themselves live in
:class:`~.mamba_states.MambaStateSlots`; each step this records the slot of every decode row (``[num_decode]``)
and, per prefill chunk, ``(first row, rows, slot)``, which the Mamba mixers read through
:meth:`MambaStepSlots.mamba_step_layout`. In a padded CUDA-graph decode step the decode slots are a tensor at a
fixed address per graph batch size whose padding rows name the scratch slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_core.inference.contexts.mamba_states import MambaStateSlots
from megatron_core.inference.contexts.step_entry import StepEntry

__all__ = ["MambaStepSlots"]


class MambaStepSlots:
    """Mamba states and per-step slot indices of the dynamic context (a mixin: the context sets ``mamba_slots``)."""

    mamba_slots: MambaStateSlots | None
    device: torch.device | None
    _mamba_decode_slots: torch.Tensor
    _mamba_prefill: list[tuple[int, int, int]]

    def mamba_states_cache(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv states, ssm states)`` of Mamba layer ``layer_number``, one row per slot (see :mod:`.mamba_states`)."""
        if self.mamba_slots is None:
            raise ValueError("a Mamba layer ran under a DynamicInferenceContext built without "
                             "InferenceConfig.mamba_inference_state_config; set it from "
                             "MambaInferenceStateConfig.from_model(model) to serve a hybrid model")
        return self.mamba_slots.states(layer_number, self.device or torch.device("cpu"))

    def snapshot_decode_states(self) -> Callable[[], None] | None:
        """Save the Mamba states of this decode step's slots; returns the function that restores them (None for
        a model without Mamba layers). The CUDA-graph warm-up runs a step more than once: see ``DecodeGraphRunner``."""
        if self.mamba_slots is None:
            return None
        return self.mamba_slots.snapshot(self._mamba_decode_slots)

    def mamba_step_layout(self) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The Mamba slots of the step: the decode rows' slots ``[num_decode]`` and, per prefill chunk,
        ``(first row, rows, slot)``."""
        return self._mamba_decode_slots, self._mamba_prefill

    def _lay_out_mamba_step(self, decode: list[StepEntry], prefill: list[StepEntry],
                            prefill_rows: list[tuple[int, int]], device: torch.device) -> None:
        """Slots of an eager step: ``prefill_rows`` is ``(first row, rows)`` of each ``prefill`` entry."""
        if self.mamba_slots is None:
            return
        slot = self.mamba_slots.slot
        self._mamba_decode_slots = torch.tensor([slot(e.request_id) for e in decode], dtype=torch.long, device=device)
        self._mamba_prefill = [(first, n, slot(e.request_id)) for (first, n), e in zip(prefill_rows, prefill)]

    def _lay_out_mamba_graph_step(self, batch: int, request_ids: list[Any], device: torch.device) -> None:
        """Slots of a decode-only step padded to the graph batch size ``batch``."""
        if self.mamba_slots is None:
            return
        self._mamba_decode_slots = self.mamba_slots.graph_slots(batch, request_ids, device)
        self._mamba_prefill = []
