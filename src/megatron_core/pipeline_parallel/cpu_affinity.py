"""Pin this process to the CPUs nearest its GPU (Megatron-Core's ``set_ideal_affinity_for_current_gpu``).

Host-device copies (activation offloading, pinned-memory transfers) are fastest from the CPUs of the
GPU's own NUMA node. NVML names them; this module applies that set with ``os.sched_setaffinity``,
which on Linux binds the calling thread, as NVML's own ``nvmlDeviceSetCpuAffinity`` does. It needs
a CUDA device and ``nvidia-ml-py``; without either it raises, as Megatron-Core does.
"""

from __future__ import annotations

import logging
import os

from megatron_core._nvml import ideal_cpu_set, open_current_device
from megatron_core._rank_utils import log_single_rank

__all__ = ["set_ideal_affinity_for_current_gpu"]

logger = logging.getLogger(__name__)


def set_ideal_affinity_for_current_gpu() -> set[int]:
    """Bind this process's thread to the CPUs NVML reports as closest to the current CUDA device.

    Returns the CPU set applied. Raises ``ImportError`` without ``nvidia-ml-py``, ``RuntimeError``
    without a CUDA device or NVIDIA driver, or when NVML reports no CPU for the device.
    """
    what = "set_ideal_affinity_for_current_gpu"
    nvml, handle = open_current_device(what)
    try:
        cpus = ideal_cpu_set(nvml, handle)
    finally:
        nvml.nvmlShutdown()
    if not cpus:
        raise RuntimeError(f"{what}: NVML reports no CPU affinity for the current GPU")
    os.sched_setaffinity(0, cpus)
    log_single_rank(logger, logging.WARNING,
                    "Set CPU affinity of each rank to its GPU's nearest CPUs for host-device transfers")
    return cpus
