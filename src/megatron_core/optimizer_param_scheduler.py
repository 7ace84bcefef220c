"""``OptimizerParamScheduler``: learning-rate warmup and decay, and weight-decay increment (Megatron-Core's).

``step(increment)`` advances ``num_steps`` (Megatron-LM counts samples when it trains by samples)
and writes ``lr = get_lr(group) * lr_mult`` and ``weight_decay = get_wd(group) * wd_mult`` into
every param group. Groups may carry their own ``max_lr``/``min_lr``/``start_wd``/``end_wd``.
Decay styles: constant, linear, cosine, inverse-square-root and WSD (warmup-stable-decay, whose
anneal is linear, cosine, exponential or minus_sqrt).
"""

from __future__ import annotations

import math
from typing import Any, TypedDict

_LR_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
_WD_STYLES = ("constant", "linear", "cosine")


class ParamGroupOverride(TypedDict, total=False):
    """Values that replace a param group's defaults for the parameters a ``ParamKey`` selects.

    The scheduler reads ``max_lr``, ``min_lr``, ``start_wd``, ``end_wd``, ``lr_mult`` and ``wd_mult`` from each
    group; the inner optimizer reads per-group hyper-parameters such as ``eps`` or ``betas``. ``optimizer`` may
    only repeat ``OptimizerConfig.optimizer``.
    """

    max_lr: float
    min_lr: float
    start_wd: float
    end_wd: float
    wd_mult: float
    optimizer: str


def param_group_override_to_tuple(param_group_override: ParamGroupOverride | None
                                  ) -> tuple[tuple[str, Any], ...] | None:
    """The override as a hashable tuple of its items sorted by key (``None`` stays ``None``)."""
    if param_group_override is None:
        return None
    return tuple(sorted(param_group_override.items()))


def combine_param_group_overrides(param_group_overrides: list[ParamGroupOverride | None]) -> ParamGroupOverride:
    """One override holding every key of ``param_group_overrides``; ``ValueError`` when two give one key two values."""
    combined = ParamGroupOverride()
    for override in param_group_overrides:
        for key, value in (override or {}).items():
            if key in combined and combined[key] != value:
                raise ValueError(f"conflicting param group overrides for {key!r}: {combined[key]!r} and {value!r} "
                                 "(two ParamKeys that match one parameter must agree)")
            combined[key] = value
    return combined


