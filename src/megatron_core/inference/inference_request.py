"""Requests and their results (Megatron-Core's ``inference.inference_request``).

An :class:`InferenceRequest` carries a prompt, its :class:`SamplingParams` and, once served, the
generated tokens, text, log-probs and a :class:`Status`. :class:`DynamicInferenceRequest` is the
dynamic engine's request: ``generated_tokens`` is a plain ``list[int]`` that grows by one token
per decode step, timing (``ttft``, ``latency``) and, for MoE models with routing replay,
``routing_indices`` (a numpy array; serialised as ``("ndarray", {"data", "dtype"})``). A request
that was evicted from the KV cache and re-admitted keeps one object;
:class:`DynamicInferenceRequestRecord` wraps it for Megatron's record-based APIs
(``engine.generate`` returns records, ``record.merge()`` gives the request).
:class:`VLMInferenceRequest` adds the images of a vision-language request.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import torch

from megatron_core.inference.sampling_params import SamplingParams

__all__ = [
    "compute_block_hashes_batched",
    "Status",
    "InferenceRequest",
    "DynamicInferenceEventType",
    "DynamicInferenceEvent",
    "DynamicInferenceRequest",
    "DynamicInferenceRequestRecord",
    "VLMInferenceRequest",
    "deserialize_ndarray",
    "deserialize_tensor",
    "serialize_ndarray",
    "serialize_tensor",
    "unwrap_serialized_tensors",
]


_HASH_RANGE = 2**63 - 1


def serialize_tensor(tensor: torch.Tensor) -> list:
    """``tensor`` as (nested) Python lists, moved to the CPU first."""
    return tensor.cpu().tolist()


def deserialize_tensor(tensor_as_list: list) -> torch.Tensor:
    """The tensor of a :func:`serialize_tensor` list (dtype inferred: int64 for ints, float32 for floats)."""
    return torch.tensor(tensor_as_list)


def serialize_ndarray(arr: np.ndarray) -> dict[str, Any]:
    """``arr`` as a JSON-compatible ``{"data": nested lists, "dtype": dtype name}``."""
    return {"data": arr.tolist(), "dtype": str(arr.dtype)}


def deserialize_ndarray(obj: dict[str, Any]) -> np.ndarray:
    """The array of a :func:`serialize_ndarray` dict. Only numeric and boolean dtypes are accepted
    (``ValueError`` otherwise): an object dtype would turn untrusted input into arbitrary Python objects."""
    dtype = np.dtype(obj["dtype"])
    if dtype.kind not in "biufc":
        raise ValueError(f"deserialize_ndarray: dtype {obj['dtype']!r} is not numeric or boolean")
    return np.array(obj["data"], dtype=dtype)


def unwrap_serialized_tensors(serialized_request: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of a serialized request whose ``("tensor", values)`` pairs are replaced by ``values``."""
    return {
        key: value[1] if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == "tensor" else value
        for key, value in serialized_request.items()
    }


def compute_block_hashes_batched(prompt_tokens: Sequence[int] | torch.Tensor, block_size: int) -> list[int]:
    """One hash per complete ``block_size``-token block of ``prompt_tokens``, each covering the whole prefix.

    Block ``i``'s hash is a SHA-256 digest of block ``i - 1``'s digest and block ``i``'s token ids, so two
    prompts share the hash of block ``i`` only when their first ``(i + 1) * block_size`` tokens agree. Values
    are in ``[1, 2**63 - 1]``; a prompt shorter than one block has none.
    """
    if block_size < 1:
        raise ValueError(f"compute_block_hashes_batched: block_size ({block_size}) must be >= 1")
    tokens = prompt_tokens.tolist() if isinstance(prompt_tokens, torch.Tensor) else list(prompt_tokens)
    hashes, digest = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens[start : start + block_size])
        digest = hashlib.sha256(digest + block).digest()
        hashes.append(int.from_bytes(digest[:8], "little") % _HASH_RANGE + 1)
    return hashes


