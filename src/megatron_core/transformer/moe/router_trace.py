"""Trace the expert choices of every MoE router to disk (Megatron-Core's ``router_trace``).

A :class:`RouterTracer` puts a forward hook on each :class:`TopKRouter` of the model. Each router
call becomes one JSON line in ``<output_dir>/router_trace_rank{rank}.jsonl``::

    {"step": 4, "stage": "pre_dispatch", "block": "decoder", "layer": 1, "rank": 0,
     "num_tokens": 64, "topk": 2, "top_indices": [[0, 3], [1, 2], ...]}

``top_indices`` has one row per token (flattened ``[s * b]`` in the router's order) holding the
experts it was sent to in ascending id order. Every row has ``topk`` entries; a route the router
dropped for capacity is written as ``-1`` (after the kept experts), and the zero-probability
padding routes of ``moe_pad_expert_input_to_capacity`` are left out. ``layer`` is the index in the
module name (``decoder.layers.<layer>.mlp.router``, so stage-local under pipeline parallelism);
routers of an MTP block (``mtp.layers.<i>....``) get ``"block": "mtp"`` and an ``mtp_idx`` field.

Optional sidecars, raw little-endian bfloat16 appended per record:

- ``hidden_states_rank{rank}.bin``: the router's input ``[num_tokens, hidden]``; the record gains
  ``hs_offset``, ``hs_bytes`` and ``hs_shape``.
- ``logits_rank{rank}.bin``: the router's gating logits ``[num_tokens, num_experts]`` recomputed
  from that input (before input jitter, random-logit overrides and the expert bias); the record
  gains ``logit_offset``, ``logit_bytes`` and ``logit_shape``.

With ``dump_router_weights`` the gating weight, expert bias, score function and top-k of each layer,
as first seen, go to ``router_state_rank{rank}.pt`` (a dict keyed by ``(block, mtp_idx, layer)``).

Steps: in training mode the loop calls :meth:`RouterTracer.advance_step` once per iteration (router
calls of a router in eval mode, i.e. validation, are not recorded); otherwise a layer firing a
second time starts a new step. Hooks do not run inside CUDA graph capture or replay.
"""

from __future__ import annotations

import atexit
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from megatron_core._ground import unwrap_model
from megatron_core.transformer.moe.router import TopKRouter

__all__ = [
    "RouterTracer",
    "get_moe_router_tracer",
    "init_moe_router_tracer",
    "load_hidden_states_for_record",
    "load_logits_for_record",
]

LayerKey = tuple[str, Optional[int], int]  # (block, mtp_idx, layer)

_MOE_ROUTER_TRACER: RouterTracer | None = None

# Router names: "decoder.layers.<n>.", "mtp.layers.<head>.mtp_model_layer.layers.<n>." (a stack per
# head) or "mtp.layers.<head>." (one layer per head). The stacked form is tried first.
_NAME_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"mtp\.layers\.(\d+)\.mtp_model_layer\.layers\.(\d+)\."), "mtp-stack"),
    (re.compile(r"mtp\.layers\.(\d+)\."), "mtp"),
    (re.compile(r"decoder\.layers\.(\d+)\."), "decoder"),
)


def _layer_key_from_name(name: str) -> LayerKey | None:
    """``(block, mtp_idx, layer)`` of the router called ``name``, or None when the name has no layer in it."""
    for pattern, kind in _NAME_PATTERNS:
        found = pattern.search(name)
        if found is None:
            continue
        if kind == "mtp-stack":
            return "mtp", int(found.group(1)), int(found.group(2))
        if kind == "mtp":
            return "mtp", int(found.group(1)), 0
        return "decoder", None, int(found.group(1))
    return None


def init_moe_router_tracer(
    output_dir: str,
    max_steps: int,
    rank: int,
    training_mode: bool = False,
    capture_hidden_states: bool = False,
    capture_logits: bool = False,
    dump_router_weights: bool = False,
) -> None:
    """Create the process-wide tracer (a no-op when one exists); then call its ``register_hooks(model)``.

    ``max_steps`` bounds the traced steps (training iterations with ``training_mode``, else detected
    forward passes). The tracer is flushed at interpreter exit.
    """
    global _MOE_ROUTER_TRACER
    if _MOE_ROUTER_TRACER is not None:
        return
    tracer = RouterTracer(output_dir, max_steps, rank, training_mode=training_mode,
                          capture_hidden_states=capture_hidden_states, capture_logits=capture_logits,
                          dump_router_weights=dump_router_weights)
    _MOE_ROUTER_TRACER = tracer
    atexit.register(tracer.flush)


def get_moe_router_tracer() -> RouterTracer | None:
    """The tracer made by :func:`init_moe_router_tracer`, or None when tracing is off."""
    return _MOE_ROUTER_TRACER


