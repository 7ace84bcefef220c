"""Integration with NVIDIA Model Optimizer (Megatron-Core's ``post_training.modelopt``).

Model Optimizer (``nvidia-modelopt``, the ``modelopt`` extra) quantizes, prunes and distils models for
inference; here it quantizes models built from this library's layers. :func:`register_quant_modules`
registers those layers with its quantization, after which ``modelopt.torch.quantization.quantize``
works on this library's ``GPTModel`` as it does on Megatron-Core's.
:func:`~.gpt.model_specs.get_gpt_modelopt_spec` builds a model for it (and registers the layers),
:mod:`.checkpointing` saves and restores a quantized model through ``dist_checkpointing``,
:mod:`.recipes` resolves quantization configs by name, :mod:`.calibration_loop` calibrates on this
library's datasets, and :mod:`.hf_export` writes a quantized model as a Hugging Face checkpoint in
Model Optimizer's unified format. :mod:`.qat` continues training a quantized model (quantization-aware
training); :mod:`.distillation` (with :mod:`.distillation_losses`, the tensor-parallel logit KL and
intermediate losses, and :mod:`.distillation_pipeline`) trains a student against a frozen teacher through
Model Optimizer's ``modelopt.torch.distill``. :mod:`.pruning` (with :mod:`.pruning_importance`) prunes a GPT the Minitron
way, with the arguments of Model Optimizer's ``mtp.prune`` but without Model Optimizer.

Importing this package does not import Model Optimizer; :mod:`._backend` does, when a function needs it.
"""

from __future__ import annotations

__all__ = ["register_quant_modules"]


def register_quant_modules() -> list[str]:
    """Register our linear layers, MoE experts (:mod:`.quant_moe`), attention (:mod:`.quant_attention`), MLP layout.

    Idempotent; returns the names of the registered quantized classes. ``ImportError`` naming the
    ``modelopt`` extra when Model Optimizer is not installed.
    """
    from megatron_core.post_training.modelopt import quant_attention, quant_modules, quant_moe

    return list(quant_modules.__all__) + [name for m in (quant_moe, quant_attention) for name in m.__all__
                                          if name.startswith("Quant")]