class Status(Enum):
    """Where a request is in its life."""

    WAITING_IN_QUEUE = 1
    ACTIVE_AND_GENERATING_TOKENS = 2
    ACTIVE_BUT_NOT_GENERATING_TOKENS = 3
    COMPLETED = 4
    FAILED = 5


ENDED_STATUSES = (Status.COMPLETED, Status.FAILED)  # a request in either status takes no more steps


@dataclass(kw_only=True)
class InferenceRequest:
    """A prompt, how to sample it, and what came out."""

    request_id: int | str
    prompt: str | None = None
    sampling_params: SamplingParams | None = None
    inference_parameters: SamplingParams | None = None
    prompt_tokens: list[int] | torch.Tensor | None = None
    prompt_length: int | None = None
    arrival_time: float | None = None
    status: Status | None = None
    encoder_prompt: str | None = None
    generated_text: str | None = None
    segments: list[str] | None = None
    generated_segments: list[str] | None = None
    generated_sequence_lengths: list[int] | None = None
    generated_tokens: list[int] | torch.Tensor | None = None
    prompt_log_probs: list[float] | None = None
    generated_log_probs: list[float] | None = None
    prompt_top_n_logprobs: list[dict[str, float]] | None = None
    generated_top_n_logprobs: list[dict[str, float]] | None = None
    generated_length: int | None = None
    tpot: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.sampling_params is None and self.inference_parameters is not None:
            self.sampling_params = self.inference_parameters
        if self.sampling_params is None:
            self.sampling_params = SamplingParams()
        if self.prompt_tokens is not None and self.prompt_length is None:
            self.prompt_length = len(self.prompt_tokens)
        if self.arrival_time is None:
            self.arrival_time = time.monotonic()

    def serialize(self) -> dict[str, Any]:
        """A plain-dict copy with tensors as lists and enums as names (JSON friendly)."""
        out: dict[str, Any] = {}
        for key, value in self.__dict__.items():
            if isinstance(value, torch.Tensor):
                value = value.tolist()
            elif isinstance(value, np.ndarray):  # Megatron-Core's form: ("ndarray", {"data", "dtype"})
                value = ("ndarray", serialize_ndarray(value))
            elif isinstance(value, Enum):
                value = value.name
            elif isinstance(value, SamplingParams):
                value = value.serialize()
            elif isinstance(value, list) and value and isinstance(value[0], DynamicInferenceEvent):
                value = [str(v) for v in value]
            out[key] = value
        return out


@dataclass(kw_only=True)
class VLMInferenceRequest(InferenceRequest):
    """A request with images for a vision-language model (served by the static-batch loop).

    ``imgs`` holds the image tiles ``[tiles, 3, h, w]``, ``num_tiles`` the tile count of each image,
    ``num_img_embeddings_per_tile`` the embeddings one tile becomes, and ``decoder_seq_length`` the
    language model's sequence limit (text plus image embeddings).
    """

    num_img_embeddings_per_tile: int
    imgs: torch.Tensor
    num_tiles: torch.Tensor
    decoder_seq_length: int


class DynamicInferenceEventType(Enum):
    """What happened to a dynamic request (for tracing)."""

    ADD = 1
    PAUSE = 2
    EVICT = 3
    FINISH = 4
    FAIL = 5
    ERROR_TRANSIENT = 6
    ERROR_NONTRANSIENT = 7
    GENERATED_TOKEN = 8


@dataclass
class DynamicInferenceEvent:
    """One timestamped event in a request's life."""

    type: DynamicInferenceEventType
    timestamp: float = field(default_factory=time.monotonic)
    payload: Any = None

    def __str__(self) -> str:
        return f"{self.type.name}@{self.timestamp:.6f}" + ("" if self.payload is None else f"({self.payload})")


