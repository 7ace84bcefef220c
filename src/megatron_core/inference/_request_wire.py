"""Requests and sampling settings as they travel between coordinator, engines and clients.

The sender calls ``SamplingParams.serialize()`` / ``DynamicInferenceRequest.serialize()`` (plain
dicts, sent as msgpack); these functions rebuild the objects on the other side from data a peer
sent, so they accept only the dataclass's own fields (a key naming a method or a private
attribute is dropped) and turn every failure into a ``ValueError``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_core.inference.inference_request import DynamicInferenceRequest, Status, deserialize_ndarray
from megatron_core.inference.sampling_params import SamplingParams

__all__ = ["deserialize_request", "deserialize_sampling_params"]

_REQUEST_FIELDS = {f.name for f in dataclasses.fields(DynamicInferenceRequest)} - {"events", "inference_parameters"}


def deserialize_sampling_params(data: Any) -> SamplingParams:
    """A :class:`SamplingParams` from its ``serialize()`` dict (``None`` gives the defaults).

    Extra keys that are not SamplingParams fields become attributes, as ``SamplingParams.deserialize``
    does, unless they start with ``_`` or name an existing method.
    """
    if data is None:
        return SamplingParams()
    if not isinstance(data, dict):
        raise ValueError(f"sampling_params must be a map, got {type(data).__name__}")
    field_names = {f.name for f in dataclasses.fields(SamplingParams)}
    extras = {}
    for key, value in data.items():
        if key in field_names:
            continue
        if not isinstance(key, str) or key.startswith("_") or callable(getattr(SamplingParams, key, None)):
            raise ValueError(f"sampling_params: {key!r} is not a setting")
        extras[key] = value
    try:
        params = SamplingParams(**{k: v for k, v in data.items() if k in field_names})
        params.add_attributes(extras)
    except (TypeError, ValueError) as error:
        raise ValueError(f"sampling_params: {error}") from error
    return params


def deserialize_request(data: dict) -> DynamicInferenceRequest:
    """A :class:`DynamicInferenceRequest` from a finished request's serialized dict (events are not rebuilt)."""
    if not isinstance(data, dict):
        raise ValueError(f"a serialized request must be a map, got {type(data).__name__}")
    kwargs = {k: v for k, v in data.items() if k in _REQUEST_FIELDS}
    status = kwargs.get("status")
    if isinstance(status, str):
        kwargs["status"] = Status[status] if status in Status.__members__ else Status.FAILED
    params = kwargs.get("sampling_params")
    kwargs["sampling_params"] = deserialize_sampling_params(params) if isinstance(params, dict) else None
    routing = kwargs.get("routing_indices")
    if isinstance(routing, (list, tuple)) and len(routing) == 2 and routing[0] == "ndarray":
        kwargs["routing_indices"] = deserialize_ndarray(routing[1])
    kwargs.setdefault("request_id", None)
    try:
        return DynamicInferenceRequest(**kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"cannot rebuild the request: {error}") from error
