"""Which device and which collective backend this process uses.

The rest of the library asks this module instead of calling ``torch.cuda`` directly, so that
every feature runs on CPU with gloo (fp32) as well as on CUDA with NCCL.
"""

from __future__ import annotations

import torch


def cuda_available() -> bool:
    """True when a CUDA device can be used by this process."""
    return torch.cuda.is_available()


def backend_for_device(device: torch.device | str) -> str:
    """The ``torch.distributed`` backend that suits tensors on ``device``."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def get_current_device() -> torch.device:
    """The device new tensors go to.

    When a process group is initialised with NCCL (or any GPU backend), this is the current CUDA
    device; with gloo, or without a process group, it is the CPU unless CUDA is available and
    no process group says otherwise.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "gloo":
            return torch.device("cpu")
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if cuda_available() else "gloo"


def synchronize() -> None:
    """Wait for the current device to finish its queued work (a no-op on CPU)."""
    if get_current_device().type == "cuda":
        torch.cuda.synchronize()


def is_capturing(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s CUDA stream is being captured into a CUDA graph (never on other devices): while it is,
    nothing may read device values on the host."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def manual_seed_device(seed: int) -> None:
    """Seed the accelerator's default generator, if there is one."""
    if cuda_available():
        torch.cuda.manual_seed(seed)


def get_device_rng_state() -> torch.Tensor | None:
    """The accelerator's RNG state for the current device, or ``None`` on CPU."""
    if get_current_device().type == "cuda":
        return torch.cuda.get_rng_state()
    return None


def set_device_rng_state(state: torch.Tensor | None) -> None:
    """Restore an RNG state taken by :func:`get_device_rng_state`."""
    if state is not None and get_current_device().type == "cuda":
        torch.cuda.set_rng_state(state)


def max_memory_allocated() -> int:
    """Peak bytes allocated on the current CUDA device, 0 on CPU."""
    if get_current_device().type == "cuda":
        return torch.cuda.max_memory_allocated()
    return 0


def get_device_name() -> str:
    """The current CUDA device's name (e.g. ``NVIDIA H100 80GB HBM3``), ``cpu`` without CUDA."""
    if get_current_device().type == "cuda":
        return torch.cuda.get_device_name()
    return "cpu"


def nvtx_range_push(message: str) -> None:
    """Open an NVTX range named ``message`` on CUDA (a no-op without CUDA)."""
    if cuda_available():
        torch.cuda.nvtx.range_push(message)


def nvtx_range_pop() -> None:
    """Close the innermost NVTX range on CUDA (a no-op without CUDA)."""
    if cuda_available():
        torch.cuda.nvtx.range_pop()