def _read_bf16(path: str, offset: int, size: int, shape: Sequence[int]) -> torch.Tensor:
    with open(path, "rb") as handle:
        handle.seek(offset)
        payload = handle.read(size)
    if len(payload) != size:
        raise ValueError(f"{path}: expected {size} bytes at offset {offset}, found {len(payload)}")
    return torch.frombuffer(bytearray(payload), dtype=torch.int16).view(torch.bfloat16).reshape(list(shape))


def load_hidden_states_for_record(record: dict, trace_dir: str) -> torch.Tensor:
    """The router input ``[num_tokens, hidden]`` (bfloat16) of one parsed JSONL ``record`` from ``trace_dir``."""
    if "hs_offset" not in record:
        raise ValueError("this record has no hidden-state sidecar entry (hs_offset)")
    path = os.path.join(trace_dir, f"hidden_states_rank{record['rank']}.bin")
    return _read_bf16(path, record["hs_offset"], record["hs_bytes"], record["hs_shape"])


def load_logits_for_record(record: dict, trace_dir: str) -> torch.Tensor:
    """The gating logits ``[num_tokens, num_experts]`` (bfloat16) of one parsed JSONL ``record`` from ``trace_dir``."""
    if "logit_offset" not in record:
        raise ValueError("this record has no logits sidecar entry (logit_offset)")
    path = os.path.join(trace_dir, f"logits_rank{record['rank']}.bin")
    return _read_bf16(path, record["logit_offset"], record["logit_bytes"], record["logit_shape"])


def _routed_experts(probs: Any, routing_map: torch.Tensor, topk: int, drop_padding: bool) -> torch.Tensor:
    """``[tokens, topk]`` expert ids per token, ascending, ``-1`` for routes dropped by capacity.

    ``drop_padding`` leaves out zero-probability routes (the padding of ``pad_to_capacity``). Should a
    token still have more than ``topk`` routes, its ``topk`` most probable are kept. No host sync.
    """
    mask = routing_map
    has_probs = torch.is_tensor(probs) and probs.shape == routing_map.shape
    if drop_padding and has_probs:
        mask = mask & (probs != 0)
    num_experts = mask.shape[-1]
    weight = probs.detach().float() if has_probs else torch.ones(mask.shape, device=mask.device)
    score = torch.where(mask, weight, torch.full_like(weight, float("-inf")))
    chosen = score.topk(min(topk, num_experts), dim=-1).indices
    chosen = torch.where(mask.gather(-1, chosen), chosen, torch.full_like(chosen, num_experts))
    chosen = chosen.sort(dim=-1).values
    chosen = torch.where(chosen == num_experts, torch.full_like(chosen, -1), chosen)
    if chosen.shape[-1] < topk:  # more top-k than experts: pad the rows to ``topk``
        chosen = torch.nn.functional.pad(chosen, (0, topk - chosen.shape[-1]), value=-1)
    return chosen


def _flat_router_input(inputs: tuple, num_tokens: int) -> torch.Tensor | None:
    """The router's input as ``[num_tokens, hidden]``, or None when it is not a 2-D/3-D tensor of that many tokens."""
    if not inputs or not torch.is_tensor(inputs[0]) or inputs[0].dim() not in (2, 3):
        return None
    hidden = inputs[0].reshape(-1, inputs[0].shape[-1])
    return hidden if hidden.shape[0] == num_tokens else None


