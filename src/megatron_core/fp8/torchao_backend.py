"""torchao float8 training as the FP8 backend when Transformer Engine is absent (imported lazily).

Maps Megatron-Core's FP8 config fields onto torchao's ``Float8LinearConfig``:
``fp8_recipe='tensorwise'`` is torchao's dynamic per-tensor recipe and ``'rowwise'`` its dynamic
row-wise recipe (e4m3 everywhere, power-of-two scales); ``fp8='e4m3'`` casts the output gradient
to e4m3 as well, ``'hybrid'`` keeps e5m2 for it (tensorwise only: the rowwise recipe is e4m3 by
design). Both recipes compute scales from the current tensors, so there is no amax history and no
scaling state to checkpoint: ``fp8_amax_history_len`` and ``fp8_margin`` must keep their defaults.
:func:`check_fp8_config` also accepts ``'delayed'``, which this library implements itself
(:mod:`megatron_core.fp8.delayed_scaling`); ``'blockwise'``, ``'mxfp8'`` and ``'custom'`` raise (they
need Transformer Engine). ``fp8_param`` (FP8 weights, :mod:`megatron_core.distributed.fp8_params`) is accepted with
``'tensorwise'`` only. ``fp8_wgrad=False`` is refused for torchao's recipes (their dense GEMMs) but accepted with
``'delayed'`` and with ``fp8_param``, whose GEMMs are this library's.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Any

import torch

from megatron_core.distributed.fp8_params import FP8_PARAM_RECIPES
from megatron_core.fp8.delayed_scaling import check_delayed_config

TORCHAO_RECIPES = ("tensorwise", "rowwise")
DELAYED_RECIPE = "delayed"
MIN_CAPABILITY = (8, 9)


def import_torchao_float8() -> Any:
    """``torchao.float8``, or an ``ImportError`` naming the ``torchao`` package."""
    try:
        return importlib.import_module("torchao.float8")
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("FP8 training without Transformer Engine needs torchao (pip install 'megatron-core-lite[fp8]', i.e. torchao>=0.14): "
                          f"{err}") from err


def check_fp8_device(config: Any, device: torch.device | str) -> None:
    """Raise ``ValueError`` naming ``fp8`` and the device unless it has FP8 tensor cores (CUDA, CC >= 8.9)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"fp8={config.fp8!r} needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9); "
                         f"the model is on {device}")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"fp8={config.fp8!r} needs FP8 tensor cores (compute capability >= 8.9); {name} ({device}) "
                         f"has compute capability {capability[0]}.{capability[1]}")


def check_fp8_config(config: Any) -> None:
    """Reject FP8 settings this library cannot honour without Transformer Engine (``ValueError`` naming
    the field): torchao's dynamic recipes, or ``'delayed'`` (:mod:`megatron_core.fp8.delayed_scaling`)."""
    if config.fp8 not in ("e4m3", "hybrid"):
        raise ValueError(f"fp8 ({config.fp8!r}) must be 'e4m3' or 'hybrid'")
    if getattr(config, "fp8_param", False) and config.fp8_recipe not in FP8_PARAM_RECIPES:
        raise ValueError(f"fp8_param=True (FP8 weights) without Transformer Engine needs fp8_recipe in "
                         f"{FP8_PARAM_RECIPES}; got fp8_recipe={config.fp8_recipe!r}")
    if config.fp8_recipe == DELAYED_RECIPE:
        check_delayed_config(config)
        return
    if config.fp8_recipe not in TORCHAO_RECIPES:
        raise ValueError(f"fp8_recipe ({config.fp8_recipe!r}) needs Transformer Engine; without it the supported "
                         f"recipes are {(DELAYED_RECIPE, *TORCHAO_RECIPES)}")
    if config.fp8 == "hybrid" and config.fp8_recipe == "rowwise":
        raise ValueError("fp8='hybrid' (e5m2 gradients) is not available with fp8_recipe='rowwise' (e4m3 only); "
                         "use fp8='e4m3'")
    if config.fp8_amax_history_len != 1 or config.fp8_margin != 0:
        raise ValueError(f"fp8_amax_history_len ({config.fp8_amax_history_len}) and fp8_margin ({config.fp8_margin}) "
                         "belong to delayed scaling; torchao's dynamic recipes need 1 and 0")
    if not getattr(config, "fp8_wgrad", True) and not getattr(config, "fp8_param", False):
        raise ValueError(f"fp8_wgrad=False is not supported by the torchao backend (fp8_recipe="
                         f"{config.fp8_recipe!r} with fp8_param=False); use fp8_recipe='delayed' or fp8_param=True")


def float8_linear_config(config: Any, emulate: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` for ``config`` (``emulate``: fp32 matmuls, for CPU tests)."""
    check_fp8_config(config)
    float8 = import_torchao_float8()
    cfg = float8.Float8LinearConfig.from_recipe_name(config.fp8_recipe)
    if config.fp8 == "e4m3" and config.fp8_recipe == "tensorwise":
        e4m3 = replace(cfg.cast_config_grad_output, target_dtype=torch.float8_e4m3fn)
        cfg = replace(cfg, cast_config_grad_output=e4m3, cast_config_grad_output_for_grad_weight=e4m3)
    if emulate:
        cfg = replace(cfg, emulate=True)
    return cfg


def linear_mm_config(float8_config: Any) -> Any:
    """The per-GEMM settings torchao's ``Float8Linear`` derives from ``float8_config`` (taken from one)."""
    import_torchao_float8()
    from torchao.float8.float8_linear import Float8Linear

    with torch.device("meta"):
        probe = torch.nn.Linear(16, 16, bias=False)
    return Float8Linear.from_float(probe, config=float8_config).linear_mm_config


def float8_matmul(input_: torch.Tensor, weight: torch.Tensor, float8_config: Any, mm_config: Any) -> torch.Tensor:
    """``input_ @ weight.T`` with inputs, weight and output gradient cast to float8 (torchao's autograd op)."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    return matmul_with_hp_or_float8_args.apply(input_, weight.t(), mm_config, float8_config)