@dataclass(kw_only=True)
class DynamicInferenceRequest(InferenceRequest):
    """A request served by the dynamic (continuous-batching) engine."""

    generated_tokens: list[int] = field(default_factory=list)
    remaining_prompt_tokens: list[int] | None = None
    latency: float | None = None
    ttft: float | None = None
    events: list[DynamicInferenceEvent] = field(default_factory=list)
    stop_word_ids: list[list[int]] | None = None
    finished_chunk_token_count: int = 0
    block_size_tokens: int | None = None
    enable_prefix_caching: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed) at the last admission
    precomputed_block_hashes: list[int] = field(default_factory=list)
    num_evictions: int = 0
    error: str | None = None
    finish_reason: str | None = None
    # Rollout routing replay (moe_enable_routing_replay): the experts each token was routed to, set when the
    # request completes; [total_tokens - 1, num_moe_layers, topk] (the last generated token is never fed).
    routing_indices: np.ndarray | None = None

    def __post_init__(self) -> None:
        if isinstance(self.prompt_tokens, torch.Tensor):
            self.prompt_tokens = self.prompt_tokens.tolist()
        super().__post_init__()
        if self.status is None:
            self.status = Status.WAITING_IN_QUEUE
        if self.enable_prefix_caching and self.block_size_tokens and not self.precomputed_block_hashes:
            self.precomputed_block_hashes = compute_block_hashes_batched(self.prompt_tokens, self.block_size_tokens)

    def serialize(self) -> dict[str, Any]:
        """As :meth:`InferenceRequest.serialize`; checks that ``routing_indices`` has a row per fed token."""
        if self.routing_indices is not None:
            prompt = len(self.prompt_tokens) if self.prompt_tokens is not None else (self.prompt_length or 0)
            fed = prompt + len(self.generated_tokens) - 1
            if self.routing_indices.shape[0] != fed:
                raise ValueError(f"request {self.request_id}: routing_indices has {self.routing_indices.shape[0]} "
                                 f"rows; the model was fed {fed} tokens (all but the last generated one)")
        return super().serialize()

    @property
    def remaining_prompt_length(self) -> int:
        """Prompt tokens not yet prefilled (chunked prefill)."""
        return len(self.remaining_prompt_tokens) if self.remaining_prompt_tokens is not None else 0

    def add_event(self, event_type: DynamicInferenceEventType, payload: Any = None) -> None:
        """Record an event."""
        self.events.append(DynamicInferenceEvent(event_type, payload=payload))

    def add_event_pause(self) -> None:
        """Record that the request was paused (kept its KV blocks, skipped a step)."""
        self.add_event(DynamicInferenceEventType.PAUSE)

    def add_event_evict(self) -> None:
        """Record that the request lost its KV blocks and went back to the queue."""
        self.num_evictions += 1
        self.add_event(DynamicInferenceEventType.EVICT)

    def add_event_finish(self) -> None:
        """Record completion."""
        self.add_event(DynamicInferenceEventType.FINISH)

    def add_event_fail(self, message: str | None = None) -> None:
        """Record failure."""
        self.add_event(DynamicInferenceEventType.FAIL, payload=message)

    @property
    def succeeded(self) -> bool:
        """Whether the request completed."""
        return self.status == Status.COMPLETED

    @property
    def failed(self) -> bool:
        """Whether the request failed."""
        return self.status == Status.FAILED

    def __str__(self) -> str:
        return (
            f"DynamicInferenceRequest(id={self.request_id}, status={self.status.name if self.status else None}, "
            f"prompt_len={self.prompt_length}, generated={len(self.generated_tokens)})"
        )


@dataclass
class DynamicInferenceRequestRecord:
    """The requests that served one user request (ours always holds exactly one)."""

    requests: list[DynamicInferenceRequest] = field(default_factory=list)
    latency: float | None = None

    @classmethod
    def from_request(cls, request: DynamicInferenceRequest) -> DynamicInferenceRequestRecord:
        """Wrap one request."""
        return cls(requests=[request], latency=request.latency)

    def __getitem__(self, idx: int) -> DynamicInferenceRequest:
        return self.requests[idx]

    @property
    def request_id(self) -> int | str:
        """The wrapped request's id."""
        return self.requests[0].request_id

    def merge(self, tokenizer: Any = None) -> DynamicInferenceRequest:
        """The final request (generated text filled from ``tokenizer`` if missing)."""
        request = self.requests[-1]
        if tokenizer is not None and request.generated_text is None:
            request.generated_text = tokenizer.detokenize(request.generated_tokens)
        return request
