"""Optimizer CPU offloading (Megatron-Core's ``megatron.core.optimizer.cpu_offloading``).

:class:`HybridDeviceOptimizer` updates a chosen fraction of the parameters with a CPU optimizer on host
copies and the rest with a device optimizer, behind one ``torch.optim.Optimizer`` interface.
"""

from megatron_core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

__all__ = ["HybridDeviceOptimizer"]