class OptimizerParamScheduler:
    """Set learning rate and weight decay of an optimizer's param groups as a function of the step."""

    def __init__(self, optimizer: Any, init_lr: float, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str, start_wd: float, end_wd: float, wd_incr_steps: int,
                 wd_incr_style: str, use_checkpoint_opt_param_scheduler: bool = True,
                 override_opt_param_scheduler: bool = False, wsd_decay_steps: int | None = None,
                 lr_wsd_decay_style: str | None = None) -> None:
        self.optimizer = optimizer
        self.init_lr = float(init_lr)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ValueError(f"need 0 <= min_lr ({self.min_lr}) <= max_lr ({self.max_lr})")
        if self.init_lr > self.max_lr:
            raise ValueError(f"init_lr ({self.init_lr}) must be <= max_lr ({self.max_lr})")
        if lr_decay_steps <= 0:
            raise ValueError(f"lr_decay_steps ({lr_decay_steps}) must be > 0")
        if lr_warmup_steps < 0 or lr_warmup_steps >= lr_decay_steps:
            raise ValueError(f"lr_warmup_steps ({lr_warmup_steps}) must be in [0, lr_decay_steps ({lr_decay_steps}))")
        if lr_decay_style not in _LR_STYLES:
            raise ValueError(f"lr_decay_style ({lr_decay_style!r}) must be one of {_LR_STYLES}")
        if lr_decay_style == "WSD":
            if wsd_decay_steps is None or not 0 < wsd_decay_steps <= lr_decay_steps:
                raise ValueError(
                    f"WSD needs 0 < wsd_decay_steps ({wsd_decay_steps}) <= lr_decay_steps ({lr_decay_steps})"
                )
            if lr_wsd_decay_style not in _WSD_STYLES:
                raise ValueError(f"lr_wsd_decay_style ({lr_wsd_decay_style!r}) must be one of {_WSD_STYLES}")
        if wd_incr_style not in _WD_STYLES:
            raise ValueError(f"wd_incr_style ({wd_incr_style!r}) must be one of {_WD_STYLES}")
        if not 0.0 <= start_wd <= end_wd:
            raise ValueError(f"need 0 <= start_wd ({start_wd}) <= end_wd ({end_wd})")
        if wd_incr_style == "constant" and start_wd != end_wd:
            raise ValueError(f"wd_incr_style 'constant' needs start_wd ({start_wd}) == end_wd ({end_wd})")
        if wd_incr_style != "constant" and wd_incr_steps <= 0:
            raise ValueError(f"wd_incr_steps ({wd_incr_steps}) must be > 0 for wd_incr_style {wd_incr_style!r}")
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise ValueError("override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are exclusive")
        self.lr_warmup_steps = lr_warmup_steps
        self.num_steps = 0
        self.lr_decay_steps = lr_decay_steps
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.lr_decay_style = lr_decay_style
        self.start_wd = float(start_wd)
        self.end_wd = float(end_wd)
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.step(0)

    def get_wd(self, param_group: dict[str, Any] | None = None) -> float:
        """Weight decay at the current step (before the group's ``wd_mult``)."""
        group = param_group or {}
        start_wd, end_wd = group.get("start_wd", self.start_wd), group.get("end_wd", self.end_wd)
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return end_wd
        ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return start_wd + coeff * (end_wd - start_wd)

    def _wsd_coeff(self) -> float:
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if self.num_steps <= anneal_start:
            return 1.0
        ratio = (self.num_steps - anneal_start) / self.wsd_decay_steps
        if self.lr_wsd_decay_style == "linear":
            return 1.0 - ratio
        if self.lr_wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.lr_wsd_decay_style == "exponential":
            return 2.0 * math.pow(0.5, ratio) - 1.0
        return 1.0 - math.sqrt(ratio)

    def get_lr(self, param_group: dict[str, Any] | None = None) -> float:
        """Learning rate at the current step (before the group's ``lr_mult``)."""
        group = param_group or {}
        max_lr = group.get("max_lr", self.max_lr)
        min_lr = group.get("min_lr", self.min_lr)
        if max_lr is None:
            max_lr = self.max_lr
        if min_lr is None:
            min_lr = self.min_lr
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * self.num_steps / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup = max(self.lr_warmup_steps, 1)
            return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(max(self.num_steps, 1)))
        ratio = (self.num_steps - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = self._wsd_coeff()
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> None:
        """Advance by ``increment`` steps and write lr / weight_decay into every param group."""
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.get_wd(group) * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict[str, Any]:
        """Megatron-Core's keys: max_lr, lr_warmup_steps, num_steps, lr_decay_style, ... wd_incr_steps."""
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, cls_value: Any, sd_value: Any, name: str) -> Any:
        """Pick the class or the checkpoint value according to the override / use-checkpoint flags."""
        if self.override_opt_param_scheduler:
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ValueError(
                f"OptimizerParamScheduler: class input value {cls_value} and checkpoint value {sd_value} for "
                f"{name} do not match"
            )
        return sd_value

    @staticmethod
    def _first(state_dict: dict[str, Any], *keys: str) -> Any:
        for key in keys:
            if key in state_dict:
                return state_dict[key]
        raise KeyError(f"scheduler state dict has none of {keys}")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; legacy key names (start_lr, warmup_iter, end_iter, ...) work too."""
        sd = state_dict
        self.max_lr = self._check_and_set(self.max_lr, self._first(sd, "max_lr", "start_lr"), "learning rate")
        self.min_lr = self._check_and_set(self.min_lr, sd["min_lr"], "minimum learning rate")
        self.lr_warmup_steps = self._check_and_set(
            self.lr_warmup_steps, self._first(sd, "lr_warmup_steps", "warmup_steps", "warmup_iter"), "warmup iterations"
        )
        self.lr_decay_steps = self._check_and_set(
            self.lr_decay_steps, self._first(sd, "lr_decay_steps", "decay_steps", "end_iter"), "total number of iterations"
        )
        self.lr_decay_style = self._check_and_set(
            self.lr_decay_style, self._first(sd, "lr_decay_style", "decay_style"), "learning rate decay style"
        )
        if "start_wd" in sd:
            self.start_wd = self._check_and_set(self.start_wd, sd["start_wd"], "start weight decay")
            self.end_wd = self._check_and_set(self.end_wd, sd["end_wd"], "end weight decay")
            self.wd_incr_steps = self._check_and_set(self.wd_incr_steps, sd["wd_incr_steps"],
                                                     "total number of weight decay iterations")
            self.wd_incr_style = self._check_and_set(self.wd_incr_style, sd["wd_incr_style"],
                                                     "weight decay incr style")
        self.num_steps = 0
        self.step(self._first(sd, "num_steps", "num_iters"))


def get_canonical_lr_for_logging(param_groups: list[dict]) -> float | None:
    """The learning rate to log: that of the first param group marked ``default_config=True`` (None if none is).

    Every such group follows the one default schedule, so the first is representative.
    """
    for group in param_groups:
        if group.get("default_config", False):
            return group.get("lr")
    return None
