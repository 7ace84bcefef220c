"""One CUDA graph for a whole forward-backward pass (Megatron-Core's ``full_cuda_graph``).

:class:`FullCudaGraphWrapper` wraps a ``forward_backward_func`` (``get_forward_backward_func()``). Its first
``cuda_graph_warmup_steps`` calls per stage (training, validation) run eagerly; the next one captures the whole
call, every micro-batch's forward and backward and the gradient reduction, into one CUDA graph, which that call and
all later ones replay: one launch per iteration instead of thousands. Each call reads its micro-batches from the
data iterator first and copies them into fixed-address buffers (:class:`StaticBufferLoader`) that the graph reads.

Surprising, and the same in Megatron-Core: the graph state is process-wide (class attributes), so a training and a
validation wrapper share the iteration counts; a replay returns the same list of loss dicts as the capture, whose
tensors each replay overwrites (read them before the next call); Python side effects of the wrapped function (hooks,
counters) happen only in the eager and captured calls. Everything inside must be capturable: no host syncs, fixed
shapes, and no RNG-tracker forks (``transformer_validation.check_cuda_graphs`` names what the config refuses).

Differences from Megatron-Core: without CUDA (the current device is the CPU) the wrapper calls the function eagerly
every time; the eager warm-up calls run on the shared capture stream (so autograd nodes, cuBLAS workspaces and
communicators are set up on the stream the capture uses); mismatched buffer structures, shapes or dtypes raise
``ValueError``/``TypeError`` instead of copying silently.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import torch

from megatron_core import device

__all__ = [
    "FullCudaGraphWrapper",
    "StaticBufferLoader",
    "clone_tensors_in_struct",
    "copy_tensors_in_struct",
    "get_graph_pool",
    "get_shared_capture_stream",
    "get_shared_graph_pool",
    "logger",
]

logger = logging.getLogger(__name__)

STAGES = ("training", "validation")
_REQUIRED_KWARGS = ("model", "data_iterator", "num_microbatches", "seq_length", "forward_only")

# One stream and one graph memory pool per process, shared by every full-iteration (and optimizer) capture.
_shared_capture_stream: Any = None
_shared_graph_pool: Any = None


def _on_cuda() -> bool:
    return device.get_current_device().type == "cuda"


def _require_cuda(what: str) -> None:
    if not device.cuda_available():
        raise RuntimeError(f"{what} needs CUDA (full-iteration CUDA graphs are a GPU-only feature)")


def get_shared_capture_stream() -> torch.cuda.Stream:
    """The one ``torch.cuda.Stream`` all full-iteration graph captures use (created on the current device at first
    call: select the device first)."""
    global _shared_capture_stream
    _require_cuda("get_shared_capture_stream")
    if _shared_capture_stream is None:
        _shared_capture_stream = torch.cuda.Stream()
    return _shared_capture_stream


def get_shared_graph_pool() -> Any:
    """One graph memory-pool handle for the whole process (``torch.cuda.graph_pool_handle()`` makes a new pool at
    every call)."""
    global _shared_graph_pool
    _require_cuda("get_shared_graph_pool")
    if _shared_graph_pool is None:
        _shared_graph_pool = torch.cuda.graph_pool_handle()
    return _shared_graph_pool


def get_graph_pool(use_single_mempool: bool) -> Any:
    """The pool for a capture: the shared one with ``use_single_mempool``, else a new one."""
    if use_single_mempool:
        return get_shared_graph_pool()
    _require_cuda("get_graph_pool")
    return torch.cuda.graph_pool_handle()


def copy_tensors_in_struct(src: Any) -> Any:
    """A copy of ``src`` (tuples, lists and dicts, nested) whose tensors are new detached copies on the current
    device; other values are kept as they are. (Megatron-Core's name: this one makes new tensors.)"""
    if isinstance(src, tuple):
        return tuple(copy_tensors_in_struct(item) for item in src)
    if isinstance(src, list):
        return [copy_tensors_in_struct(item) for item in src]
    if isinstance(src, dict):
        return {key: copy_tensors_in_struct(value) for key, value in src.items()}
    if isinstance(src, torch.Tensor):
        return src.detach().to(device.get_current_device(), copy=True)
    return src


def clone_tensors_in_struct(tgt: list | dict, src: list | dict) -> None:
    """Copy the tensors of ``src`` into the tensors at the same places in ``tgt`` (lists and dicts, nested); other
    values of ``src`` replace ``tgt``'s. (Megatron-Core's name: this one writes into existing tensors.)

    The top level must be a list or dict. Raises ``TypeError`` for tuples (they cannot be written into) and for a
    place where ``tgt`` does not hold the same kind of container or a tensor, ``ValueError`` where a list is shorter,
    a key is missing, or a tensor's shape or dtype differs (a graph reading the buffer would see other data).
    """
    if isinstance(src, torch.Tensor) or not isinstance(src, (list, dict)):
        raise TypeError(f"clone_tensors_in_struct: the top level must be a list or dict, got {type(src).__name__}")
    _copy_into(tgt, src, "")


def _copy_into(tgt: Any, src: Any, path: str) -> None:
    where = path or "the top level"
    if isinstance(src, tuple):
        raise TypeError(f"clone_tensors_in_struct: cannot copy into a tuple (at {where})")
    if isinstance(src, torch.Tensor):
        if not isinstance(tgt, torch.Tensor):
            raise TypeError(f"clone_tensors_in_struct: {where} is a tensor in src but {type(tgt).__name__} in tgt")
        if tgt.shape != src.shape or tgt.dtype != src.dtype:
            raise ValueError(f"clone_tensors_in_struct: {where} has shape {tuple(src.shape)} and dtype {src.dtype} "
                             f"in src but {tuple(tgt.shape)} and {tgt.dtype} in tgt")
        tgt.copy_(src, non_blocking=True)
        return
    if not isinstance(tgt, list if isinstance(src, list) else dict):
        raise TypeError(f"clone_tensors_in_struct: {where} is a {type(src).__name__} in src but "
                        f"{type(tgt).__name__} in tgt")
    if isinstance(src, list):
        if len(tgt) < len(src):
            raise ValueError(f"clone_tensors_in_struct: {where} has {len(src)} items in src but {len(tgt)} in tgt")
        items = list(enumerate(src))
    else:
        missing = [key for key in src if key not in tgt]
        if missing:
            raise ValueError(f"clone_tensors_in_struct: keys {missing} of src are missing from tgt at {where}")
        items = list(src.items())
    for key, value in items:
        if isinstance(value, (tuple, list, dict, torch.Tensor)):
            _copy_into(tgt[key], value, f"{path}[{key!r}]")
        else:
            tgt[key] = value


class StaticBufferLoader:
    """Copies each micro-batch (a dict of tensors) into fixed buffers, one per stage and micro-batch index.

    The first batch of an index allocates its buffers (new keys of later batches add theirs); later batches are
    copied into them, so a captured graph reads each new batch from the addresses it recorded. On CUDA the copies run
    on a stream of the loader's own, which the current stream then waits for. The buffers are class-level, shared by
    every loader in the process (Megatron-Core's layout).
    """

    static_buffers: dict[str, list[dict]] = {"training": [], "validation": []}

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream() if _on_cuda() else None

    def __call__(self, inputs: Any, stage: str, microbatch: int) -> dict:
        """The buffers of ``stage``'s micro-batch ``microbatch`` holding ``inputs`` (a dict, or a tuple whose first
        item is the dict)."""
        if stage not in STAGES:
            raise ValueError(f"stage ({stage!r}) must be one of {list(STAGES)}")
        buffers = StaticBufferLoader.static_buffers[stage]
        if not 0 <= microbatch <= len(buffers):
            raise ValueError(f"microbatch ({microbatch}) must be between 0 and the number of {stage} buffers "
                             f"({len(buffers)}): micro-batches are loaded in order")
        if isinstance(inputs, tuple) and inputs and isinstance(inputs[0], dict):
            inputs = inputs[0]
        if not isinstance(inputs, dict):
            raise TypeError(f"StaticBufferLoader takes a micro-batch dict (or a tuple starting with one), "
                            f"got {type(inputs).__name__}")
        if microbatch < len(buffers):
            target = buffers[microbatch]
            for key, value in inputs.items():
                if key not in target:
                    target[key] = (torch.empty_like(value, device=device.get_current_device())
                                   if isinstance(value, torch.Tensor) else value)
        if self.stream is None:
            self._load(inputs, buffers, microbatch)
            return buffers[microbatch]
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self._load(inputs, buffers, microbatch)
        torch.cuda.current_stream().wait_stream(self.stream)
        return buffers[microbatch]

    @staticmethod
    def _load(inputs: dict, buffers: list[dict], microbatch: int) -> None:
        if microbatch == len(buffers):
            buffers.append(copy_tensors_in_struct(inputs))
        else:
            clone_tensors_in_struct(buffers[microbatch], inputs)


class FullCudaGraphWrapper:
    """``forward_backward_func`` captured whole into one CUDA graph per stage after ``cuda_graph_warmup_steps`` eager
    calls (see the module's docstring); called with the schedules' keyword arguments, it returns their loss dicts.

    ``use_single_mempool``: capture into the process's shared graph pool (:func:`get_shared_graph_pool`) instead of
    a new pool per capture. Without CUDA every call runs ``forward_backward_func`` eagerly.
    """

    curr_iteration: dict[str, int] = {"training": 0, "validation": 0}
    cuda_graph: dict[str, Any] = {"training": None, "validation": None}
    result: dict[str, Any] = {"training": None, "validation": None}

    def __init__(self, forward_backward_func: Callable[..., list], cuda_graph_warmup_steps: int = 1,
                 use_single_mempool: bool = False) -> None:
        if isinstance(cuda_graph_warmup_steps, bool) or not isinstance(cuda_graph_warmup_steps, int) \
                or cuda_graph_warmup_steps < 0:
            raise ValueError(f"cuda_graph_warmup_steps ({cuda_graph_warmup_steps!r}) must be an integer >= 0")
        self.forward_backward_func = forward_backward_func
        self.static_loader = StaticBufferLoader()
        self.cuda_graph_warmup_steps = cuda_graph_warmup_steps
        self.use_single_mempool = use_single_mempool

    def data_read(self, data_iterator: Any, model: Any, training: bool, num_microbatches: int) -> list:
        """Read every micro-batch of the call now, into the static buffers: one iterator over them per model chunk
        (``None`` where the chunk has no iterator), as the list the schedules take."""
        stage = "training" if training else "validation"

        def load(iterator: Any) -> Any:
            if iterator is None:
                return None
            return iter([self.static_loader(next(iterator), stage, b) for b in range(num_microbatches)])

        if not isinstance(model, list) or len(model) == 1:
            if isinstance(data_iterator, list) and len(data_iterator) != 1:
                raise ValueError(f"one model chunk takes one data iterator, got a list of {len(data_iterator)}")
            return [load(data_iterator[0] if isinstance(data_iterator, list) else data_iterator)]
        if not isinstance(data_iterator, list) or len(data_iterator) != len(model):
            got = f"a list of {len(data_iterator)}" if isinstance(data_iterator, list) else type(data_iterator).__name__
            raise ValueError(f"{len(model)} model chunks take a list of {len(model)} data iterators, got {got}")
        return [load(iterator) for iterator in data_iterator]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One forward-backward call: eager, captured then replayed, or replayed (see the class docstring)."""
        if args:
            raise TypeError("forward_backward_func takes keyword arguments only")
        missing = [name for name in _REQUIRED_KWARGS if name not in kwargs]
        if missing:
            raise TypeError(f"FullCudaGraphWrapper needs the keyword arguments {missing}")
        stage = "validation" if kwargs["forward_only"] else "training"
        if not _on_cuda():
            FullCudaGraphWrapper.result[stage] = self.forward_backward_func(**kwargs)
        else:
            kwargs["data_iterator"] = self.data_read(kwargs["data_iterator"], kwargs["model"], stage == "training",
                                                     kwargs["num_microbatches"])
            if self.curr_iter(stage) == self.cuda_graph_warmup_steps:
                self._capture(stage, kwargs)
            if FullCudaGraphWrapper.cuda_graph[stage] is None:
                FullCudaGraphWrapper.result[stage] = self._run_on_capture_stream(kwargs)
            else:
                FullCudaGraphWrapper.cuda_graph[stage].replay()
        self.next_iter(stage)
        return FullCudaGraphWrapper.result[stage]

    def _run_on_capture_stream(self, kwargs: dict) -> Any:
        stream = get_shared_capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            result = self.forward_backward_func(**kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        return result

    def _capture(self, stage: str, kwargs: dict) -> None:
        if FullCudaGraphWrapper.cuda_graph[stage] is not None:
            raise RuntimeError(f"a {stage} CUDA graph is captured already; call reset_cuda_graph({stage!r}) first")
        logger.info("capturing the full-iteration CUDA graph for %s", stage)
        if hasattr(torch.autograd.graph, "set_override_stale_capture_stream"):
            # Autograd nodes made on another stream (before the capture) are moved onto the capturing one.
            torch.autograd.graph.set_override_stale_capture_stream(True)
        else:
            logger.warning("this PyTorch lacks torch.autograd.graph.set_override_stale_capture_stream: the capture "
                           "fails if autograd nodes kept from before it refer to a non-capturing stream")
        _barrier()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=get_shared_capture_stream(), pool=get_graph_pool(self.use_single_mempool),
                              capture_error_mode="thread_local"):
            FullCudaGraphWrapper.result[stage] = self.forward_backward_func(**kwargs)
        FullCudaGraphWrapper.cuda_graph[stage] = graph
        torch.cuda.synchronize()
        _barrier()
        logger.info("full-iteration CUDA graph captured for %s", stage)

    def curr_iter(self, stage: str) -> int:
        """How many calls ``stage`` has had."""
        return FullCudaGraphWrapper.curr_iteration[stage]

    def next_iter(self, stage: str) -> None:
        """Count one more call of ``stage``."""
        FullCudaGraphWrapper.curr_iteration[stage] += 1

    def reset_cuda_graph(self, stage: str | None = None) -> None:
        """Drop ``stage``'s graph and result and restart its count (both stages when ``None``): the next calls warm
        up and capture again."""
        if stage is not None and stage not in STAGES:
            raise ValueError(f"stage ({stage!r}) must be None or one of {list(STAGES)}")
        for name in STAGES if stage is None else (stage,):
            FullCudaGraphWrapper.cuda_graph[name] = None
            FullCudaGraphWrapper.result[name] = None
            FullCudaGraphWrapper.curr_iteration[name] = 0
        gc.collect()


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
