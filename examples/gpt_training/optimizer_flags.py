"""The optimizer-state precision flags of ``pretrain_gpt.py`` (``--use-precision-aware-optimizer`` and the four
``--*-dtype`` flags): Megatron-Core's rules, refused by the flags' names.

``OptimizerConfig`` refuses the same settings by field name (``use_precision_aware_optimizer``, ``exp_avg_dtype``)
when the optimizer is built; checking the flags first names what the user typed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["validate_optimizer_precision_args"]

_DTYPE_FLAGS = ("--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype")
_MAIN_DTYPES = ("fp32", "bf16")  # the main params (and the gradients handed to the update) have no fp16 form


def _value(args: argparse.Namespace, flag: str) -> str:
    return getattr(args, flag[2:].replace("-", "_"))


def validate_optimizer_precision_args(args: argparse.Namespace, require: Callable[[bool, str], None]) -> None:
    """The precision-aware optimizer's rules; ``require(condition, message)`` raises the parser's error."""
    if not args.use_precision_aware_optimizer:
        lowered = [f"{flag} {_value(args, flag)}" for flag in _DTYPE_FLAGS if _value(args, flag) != "fp32"]
        require(not lowered, f"{', '.join(lowered)} needs --use-precision-aware-optimizer (without it the optimizer "
                "keeps its state in fp32)")
        return
    require(args.optimizer == "adam", f"--use-precision-aware-optimizer needs --optimizer adam (got --optimizer "
            f"{args.optimizer}): the reduced-precision moments are Adam's")
    require(args.use_distributed_optimizer,
            "--use-precision-aware-optimizer needs --use-distributed-optimizer (it updates the optimizer's shards)")
    for flag in _DTYPE_FLAGS[:2]:
        require(_value(args, flag) in _MAIN_DTYPES,
                f"{flag} ({_value(args, flag)}) must be one of {', '.join(_MAIN_DTYPES)}")
    grads, params = (_value(args, flag) for flag in _DTYPE_FLAGS[:2])
    require(grads == params, f"--main-grads-dtype ({grads}) must equal --main-params-dtype ({params}): the gradient "
            "is handed to the update in the main params' dtype")
