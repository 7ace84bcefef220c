"""FP8 training in ``pretrain_gpt.py``: Megatron-LM's flags, their rules, the config fields and the conversion.

Megatron-LM builds Transformer Engine's FP8 layers from ``--fp8-format``; this library converts the built model's
linear layers (``megatron_core.fp8.convert_to_float8``) before it is wrapped in DDP and compiled. On the CPU the
float8 rounding is emulated in fp32 (for tests; the CPU has no FP8 GEMMs), on a GPU it needs FP8 tensor cores.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from megatron_core.distributed.fp8_params import FP8_PARAM_RECIPES
from megatron_core.fp8 import convert_to_float8

__all__ = ["add_fp8_arguments", "convert_model_to_fp8", "fp8_config_fields", "validate_fp8_args"]


def add_fp8_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's FP8 flags (names, defaults and meaning)."""
    g = parser.add_argument_group("FP8 (the linear layers' GEMMs in float8)")
    g.add_argument("--fp8-format", dest="fp8", choices=["e4m3", "hybrid"], default=None,
                   help="e4m3 everywhere, or hybrid (e4m3 forward, e5m2 gradients); unset: no FP8")
    g.add_argument("--fp8-recipe", choices=["tensorwise", "delayed", "rowwise", "mxfp8", "blockwise"],
                   default="delayed", help="scaling: tensorwise (current scaling, per tensor), delayed (amax "
                   "history) or rowwise; mxfp8 and blockwise need Transformer Engine and are refused by name")
    g.add_argument("--fp8-margin", type=int, default=0, help="delayed scaling: the scale's margin (powers of 2)")
    g.add_argument("--fp8-interval", type=int, default=1, help="accepted for Megatron-LM compatibility (deprecated)")
    g.add_argument("--fp8-amax-history-len", type=int, default=1, help="delayed scaling: amaxes kept per tensor")
    g.add_argument("--fp8-amax-compute-algo", choices=["most_recent", "max"], default="most_recent",
                   help="delayed scaling: the amax a scale is derived from")
    g.add_argument("--no-fp8-wgrad", dest="fp8_wgrad", action="store_false",
                   help="compute the weight gradients in high precision")
    g.add_argument("--fp8-param-gather", action="store_true",
                   help="keep the linear weights as FP8 parameters and all-gather their bytes (needs "
                        "--use-distributed-optimizer and --fp8-recipe tensorwise)")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="keep the first and last transformer layers in high precision")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1)
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1)


def validate_fp8_args(args: argparse.Namespace, require: Any) -> None:
    """The flag rules FP8 adds; ``require(condition, message)`` raises the parser's error (the library's own
    ``fp8_param`` rules, ``check_fp8_config`` and ``DistributedDataParallelConfig``, checked here by flag name).

    Runs before the device defaults. torchao's FP8 GEMMs return their weight gradients, so without
    ``--fp8-param-gather`` the fused weight-gradient GEMM is off by default and refused when asked for. With FP8
    parameters it keeps its device default, as in Megatron-LM with Transformer Engine: the FP8 layers add their
    gradients to ``main_grad`` themselves, the high-precision ones (embedding, output layer, norms, bf16 layers)
    through the fused path."""
    if args.fp8 is None:
        require(not args.fp8_param_gather, "--fp8-param-gather needs --fp8-format")
        return
    if args.fp8_param_gather:
        require(args.fp8_recipe in FP8_PARAM_RECIPES,
                f"--fp8-param-gather needs --fp8-recipe {' or '.join(FP8_PARAM_RECIPES)} (got --fp8-recipe "
                f"{args.fp8_recipe}): without Transformer Engine, FP8 weights take current per-tensor scaling only")
        require(args.use_distributed_optimizer,
                "--fp8-param-gather needs --use-distributed-optimizer (the FP8 weights keep no high-precision copy; "
                "the distributed optimizer updates their fp32 main params and all-gathers the bytes)")
        return
    require(not args.gradient_accumulation_fusion,
            "--gradient-accumulation-fusion with --fp8-format needs --fp8-param-gather (torchao's FP8 GEMMs "
            "compute the weight gradients themselves)")
    args.gradient_accumulation_fusion = False


def fp8_config_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``TransformerConfig`` FP8 fields the flags set."""
    return dict(fp8=args.fp8, fp8_recipe=args.fp8_recipe, fp8_margin=args.fp8_margin, fp8_interval=args.fp8_interval,
                fp8_amax_history_len=args.fp8_amax_history_len, fp8_amax_compute_algo=args.fp8_amax_compute_algo,
                fp8_wgrad=args.fp8_wgrad, fp8_param=args.fp8_param_gather,
                first_last_layers_bf16=args.first_last_layers_bf16,
                num_layers_at_start_in_bf16=args.num_layers_at_start_in_bf16,
                num_layers_at_end_in_bf16=args.num_layers_at_end_in_bf16)


def convert_model_to_fp8(model: torch.nn.Module, device: torch.device) -> list[str]:
    """Move ``model`` to ``device`` and switch its transformer layers' linear layers to float8 GEMMs (emulated in
    fp32 on the CPU); returns the converted layers' names. Call before DDP and before compiling."""
    model.to(device)
    return convert_to_float8(model, emulate=device.type == "cpu")
