"""Token sampling from logits: the ``Sampling`` backend interface and its PyTorch backend."""

from megatron_core.inference.sampling.base import Sampling
from megatron_core.inference.sampling.torch_sampling import TorchSampling, filter_logits, sample_from_logits

__all__ = ["Sampling", "TorchSampling", "filter_logits", "sample_from_logits"]
