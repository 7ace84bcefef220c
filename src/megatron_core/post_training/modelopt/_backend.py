"""The one place that imports NVIDIA Model Optimizer (``nvidia-modelopt``, the ``modelopt`` extra).

Every module of :mod:`megatron_core.post_training.modelopt` reaches Model Optimizer through
:func:`modelopt_modules`, so ``import megatron_core`` (and ``import megatron_core.post_training``)
works without it, and a missing install is reported once, naming the extra to install.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

_INSTALL_HINT = 'pip install "megatron-core-lite[modelopt]" (or pip install "nvidia-modelopt[torch]")'


def modelopt_hf_config_format(what: str = "exporting a quantized Hugging Face checkpoint") -> Any:
    """Model Optimizer's ``modelopt.torch.export.convert_hf_config`` (the unified checkpoint's config format)."""
    modelopt_modules(what)
    return importlib.import_module("modelopt.torch.export.convert_hf_config")


def modelopt_export_helpers(what: str = "exporting a quantized Hugging Face checkpoint") -> SimpleNamespace:
    """Model Optimizer's export helpers: ``quant_utils`` (``modelopt.torch.export.quant_utils``: packing and
    scales) and ``NVFP4QTensor`` (NVFP4 block scales)."""
    modelopt_modules(what)
    qtensor = importlib.import_module("modelopt.torch.quantization.qtensor")
    return SimpleNamespace(quant_utils=importlib.import_module("modelopt.torch.export.quant_utils"),
                           NVFP4QTensor=qtensor.NVFP4QTensor)


def modelopt_distill(what: str = "knowledge distillation") -> Any:
    """Model Optimizer's ``modelopt.torch.distill`` (``mtd``), or ``ImportError`` naming the extra to install."""
    modelopt_modules(what)
    return importlib.import_module("modelopt.torch.distill")


def _import_failure(what: str, err: ImportError) -> str:
    """The message for a failed import of Model Optimizer: not installed, or installed without a module it needs."""
    missing = getattr(err, "name", None) or ""
    if missing == "modelopt" or missing.startswith("modelopt."):
        return f"{what} needs NVIDIA Model Optimizer, which is not installed: {_INSTALL_HINT}"
    return (f"{what} needs NVIDIA Model Optimizer, which is installed but failed to import ({type(err).__name__}: "
            f"{err}); install what it needs: {_INSTALL_HINT}")


def modelopt_modules(what: str = "post-training quantization") -> SimpleNamespace:
    """Model Optimizer's modules used here, or ``ImportError`` saying that ``what`` needs ``nvidia-modelopt``.

    Fields: ``mtq`` (``modelopt.torch.quantization``), ``mto`` (``modelopt.torch.opt``), ``version``,
    ``nn`` (its quantized modules and ``TensorQuantizer``), ``custom`` (its plugin base classes for
    parallel linear layers), ``distributed`` (its ``ParallelState``), ``dynamic`` (``DynamicModule``),
    ``calib`` (its calibration algorithms, ``model_calib``).
    """
    try:
        modelopt = importlib.import_module("modelopt")
        mtq = importlib.import_module("modelopt.torch.quantization")
    except ImportError as err:
        raise ImportError(_import_failure(what, err)) from err
    return SimpleNamespace(
        version=modelopt.__version__,
        mtq=mtq,
        mto=importlib.import_module("modelopt.torch.opt"),
        nn=importlib.import_module("modelopt.torch.quantization.nn"),
        custom=importlib.import_module("modelopt.torch.quantization.plugins.custom"),
        distributed=importlib.import_module("modelopt.torch.utils.distributed"),
        dynamic=importlib.import_module("modelopt.torch.opt.dynamic"),
        quant_linear=importlib.import_module("modelopt.torch.quantization.nn.modules.quant_linear"),
        calib=importlib.import_module("modelopt.torch.quantization.model_calib"),
    )