class _Sidecar:
    """An append-only bfloat16 sidecar file, truncated when created, opened on first write."""

    def __init__(self, path: str) -> None:
        self.path, self.offset, self._handle = path, 0, None
        open(path, "wb").close()

    def append(self, tensor: torch.Tensor) -> dict:
        payload = tensor.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
        if self._handle is None:
            self._handle = open(self.path, "ab")
        self._handle.write(payload)
        entry = {"offset": self.offset, "bytes": len(payload), "shape": list(tensor.shape)}
        self.offset += len(payload)
        return entry

    def flush(self) -> None:
        if self._handle is not None:
            self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class RouterTracer:
    """Records each router call's top-k expert ids (and optional sidecars) per step; see the module docstring.

    Records are buffered and written when a step ends (:meth:`advance_step`, or a repeated layer
    outside training mode) and by :meth:`flush`. After ``max_steps`` steps nothing more is recorded;
    in training mode the hooks are removed as well.
    """

    def __init__(
        self,
        output_dir: str,
        max_steps: int,
        rank: int,
        training_mode: bool = False,
        capture_hidden_states: bool = False,
        capture_logits: bool = False,
        dump_router_weights: bool = False,
    ) -> None:
        self.output_dir, self.max_steps, self.rank = output_dir, max_steps, rank
        self.training_mode = training_mode
        self.capture_hidden_states, self.capture_logits = capture_hidden_states, capture_logits
        self.dump_router_weights = dump_router_weights
        self.step_id = 0
        self.layers_seen_this_step: set[LayerKey] = set()
        self.records: list[dict] = []
        self._captured_steps = 0
        self._stopped = False
        self._router_state: dict[LayerKey, dict] = {}
        self._hook_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._last_copy: Any = None  # CUDA event after the latest device-to-host copy of indices

        os.makedirs(output_dir, exist_ok=True)
        self.output_path = os.path.join(output_dir, f"router_trace_rank{rank}.jsonl")
        open(self.output_path, "w").close()
        self.hs_path = os.path.join(output_dir, f"hidden_states_rank{rank}.bin")
        self.logits_path = os.path.join(output_dir, f"logits_rank{rank}.bin")
        self._hidden_file = _Sidecar(self.hs_path) if capture_hidden_states else None
        self._logits_file = _Sidecar(self.logits_path) if capture_logits else None

    # --- hooks ---------------------------------------------------------------------------------------------
    def register_hooks(self, model: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
        """Hook every :class:`TopKRouter` in ``model`` (a module or a list of model chunks, wrapped or not)."""
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        for chunk in chunks:
            for name, module in unwrap_model(chunk).named_modules():
                if isinstance(module, TopKRouter):
                    self._hook_handles.append(module.register_forward_hook(self.make_hook(name)))

    def remove_hooks(self) -> None:
        """Remove the hooks added by :meth:`register_hooks`."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def make_hook(self, module_name: str = "") -> Callable[[torch.nn.Module, tuple, Any], None]:
        """A forward hook for the router called ``module_name`` (its layer is parsed from the name once)."""
        layer_key = _layer_key_from_name(module_name)

        def hook(module: torch.nn.Module, inputs: tuple, outputs: Any) -> None:
            if self._stopped or (self.training_mode and not module.training):
                return
            if not isinstance(outputs, tuple) or len(outputs) != 2 or not torch.is_tensor(outputs[1]):
                return
            if outputs[1].is_cuda and torch.cuda.is_current_stream_capturing():
                return
            self._record(module, inputs, outputs, layer_key)

        return hook

    # --- steps ---------------------------------------------------------------------------------------------
    def advance_step(self, step_id: int | None = None) -> None:
        """End the current step (training mode): stamp its records with ``step_id`` if given, write them out.

        Without ``step_id`` the tracer's own counter numbers the step. After ``max_steps`` calls the
        tracer stops and removes its hooks.
        """
        if step_id is not None:
            for record in self.records:
                record["step"] = step_id
            self.step_id = step_id
        self._flush_records_to_disk()
        self.step_id += 1
        self._captured_steps += 1
        self.layers_seen_this_step.clear()
        if self._captured_steps >= self.max_steps:
            self._stopped = True
            self.remove_hooks()

    def _new_step_if_repeated(self, layer_key: LayerKey) -> bool:
        """Outside training mode a layer seen twice starts a step; False once ``max_steps`` steps are done."""
        if layer_key in self.layers_seen_this_step:
            self._flush_records_to_disk()
            self.step_id += 1
            self.layers_seen_this_step.clear()
            if self.step_id >= self.max_steps:
                self._stopped = True
                return False
        self.layers_seen_this_step.add(layer_key)
        return True

    # --- recording -----------------------------------------------------------------------------------------
    def _to_host(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A host copy of ``tensor`` as ``dtype``; from a GPU it is asynchronous until the next flush."""
        tensor = tensor.detach()
        if tensor.is_cuda:
            copy = tensor.to("cpu", dtype, non_blocking=True)
            self._last_copy = torch.cuda.Event()
            self._last_copy.record()
            return copy
        return tensor.to("cpu", dtype, copy=True)

    def _make_record(self, indices: torch.Tensor, step: int, layer_key: LayerKey) -> dict:
        block, mtp_idx, layer = layer_key
        record: dict = {"step": int(step), "stage": "pre_dispatch", "block": block, "layer": int(layer),
                        "rank": self.rank, "num_tokens": int(indices.shape[0]), "topk": int(indices.shape[1])}
        if mtp_idx is not None:
            record["mtp_idx"] = int(mtp_idx)
        record["_indices"] = indices  # replaced by "top_indices" when written
        return record

    def _remember_router_state(self, module: torch.nn.Module, layer_key: LayerKey) -> None:
        weight, bias = getattr(module, "weight", None), getattr(module, "expert_bias", None)
        if layer_key in self._router_state or not torch.is_tensor(weight):
            return
        self._router_state[layer_key] = {
            "weight": weight.detach().to("cpu", torch.float32).clone(),
            "expert_bias": bias.detach().to("cpu", torch.float32).clone() if torch.is_tensor(bias) else None,
            "score_function": getattr(getattr(module, "config", None), "moe_router_score_function", None),
            "topk": getattr(module, "topk", None),
        }

    def _record(self, module: torch.nn.Module, inputs: tuple, outputs: tuple, layer_key: LayerKey | None) -> None:
        if layer_key is None:  # a router outside the usual names: its 1-based layer number, as Megatron does
            layer_number = getattr(module, "layer_number", None)
            if layer_number is None:
                return
            layer_key = ("decoder", None, int(layer_number))
        probs, routing = outputs
        if routing.dtype == torch.bool:
            topk = getattr(module, "topk", None)
            if topk is None or routing.dim() != 2:
                return
            config = getattr(module, "config", None)
            padded = bool(getattr(config, "moe_pad_expert_input_to_capacity", False)
                          and getattr(config, "moe_expert_capacity_factor", None) is not None)
            indices = _routed_experts(probs, routing, int(topk), padded)
        else:
            indices = routing
        if indices.dim() != 2:
            return
        if not self.training_mode and not self._new_step_if_repeated(layer_key):
            return
        if self.dump_router_weights:
            self._remember_router_state(module, layer_key)

        record = self._make_record(self._to_host(indices, torch.int32), self.step_id, layer_key)
        hidden = _flat_router_input(inputs, record["num_tokens"])
        if self._hidden_file is not None and hidden is not None:
            entry = self._hidden_file.append(hidden)
            record.update(hs_offset=entry["offset"], hs_bytes=entry["bytes"], hs_shape=entry["shape"])
        gating = getattr(module, "gating", None)
        if self._logits_file is not None and hidden is not None and callable(gating):
            with torch.no_grad():
                logits = gating(hidden)
            if isinstance(logits, tuple):
                logits = logits[0]
            if torch.is_tensor(logits) and logits.shape[0] == record["num_tokens"]:
                entry = self._logits_file.append(logits.reshape(record["num_tokens"], -1))
                record.update(logit_offset=entry["offset"], logit_bytes=entry["bytes"], logit_shape=entry["shape"])
        self.records.append(record)

    def record_indices(
        self,
        indices: torch.Tensor | Sequence[torch.Tensor],
        step: int | None = None,
        layer_ids: list[int] | None = None,
        block: str = "decoder",
        mtp_idx: int | None = None,
    ) -> None:
        """Record top-k indices captured elsewhere (no hook, no sidecars), e.g. by a routing recorder.

        ``indices`` is ``[num_tokens, num_layers, topk]`` or a sequence of per-layer ``[num_tokens, topk]``
        tensors; ``layer_ids`` names the layers (default ``0..num_layers-1``); ``step`` defaults to the
        current step.
        """
        if self._stopped:
            return
        if torch.is_tensor(indices):
            if indices.dim() != 3:
                raise ValueError(f"indices must be [num_tokens, num_layers, topk], got shape {tuple(indices.shape)}")
            per_layer = list(indices.unbind(dim=1))
        else:
            per_layer = list(indices)
        if layer_ids is not None and len(layer_ids) != len(per_layer):
            raise ValueError(f"{len(layer_ids)} layer_ids for {len(per_layer)} layers of indices")
        stamp = self.step_id if step is None else step
        for position, layer_indices in enumerate(per_layer):
            layer = position if layer_ids is None else layer_ids[position]
            host = self._to_host(layer_indices, torch.int32)
            self.records.append(self._make_record(host, stamp, (block, mtp_idx, layer)))

    # --- output --------------------------------------------------------------------------------------------
    def _flush_records_to_disk(self) -> None:
        if self.records:
            if self._last_copy is not None:
                self._last_copy.synchronize()  # the asynchronous index copies have landed
                self._last_copy = None
            lines = []
            for record in self.records:
                record["top_indices"] = record.pop("_indices").tolist()
                lines.append(json.dumps(record) + "\n")
            with open(self.output_path, "a") as handle:
                handle.writelines(lines)
            self.records.clear()
        for sidecar in (self._hidden_file, self._logits_file):
            if sidecar is not None:
                sidecar.flush()

    def flush(self) -> None:
        """Write buffered records, close the sidecars and (with ``dump_router_weights``) save the router state."""
        self._flush_records_to_disk()
        for sidecar in (self._hidden_file, self._logits_file):
            if sidecar is not None:
                sidecar.close()
        if self.dump_router_weights and self._router_state:
            path = os.path.join(self.output_dir, f"router_state_rank{self.rank}.pt")
            torch.save(self._router_state, path + ".tmp")
            os.replace(path + ".tmp", path)
            self._router_state = {}
