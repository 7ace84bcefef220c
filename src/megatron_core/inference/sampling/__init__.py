"""Token sampling from logits."""

from megatron_core.inference.sampling.torch_sampling import TorchSampling, filter_logits, sample_from_logits

__all__ = ["TorchSampling", "filter_logits", "sample_from_logits"]
