r"""muP's per-parameter optimizer settings: :func:`get_mup_config_overrides` (Megatron-Core 0.19's rules).

Parameters fall in two classes. *Vector-like*: the embedding class (tagged ``is_embedding_parameter`` by
``LanguageModule`` under ``use_mup``: every embedding table and the output layer; a ``shared_embedding`` copy;
untagged parameters whose name contains ``embedding``) and every parameter of at most one dimension.
*Hidden*: the other (matrix) parameters. With width multiplier ``m``:

- Adam: hidden parameters get ``max_lr / m``, ``min_lr / m`` and ``eps = adam_eps / m``.
- SGD: vector-like parameters get ``max_lr * m`` and ``min_lr * m``; hidden ones keep the base values.
- any other optimizer name: hidden parameters get ``max_lr / m`` and ``min_lr / m`` (no ``eps``); with a
  Muon-type name the 2-D non-embedding/output matrices, which Muon itself scales, are left out.

With ``decoupled_lr`` the embedding and output weights keep their decoupled learning rate (muP's lr
overrides skip them). ``m = 1`` gives no overrides. Merge the result into the standard overrides:
``{**get_standard_config_overrides(config), **get_mup_config_overrides(config, model_config.mup_width_mult)}``.
"""

from __future__ import annotations

import logging
import math

import torch

from megatron_core._rank_utils import log_single_rank
from megatron_core.optimizer.optimizer_config import OptimizerConfig
from megatron_core.optimizer.param_keys import ParamKey, ParamWithNamePredicate
from megatron_core.optimizer_param_scheduler import ParamGroupOverride

__all__ = ["get_mup_config_overrides", "is_mup_vector_like_parameter"]

logger = logging.getLogger(__name__)


def _is_embedding_class(param: torch.nn.Parameter, name: str) -> bool:
    if getattr(param, "shared_embedding", False):
        return True
    if hasattr(param, "is_embedding_parameter"):
        return bool(param.is_embedding_parameter)
    return "embedding" in name.lower()


def is_mup_vector_like_parameter(param: torch.nn.Parameter, name: str) -> bool:
    """Whether muP treats ``param`` (named ``name``) as vector-like: the embedding class or at most 1-D."""
    return _is_embedding_class(param, name) or param.dim() <= 1


def _is_muon_matrix(param: torch.nn.Parameter) -> bool:
    """A matrix a layer-wise (Muon) optimizer scales itself: 2-D and not an embedding/output weight."""
    return param.dim() == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


def _warn(config: OptimizerConfig, is_adam: bool, is_muon: bool) -> None:
    if config.decoupled_lr is not None:
        message = ("decoupled_lr and muP's learning-rate scaling are both on: the embedding and output weights keep "
                   "decoupled_lr and muP does not rescale them.")
        if is_adam:
            message += " muP's Adam eps scaling still applies to the hidden matrices."
        log_single_rank(logger, logging.WARNING, message)
    if is_muon and getattr(config, "muon_scale_mode", "spectral") == "spectral":
        log_single_rank(logger, logging.WARNING,
                        "muP with muon_scale_mode='spectral': the matrices Muon manages keep its spectral scaling; "
                        "use muon_scale_mode='unit_rms_norm' for muP scaling of them.")


def _scaled(config: OptimizerConfig, mult: float) -> ParamGroupOverride:
    override = ParamGroupOverride()
    if config.lr is not None:
        override["max_lr"] = config.lr * mult
    if config.min_lr is not None:
        override["min_lr"] = config.min_lr * mult
    return override


def get_mup_config_overrides(config: OptimizerConfig, mup_width_mult: float,
                             optimizer_type: str = "adam") -> dict[ParamKey, ParamGroupOverride]:
    """muP's ``config_overrides`` for width multiplier ``mup_width_mult`` (usually the model config's) and the
    optimizer named ``optimizer_type`` (see the module docstring); ``{}`` when ``mup_width_mult == 1``."""
    if (isinstance(mup_width_mult, bool) or not isinstance(mup_width_mult, (int, float))
            or not math.isfinite(mup_width_mult) or mup_width_mult <= 0):
        raise ValueError(f"mup_width_mult ({mup_width_mult!r}) must be a finite number > 0 "
                         "(hidden_size / mup_base_hidden_size)")
    kind = optimizer_type.lower()
    is_sgd, is_adam, is_muon = kind == "sgd", "adam" in kind, "muon" in kind
    decoupled = config.decoupled_lr is not None
    _warn(config, is_adam, is_muon)
    if mup_width_mult == 1.0:
        return {}

    def keeps_decoupled_lr(param: torch.nn.Parameter) -> bool:
        return decoupled and getattr(param, "is_embedding_or_output_parameter", False)

    def hidden_lr(param: torch.nn.Parameter, name: str) -> bool:
        if keeps_decoupled_lr(param) or (is_muon and _is_muon_matrix(param)):
            return False
        return not is_mup_vector_like_parameter(param, name)

    def hidden(param: torch.nn.Parameter, name: str) -> bool:
        return not is_mup_vector_like_parameter(param, name) and not (is_muon and _is_muon_matrix(param))

    def vector_like_lr(param: torch.nn.Parameter, name: str) -> bool:
        return not keeps_decoupled_lr(param) and is_mup_vector_like_parameter(param, name)

    overrides: dict[ParamKey, ParamGroupOverride] = {}
    if is_sgd:
        lr = _scaled(config, mup_width_mult)
        if lr:
            predicate = ParamWithNamePredicate(name="mup_sgd_vector_like_excluding_embedding_output",
                                               fn=vector_like_lr)
            overrides[ParamKey(with_name_predicate=predicate)] = lr
        return overrides
    lr = _scaled(config, 1.0 / mup_width_mult)
    eps = ParamGroupOverride()
    if is_adam and config.adam_eps is not None:
        eps["eps"] = config.adam_eps * (1.0 / mup_width_mult)  # type: ignore[typeddict-unknown-key]
    if decoupled:
        if lr:
            predicate = ParamWithNamePredicate(name="mup_hidden_only_excluding_embedding_output", fn=hidden_lr)
            overrides[ParamKey(with_name_predicate=predicate)] = lr
        if eps:
            overrides[ParamKey(with_name_predicate=ParamWithNamePredicate(name="mup_hidden_only_for_adam_eps",
                                                                          fn=hidden))] = eps
    elif lr or eps:
        overrides[ParamKey(with_name_predicate=ParamWithNamePredicate(name="mup_hidden_and_output",
                                                                      fn=hidden))] = {**lr, **eps}
    return overrides
