"""Functions run on gloo ranks by the ``megatron-convert`` record tests (module level, so the ranks can import them)."""

from __future__ import annotations

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.inference.cli.checkpoint import load_gpt_from_checkpoint
from tests.models.hf.dist_checks import logits_of


def logits_from_record(ckpt: str, tp: int, pp: int = 1) -> torch.Tensor | None:
    """Rebuild the converted checkpoint's model (GPTModel or HybridModel) at (``tp``, ``pp``) from its ``model_config`` record and load
    it, as ``megatron-generate`` does; return the last stage's full-vocabulary logits of the test batch."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    model, _, _ = load_gpt_from_checkpoint(ckpt)
    return logits_of(model)
