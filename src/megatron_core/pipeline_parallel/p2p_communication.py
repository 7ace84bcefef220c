"""Point-to-point exchange of activations and gradients between neighbouring pipeline stages.

Megatron-Core's ``p2p_communication``: :class:`P2PCommunicator` plus the module-level functions
(``recv_forward``, ``send_forward_recv_backward``, ...) that use the pipeline group of
``parallel_state``. This is the only module of ``pipeline_parallel`` that sends or receives.

Activations travel to the next stage ("forward"), gradients to the previous stage ("backward");
the last stage's next rank is the first stage and vice versa, which the interleaved schedule
uses. A batched exchange (``batch_p2p_comm``) posts its operations in one fixed order (forward
sends and receives first, then backward ones) and, on gloo, tags them by direction. That order
matters when the previous and next rank are the same process (two stages): a rank that sends an
activation and a gradient to its only peer must post them in the order the peer posts the
matching receives, otherwise the two messages are swapped (NCCL matches by order, gloo by tag and
order). Separate ``isend``/``irecv`` calls (``batch_p2p_comm=False``) run one after another on
NCCL, where a send waits for its receive: even stages post send-then-receive and odd stages
receive-then-send, so that neighbours never both wait in a send.

With ``overlap_p2p_comm=True`` (the interleaved schedule), ``send_forward_recv_forward`` and
``send_backward_recv_backward`` return before the transfer completes, with the requests to wait on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_core import device
from megatron_core.process_groups_config import resolve_process_group

Shape = Sequence[int]

# Gloo matches messages between two ranks by tag; NCCL ignores tags and matches by order.
_TAG_FORWARD = 0
_TAG_BACKWARD = 1
_TAG_FORWARD_SHAPE = 2
_TAG_BACKWARD_SHAPE = 3
_MAX_SHAPE_DIMS = 7


def is_single_shape(x: Any) -> bool:
    """Whether ``x`` is one tensor shape (a ``torch.Size`` or a non-empty list/tuple of ints), not a list of shapes."""
    if isinstance(x, torch.Size):
        return True
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(d, int) for d in x)


def _is_shape_list(shapes: Any) -> bool:
    """True when ``shapes`` is a list of shapes (one tensor each) rather than a single shape."""
    return isinstance(shapes, list) and (len(shapes) == 0 or shapes[0] is None or not isinstance(shapes[0], int))


class P2PCommunicator:
    """Sends and receives pipeline tensors within ``pp_group``, shaped and typed from ``config``.

    ``config`` supplies ``pipeline_dtype`` (default ``params_dtype``), ``variable_seq_lengths`` and
    ``mtp_standalone`` (either: exchange shapes before each transfer), ``batch_p2p_comm`` (one ``batch_isend_irecv`` call
    instead of separate ``isend``/``irecv``) and ``batch_p2p_sync``.
    """

    def __init__(self, pp_group: dist.ProcessGroup, config: Any) -> None:
        if getattr(config, "use_ring_exchange_p2p", False):
            raise ValueError("use_ring_exchange_p2p=True is not supported; use batch_p2p_comm (the default)")
        self.pp_group = pp_group
        self.config = config
        ranks = dist.get_process_group_ranks(pp_group)
        self.total_stages = len(ranks)
        self.current_stage = dist.get_group_rank(pp_group, dist.get_rank())
        self.next_rank = ranks[(self.current_stage + 1) % self.total_stages]
        self.prev_rank = ranks[(self.current_stage - 1) % self.total_stages]

    # --- stage predicates -------------------------------------------------------------------
    @property
    def is_pp_first_stage(self) -> bool:
        """True on the first pipeline stage (a property, as in Megatron-Core)."""
        return self.current_stage == 0

    @property
    def is_pp_last_stage(self) -> bool:
        """True on the last pipeline stage (a property, as in Megatron-Core)."""
        return self.current_stage == self.total_stages - 1

    # --- the public operations ----------------------------------------------------------------
    def recv_forward(self, tensor_shapes: Any, is_first_stage: bool | None = None) -> Any:
        """Receive the activation(s) from the previous stage; ``None`` on the first stage."""
        first = self.is_pp_first_stage if is_first_stage is None else is_first_stage
        return self._each(tensor_shapes, None, lambda shape, _: None if first else self._recv(shape, prev=True))

    def recv_backward(self, tensor_shapes: Any, is_last_stage: bool | None = None) -> Any:
        """Receive the output gradient(s) from the next stage; ``None`` on the last stage."""
        last = self.is_pp_last_stage if is_last_stage is None else is_last_stage
        return self._each(tensor_shapes, None, lambda shape, _: None if last else self._recv(shape, prev=False))

    def send_forward(self, output_tensors: Any, is_last_stage: bool | None = None) -> None:
        """Send the activation(s) to the next stage; nothing on the last stage."""
        if self.is_pp_last_stage if is_last_stage is None else is_last_stage:
            return
        for tensor in output_tensors if isinstance(output_tensors, list) else [output_tensors]:
            if tensor is not None:
                self._communicate(tensor_send_next=tensor, tensor_shape=tuple(tensor.shape))

    def send_backward(self, input_tensor_grads: Any, is_first_stage: bool | None = None) -> None:
        """Send the input gradient(s) to the previous stage; nothing on the first stage."""
        if self.is_pp_first_stage if is_first_stage is None else is_first_stage:
            return
        for tensor in input_tensor_grads if isinstance(input_tensor_grads, list) else [input_tensor_grads]:
            if tensor is not None:
                self._communicate(tensor_send_prev=tensor, tensor_shape=tuple(tensor.shape))

    def send_forward_recv_backward(
        self, output_tensors: Any, tensor_shapes: Any, is_last_stage: bool | None = None
    ) -> Any:
        """Send activation(s) to the next stage and receive their gradient(s) from it."""
        if self.is_pp_last_stage if is_last_stage is None else is_last_stage:
            return self._each(tensor_shapes, None, lambda shape, _: None)
        return self._each(
            tensor_shapes,
            output_tensors,
            lambda shape, tensor: self._communicate(tensor_send_next=tensor, recv_next=True, tensor_shape=shape)[1],
        )

    def send_backward_recv_forward(
        self, input_tensor_grads: Any, tensor_shapes: Any, is_first_stage: bool | None = None
    ) -> Any:
        """Send input gradient(s) to the previous stage and receive the next activation(s) from it."""
        if self.is_pp_first_stage if is_first_stage is None else is_first_stage:
            return self._each(tensor_shapes, None, lambda shape, _: None)
        return self._each(
            tensor_shapes,
            input_tensor_grads,
            lambda shape, tensor: self._communicate(tensor_send_prev=tensor, recv_prev=True, tensor_shape=shape)[0],
        )

    def send_forward_recv_forward(
        self, output_tensor: torch.Tensor | None, recv_prev: bool, tensor_shape: Shape, overlap_p2p_comm: bool = False
    ) -> Any:
        """Send an activation to the next stage and, if ``recv_prev``, receive one from the previous.

        With ``overlap_p2p_comm=True`` returns ``(tensor, handles)`` at once: the transfer is under way,
        ``handles`` maps ``"send_next"`` / ``"recv_prev"`` to requests whose ``wait()`` must come before
        the received tensor is read or the sent one is freed (on CUDA it orders the current stream, it
        does not block the host).
        """
        received, _, handles = self._communicate(tensor_send_next=output_tensor, recv_prev=recv_prev,
                                                 tensor_shape=tensor_shape, wait=not overlap_p2p_comm)
        return (received, handles) if overlap_p2p_comm else received

    def send_backward_recv_backward(
        self, input_tensor_grad: torch.Tensor | None, recv_next: bool, tensor_shape: Shape, overlap_p2p_comm: bool = False
    ) -> Any:
        """Send a gradient to the previous stage and, if ``recv_next``, receive one from the next;
        ``overlap_p2p_comm`` as for :meth:`send_forward_recv_forward` (keys ``"send_prev"`` / ``"recv_next"``)."""
        _, received, handles = self._communicate(tensor_send_prev=input_tensor_grad, recv_next=recv_next,
                                                 tensor_shape=tensor_shape, wait=not overlap_p2p_comm)
        return (received, handles) if overlap_p2p_comm else received

    def send_forward_backward_recv_forward_backward(
        self,
        output_tensor: torch.Tensor | None,
        input_tensor_grad: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Shape,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both directions at once: returns ``(input_tensor, output_tensor_grad)``."""
        received_prev, received_next, _ = self._communicate(
            tensor_send_next=output_tensor,
            tensor_send_prev=input_tensor_grad,
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
        )
        return received_prev, received_next

    # --- internals ------------------------------------------------------------------------------
    @staticmethod
    def _each(shapes: Any, tensors: Any, fn: Any) -> Any:
        """Apply ``fn(shape, tensor)`` to one shape or to each shape of a list (Megatron accepts both)."""
        if not _is_shape_list(shapes):
            return fn(tuple(shapes) if shapes is not None else None, tensors)
        tensors = tensors if isinstance(tensors, list) else [tensors] * len(shapes)
        return [None if s is None else fn(tuple(s), t) for s, t in zip(shapes, tensors)]

    def _dtype(self) -> torch.dtype:
        return self.config.pipeline_dtype or self.config.params_dtype

    def _recv(self, shape: Shape, prev: bool) -> torch.Tensor | None:
        recv_prev, recv_next, _ = self._communicate(recv_prev=prev, recv_next=not prev, tensor_shape=shape)
        return recv_prev if prev else recv_next

    def _exchanges_shapes(self) -> bool:
        """Whether each transfer is preceded by its shape: ``variable_seq_lengths``, or ``mtp_standalone`` (the MTP
        stage sends the decoder's and the depths' hidden states concatenated, ``[(1 + D) s, b, h]``)."""
        return bool(self.config.variable_seq_lengths or getattr(self.config, "mtp_standalone", False))

    def _check_send(self, tensor: torch.Tensor, shape: Shape | None, direction: str) -> None:
        if tensor.dtype != self._dtype():
            raise ValueError(
                f"pipeline stage {self.current_stage} sends a {direction} tensor of dtype {tensor.dtype}, "
                f"but config.pipeline_dtype is {self._dtype()}"
            )
        if not self._exchanges_shapes() and shape is not None and tuple(tensor.shape) != tuple(shape):
            raise ValueError(
                f"pipeline stage {self.current_stage} sends a {direction} tensor of shape {tuple(tensor.shape)}, "
                f"but the pipeline expects {tuple(shape)} (from seq_length, micro_batch_size and hidden_size); "
                f"set config.variable_seq_lengths=True for shapes that change between microbatches"
            )

    def _communicate(
        self,
        tensor_send_next: torch.Tensor | None = None,
        tensor_send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        tensor_shape: Shape | None = None,
        wait: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, Any]]:
        """One exchange with both neighbours: ``(tensor_recv_prev, tensor_recv_next, handles)``; without
        ``wait`` the transfers are still under way and ``handles`` holds their requests (else it is empty)."""
        if tensor_send_next is not None:
            self._check_send(tensor_send_next, tensor_shape, "forward")
        if tensor_send_prev is not None:
            self._check_send(tensor_send_prev, tensor_shape, "backward")
        if self._exchanges_shapes():
            recv_prev_shape, recv_next_shape = self._communicate_shapes(
                tensor_send_next, tensor_send_prev, recv_prev, recv_next
            )
        else:
            if (recv_prev or recv_next) and tensor_shape is None:
                raise ValueError("tensor_shape is required to receive unless config.variable_seq_lengths=True")
            recv_prev_shape = recv_next_shape = tensor_shape
        dev = device.get_current_device()
        tensor_recv_prev = (
            torch.empty(tuple(recv_prev_shape), dtype=self._dtype(), device=dev, requires_grad=True)
            if recv_prev
            else None
        )
        tensor_recv_next = (
            torch.empty(tuple(recv_next_shape), dtype=self._dtype(), device=dev, requires_grad=True)
            if recv_next
            else None
        )
        handles = self._exchange(
            [
                ("send_next", tensor_send_next, True, self.next_rank, _TAG_FORWARD),
                ("recv_prev", tensor_recv_prev, False, self.prev_rank, _TAG_FORWARD),
                ("send_prev", tensor_send_prev, True, self.prev_rank, _TAG_BACKWARD),
                ("recv_next", tensor_recv_next, False, self.next_rank, _TAG_BACKWARD),
            ],
            wait=wait,
        )
        return tensor_recv_prev, tensor_recv_next, handles

    def _communicate_shapes(
        self,
        tensor_send_next: torch.Tensor | None,
        tensor_send_prev: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
    ) -> tuple[list[int] | None, list[int] | None]:
        """Exchange the shapes of the tensors about to travel (``variable_seq_lengths``)."""
        dev = device.get_current_device()

        def encode(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            if tensor.dim() > _MAX_SHAPE_DIMS:
                raise ValueError(f"pipeline tensors may have at most {_MAX_SHAPE_DIMS} dims, got {tuple(tensor.shape)}")
            return torch.tensor([tensor.dim(), *tensor.shape] + [0] * (_MAX_SHAPE_DIMS - tensor.dim()),
                                dtype=torch.int64, device=dev)

        def buffer(wanted: bool) -> torch.Tensor | None:
            return torch.empty(_MAX_SHAPE_DIMS + 1, dtype=torch.int64, device=dev) if wanted else None

        shape_prev, shape_next = buffer(recv_prev), buffer(recv_next)
        self._exchange(
            [
                ("send_next", encode(tensor_send_next), True, self.next_rank, _TAG_FORWARD_SHAPE),
                ("recv_prev", shape_prev, False, self.prev_rank, _TAG_FORWARD_SHAPE),
                ("send_prev", encode(tensor_send_prev), True, self.prev_rank, _TAG_BACKWARD_SHAPE),
                ("recv_next", shape_next, False, self.next_rank, _TAG_BACKWARD_SHAPE),
            ]
        )

        def decode(encoded: torch.Tensor | None) -> list[int] | None:
            if encoded is None:
                return None
            values = encoded.tolist()
            return values[1 : 1 + values[0]]

        return decode(shape_prev), decode(shape_next)

    def _exchange(self, ops: list[tuple[str, torch.Tensor | None, bool, int, int]], wait: bool = True) -> dict[str, Any]:
        """Post ``(name, tensor, is_send, peer, tag)`` operations (batched in the given order, else in the
        even/odd stage order) and wait for them unless ``wait=False``; returns the requests by name when not
        waiting. ``batch_p2p_sync`` synchronizes the device after a batched exchange (as Megatron does)."""
        ops = [op for op in ops if op[1] is not None]
        if not ops:
            return {}
        if self.config.batch_p2p_comm:
            p2p_ops = [
                dist.P2POp(dist.isend if is_send else dist.irecv, tensor, peer, self.pp_group, tag)
                for _, tensor, is_send, peer, tag in ops
            ]
            requests = dist.batch_isend_irecv(p2p_ops)
            handles = dict(zip([op[0] for op in ops], requests)) if len(requests) == len(ops) else \
                {f"batch_{i}": request for i, request in enumerate(requests)}
        else:
            handles = {
                name: (dist.isend if is_send else dist.irecv)(tensor, peer, group=self.pp_group, tag=tag)
                for name, tensor, is_send, peer, tag in _stage_order(ops, self.current_stage)
            }
        if wait:
            wait_handles(handles)
            handles = {}
        if self.config.batch_p2p_comm and self.config.batch_p2p_sync:
            device.synchronize()
        return handles


_EVEN_STAGE_ORDER = ("send_next", "recv_prev", "send_prev", "recv_next")
_ODD_STAGE_ORDER = ("recv_prev", "send_next", "recv_next", "send_prev")


def _stage_order(ops: list[tuple], stage: int) -> list[tuple]:
    """The operations of one unbatched exchange in the order this stage posts them: even stages send
    before they receive, odd stages receive first, so that no two neighbours both start with a send."""
    order = _EVEN_STAGE_ORDER if stage % 2 == 0 else _ODD_STAGE_ORDER
    return sorted(ops, key=lambda op: order.index(op[0]))


def wait_handles(handles: dict[str, Any] | None) -> None:
    """Wait for every request of an overlapped exchange (``overlap_p2p_comm=True``)."""
    for request in (handles or {}).values():
        request.wait()


def resolve_communicator(config: Any, p2p_communicator: Any = None, pg_collection: Any = None) -> Any:
    """The communicator given, else one over ``pg_collection.pp``, else over ``parallel_state``'s PP group."""
    if p2p_communicator is not None:
        return p2p_communicator
    pp_group = resolve_process_group("pp", pg_collection)
    if pp_group is None:
        raise RuntimeError(
            "a pipeline schedule needs a pipeline-parallel group: pass pg_collection with pp set, a "
            "p2p_communicator, or call initialize_model_parallel() first"
        )
    return P2PCommunicator(pp_group, config)


def _communicator(config: Any) -> P2PCommunicator:
    return resolve_communicator(config)


def recv_forward(tensor_shape: Any, config: Any, is_first_stage: bool | None = None) -> Any:
    """Receive activations from the previous stage of ``parallel_state``'s pipeline (``None`` on the first)."""
    return _communicator(config).recv_forward(tensor_shape, is_first_stage)


def recv_backward(tensor_shape: Any, config: Any, is_last_stage: bool | None = None) -> Any:
    """Receive output gradients from the next stage (``None`` on the last)."""
    return _communicator(config).recv_backward(tensor_shape, is_last_stage)


def send_forward(output_tensor: Any, config: Any, is_last_stage: bool | None = None) -> None:
    """Send activations to the next stage (nothing on the last)."""
    _communicator(config).send_forward(output_tensor, is_last_stage)


def send_backward(input_tensor_grad: Any, config: Any, is_first_stage: bool | None = None) -> None:
    """Send input gradients to the previous stage (nothing on the first)."""
    _communicator(config).send_backward(input_tensor_grad, is_first_stage)


def send_forward_recv_backward(
    output_tensor: Any, tensor_shape: Any, config: Any, is_last_stage: bool | None = None
) -> Any:
    """Send activations to the next stage and receive their gradients."""
    return _communicator(config).send_forward_recv_backward(output_tensor, tensor_shape, is_last_stage)


def send_backward_recv_forward(
    input_tensor_grad: Any, tensor_shape: Any, config: Any, is_first_stage: bool | None = None
) -> Any:
    """Send input gradients to the previous stage and receive its next activations."""
    return _communicator(config).send_backward_recv_forward(input_tensor_grad, tensor_shape, is_first_stage)


def send_forward_recv_forward(
    output_tensor: torch.Tensor | None, recv_prev: bool, tensor_shape: Shape, config: Any, overlap_p2p_comm: bool = False
) -> Any:
    """Send an activation forward and optionally receive one from the previous stage."""
    return _communicator(config).send_forward_recv_forward(output_tensor, recv_prev, tensor_shape, overlap_p2p_comm)


def send_backward_recv_backward(
    input_tensor_grad: torch.Tensor | None, recv_next: bool, tensor_shape: Shape, config: Any,
    overlap_p2p_comm: bool = False,
) -> Any:
    """Send a gradient backward and optionally receive one from the next stage."""
    return _communicator(config).send_backward_recv_backward(input_tensor_grad, recv_next, tensor_shape, overlap_p2p_comm)


def send_forward_backward_recv_forward_backward(
    output_tensor: torch.Tensor | None,
    input_tensor_grad: torch.Tensor | None,
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Shape,
    config: Any,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Send and receive in both directions; returns ``(input_tensor, output_tensor_grad)``."""
    return _communicator(config).send_forward_backward_recv_forward_backward(
        output_tensor, input_tensor_grad, recv_prev, recv_next, tensor_shape
    )
