"""``MegatronOptimizer``, the base of every optimizer wrapper, and the helpers it and its subclasses share.

See :mod:`megatron_core.optimizer.optimizer` for the step (``prepare_grads`` -> clip -> inner step ->
copy back); ``optimizer.optimizer`` re-exports these names at Megatron-Core's path, and
``ChainedOptimizer`` builds on this module alone.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_core._ground import get_pg_rank
from megatron_core.distributed import collectives
from megatron_core.optimizer.checkpoint_state import (
    ParamStateEntry,
    build_sharded_state,
    local_tensor,
)
from megatron_core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    counts_towards_grad_norm,
    get_grad_norm_fp32,
    grad_norm_tensor,
)
from megatron_core.optimizer.fused_clip import fused_adam_step_with_clipping, supports_fused_clipping
from megatron_core.optimizer.grad_norm_groups import (
    GRAD_NORM_GROUP_ATTR,
    SEPARATE_GRAD_NORM_GROUPS,
    any_rank_has_grad_norm_group,
    in_grad_norm,
    split_by_grad_norm_group,
    validate_grad_norm_group,
)
from megatron_core.optimizer.optimizer_config import OptimizerConfig
from megatron_core.optimizer_param_scheduler import ParamGroupOverride
from megatron_core.process_groups_config import resolve_process_group

logger = logging.getLogger("megatron_core.optimizer.optimizer")  # the logger name of Megatron-Core's module

# Also what Muon reads off a (main) parameter: the expert-TP mark and a fused QKV weight's split.
_MODEL_PARALLEL_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared",
                              GRAD_NORM_GROUP_ATTR, "expert_tp", "is_qkv", "qkv_split_shapes")

def _param_group_override_keys() -> tuple[str, ...]:
    """Every field declared on ``ParamGroupOverride`` (its annotations, whatever the TypedDict's totality), sorted."""
    return tuple(sorted(ParamGroupOverride.__annotations__))


param_group_identifier_keys: tuple[str, ...] = (
    *_param_group_override_keys(),
    "lr_mult",
    "is_expert_parallel",
    "is_decoupled_lr",
)
"""The param-group entries that tell groups apart when a saved optimizer state is matched to the current groups.

Every :class:`~megatron_core.optimizer_param_scheduler.ParamGroupOverride` field (sorted: ``end_wd``,
``max_lr``, ``min_lr``, ``optimizer``, ``start_wd``, ``wd_mult``), then the flags the optimizer sets on
each group itself: ``lr_mult``, ``is_expert_parallel``, ``is_decoupled_lr``. Two groups that agree on
all of these behave alike under the scheduler and the optimizer.
"""


def copy_param_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy the attributes that grad-norm filtering reads (TP-sharded, tied, separate norm group) and Muon reads
    (expert TP, QKV split) from a model param."""
    for name in _MODEL_PARALLEL_ATTRIBUTES:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def copy_optimizer_param_metadata(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy what the optimizer reads off a parameter (``allreduce``, ``shared``, ``grad_norm_group``) onto a view or
    copy of it (Megatron-Core 0.19)."""
    for name in ("allreduce", "shared", GRAD_NORM_GROUP_ATTR):
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def _zero_grad_group(group: list[torch.Tensor], set_to_none: bool) -> None:
    for param in group:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            param.grad.detach_().zero_()


OutcomeCallback = Callable[[torch.Tensor, torch.Tensor], None]
"""``step_on_device``'s ``outcome_known(update_successful, grad_norm)``: called before the update is queued."""


class MegatronOptimizer(ABC):
    """Base of every optimizer wrapper; holds the torch optimizer and the groups for grad statistics."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, config: OptimizerConfig,
                 init_state_fn: Callable[[torch.optim.Optimizer], None] = lambda optimizer: None) -> None:
        self.optimizer = optimizer
        self.config = config
        self.init_state_fn = init_state_fn
        # parallel_state's groups (get_megatron_optimizer sets explicit ones); LOCAL where there is none.
        self.tp_group = collectives.local_if_none(resolve_process_group("tp"))
        self.grad_stats_parallel_group = collectives.local_if_none(resolve_process_group("mp"))

    @contextmanager
    def _timer(self, name: str) -> Iterator[None]:
        timers = self.config.timers
        if timers is None:
            yield
            return
        timers(name, log_level=1).start(barrier=self.config.barrier_with_L1_time)
        try:
            yield
        finally:
            timers(name).stop()

    def get_parameters(self) -> list[torch.Tensor]:
        """The tensors the inner optimizer updates, group by group."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _filter_grads_for_norm(self, params: list[torch.Tensor],
                               param_filter: Callable[[torch.Tensor], bool] | None = None) -> list[torch.Tensor]:
        """The gradients of ``params`` that count towards a norm: those ``param_filter`` keeps (all without one),
        not None, no tied duplicates, no TP-replicated copies off TP rank 0."""
        tp_group = getattr(self, "tp_group", None)
        tp_rank = get_pg_rank(collectives.local_if_none(tp_group if tp_group is not None
                                                        else resolve_process_group("tp")))
        return [p.grad for p in params
                if (param_filter is None or param_filter(p)) and p.grad is not None
                and counts_towards_grad_norm(p, tp_rank)]

    def get_grads_for_grad_norm(self, grad_norm_group: str | None = None) -> list[torch.Tensor]:
        """The gradients of the main norm (``None``: every parameter outside a separate grad-norm group), or of
        the named group (see :mod:`.grad_norm_groups`)."""
        if grad_norm_group is not None:
            validate_grad_norm_group(grad_norm_group)  # raised here even when no parameter is left to filter
        return self._filter_grads_for_norm(self.get_parameters(), lambda p: in_grad_norm(p, grad_norm_group))

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        """The main norm's gradients (:meth:`get_grads_for_grad_norm` without a group)."""
        return self.get_grads_for_grad_norm()

    def has_grad_norm_group(self, grad_norm_group: str) -> bool:
        """Whether any rank of the grad-stats group has parameters tagged ``grad_norm_group``: one collective on
        the first call (every rank calls it at the same point), cached after."""
        cache = self.__dict__.setdefault("_has_grad_norm_group_cache", {})
        if grad_norm_group not in cache:
            cache[grad_norm_group] = any_rank_has_grad_norm_group(self.get_parameters(), grad_norm_group,
                                                                  self.get_grad_stats_parallel_group())
        return cache[grad_norm_group]

    def _has_separate_grad_norm_groups(self) -> bool:
        """Whether any registered separate grad-norm group has parameters on any rank."""
        return any([self.has_grad_norm_group(group) for group in SEPARATE_GRAD_NORM_GROUPS])

    def get_grad_stats_parallel_group(self) -> Any:
        """The group over which gradient norms, zero counts and inf checks are reduced (parallel_state's
        model-parallel group where none was set)."""
        group = getattr(self, "grad_stats_parallel_group", None)
        return group if group is not None else collectives.local_if_none(resolve_process_group("mp"))

    def get_grad_norm(self) -> float:
        """Global L2 norm of the main gradients (those outside separate grad-norm groups)."""
        return get_grad_norm_fp32(self.get_main_grads_for_grad_norm(),
                                  grad_stats_parallel_group=self.get_grad_stats_parallel_group())

    @torch.no_grad()
    def _compute_grad_norms_by_group(self) -> dict[str, float]:
        """``{group: its gradient norm}`` for every separate grad-norm group present (also kept as
        ``self.grad_norms_by_group``)."""
        self.grad_norms_by_group = {
            group: get_grad_norm_fp32(self.get_grads_for_grad_norm(group),
                                      grad_stats_parallel_group=self.get_grad_stats_parallel_group())
            for group in SEPARATE_GRAD_NORM_GROUPS if self.has_grad_norm_group(group)
        }
        return self.grad_norms_by_group

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip the main gradients to global norm ``clip_grad`` and each separate grad-norm group's by its own
        norm; return the main norm before clipping.

        A non-finite main norm leaves the gradients as they are (``step`` then skips the update).
        """
        # get_grad_norm's value, from its parts: Megatron-Core's tests bind this method onto objects that have
        # only get_grads_for_grad_norm and get_grad_stats_parallel_group.
        grad_norm = get_grad_norm_fp32(self.get_grads_for_grad_norm(),
                                       grad_stats_parallel_group=self.get_grad_stats_parallel_group())
        self.grad_norms_by_group = {}
        if clip_grad > 0.0:
            self._compute_grad_norms_by_group()  # on every rank, before any early return: the same collectives
        if math.isfinite(grad_norm):
            clip_by_group_norms(self.get_parameters(), clip_grad, grad_norm, self.grad_norms_by_group)
        return grad_norm

    def count_zeros(self) -> float:
        """Number of zero gradient elements across the model."""
        return count_zeros_fp32(self.get_parameters(), self.get_grad_stats_parallel_group(), tp_group=self.tp_group)

    @staticmethod
    def _filter_and_reorder_param_groups(current_groups: list[dict], state_dict_groups: list[dict]) -> list[dict]:
        """The saved groups matched to ``current_groups`` by their :data:`param_group_identifier_keys` values.

        A group's identifier is the tuple of those entries (a missing entry and ``None`` are the same; NeMo's
        ``pre_<key>`` aliases are read too). The i-th result is the saved group whose identifier equals the i-th
        current group's, carrying the ``params`` of the i-th saved group (the saved state's ordering).
        ``ValueError`` names the identifier when a current group has no saved counterpart.
        """
        def identifier(group: dict) -> tuple:
            return tuple(group[key] if key in group else group.get(f"pre_{key}")
                         for key in param_group_identifier_keys)

        saved = {identifier(group): group for group in state_dict_groups}
        out = []
        for group, saved_params in zip(current_groups, [g["params"] for g in state_dict_groups]):
            key = identifier(group)
            if key not in saved:
                available = "\n".join(str(k) for k in saved)
                raise ValueError(f"Could not find parameter group with key {key} in loaded checkpoint.\n"
                                 f"Available keys:\n{available}\n"
                                 f"Parameter group key definition: {param_group_identifier_keys}")
            match = saved[key]
            match["params"] = saved_params
            out.append(match)
        return out

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the gradients of the model and main params."""

    @abstractmethod
    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale (a 1-element tensor; 1.0 without a scaler)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``, to call before backward.

        The one-element scale multiplies as a 0-dim tensor (the result keeps the loss's shape); held on the
        host it is passed to the kernel as a scalar, where copying it to the device each micro-batch would
        be a blocking copy that drains the device's queue.
        """
        return self.get_loss_scale().reshape(()) * loss

    @abstractmethod
    def reload_model_params(self) -> None:
        """Refresh main params from the model params (after loading a model checkpoint)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Optimizer state for checkpointing."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`, or from a loaded :meth:`sharded_state_dict`."""

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           metadata: dict | None = None, state_names: list[str] | None = None) -> dict[str, Any]:
        """The optimizer state in model space for ``dist_checkpointing`` (see :mod:`.checkpoint_state`).

        ``{"optimizer": {"state": {param path: {state name: ShardedTensor}}, "step": int}}``, each
        state sharded like its parameter in ``model_sharded_state_dict``. With ``is_loading`` the
        tensors are empty buffers for the states named in ``state_names``; pass the loaded result
        to :meth:`load_state_dict`. ``metadata`` is accepted for Megatron-Core compatibility.
        """
        return {"optimizer": build_sharded_state(self, model_sharded_state_dict, is_loading, state_names)}

    def _main_to_model(self) -> dict[int, torch.Tensor]:
        """``{id(main param): model param}`` where the inner optimizer updates a copy of the model param."""
        return {}

    def _checkpoint_entries(self, model_params: list[torch.Tensor]) -> list[ParamStateEntry]:
        """The parameters of ``model_params`` this optimizer updates, in that order, with their main tensors."""
        main_to_model = self._main_to_model()
        found = {}
        for group in self.optimizer.param_groups:
            for main in group["params"]:
                model = main_to_model.get(id(main), main)
                found[id(model)] = ParamStateEntry(model, main)
        return [found[id(p)] for p in model_params if id(p) in found]

    def _checkpoint_full(self, entry: ParamStateEntry, value: torch.Tensor) -> torch.Tensor:
        """A main-space state value as a whole TP-local fp32 tensor (here: a copy of the local shard)."""
        return local_tensor(value.detach()).float().clone()

    def _checkpoint_local(self, entry: ParamStateEntry, full: torch.Tensor) -> torch.Tensor:
        """The part of a whole TP-local tensor that this rank's main tensor holds (here: all of it)."""
        return full

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (the scheduler writes ``lr`` and ``weight_decay`` here)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The inner optimizer's per-param state."""
        return self.optimizer.state

    @abstractmethod
    def prepare_grads(self) -> bool:
        """Put unscaled gradients where the inner optimizer reads them; return True if any is inf/nan."""

    def prepare_grads_checks_for_inf(self) -> bool:
        """True when :meth:`prepare_grads` itself finds inf/nan gradients on any rank (a grad scaler is in use).

        When False, :meth:`step` computes the global gradient norm even with clipping off, to check it.
        """
        return False

    @abstractmethod
    def step_with_ready_grads(self) -> bool:
        """Run the inner step and copy the results into the model; return success."""

    @torch.no_grad()
    def step(self, skip_unless_finite: torch.Tensor | None = None) -> tuple[bool, float | None, float | None]:
        """One optimizer step: ``(update_successful, grad_norm, num_zeros)``.

        Skipped on every rank, weights and optimizer state untouched, when a grad scaler finds an
        inf/nan gradient (``(False, None, None)``) or the global gradient norm is non-finite
        (``(False, grad_norm, None)``). ``grad_norm`` is 0.0 when neither clipping nor the check needs it.

        ``skip_unless_finite`` (an extension; Megatron's ``step`` takes no argument): a tensor holding the same
        value on every rank, such as the loss reduced over ranks; when it is not finite the step is skipped
        as for a non-finite norm. Where the update is queued on the device (clipping folded into a fused
        Adam) the decision is made there too, so the caller need not read the value before the step.
        """
        success, grad_norm, num_zeros = self.step_on_device(skip_unless_finite)
        if isinstance(grad_norm, torch.Tensor):
            # The update is already queued: reading the values now stalls nothing but the host.
            grad_norm, succeeded = torch.stack([grad_norm.reshape(()).float(), success.reshape(()).float()]).tolist()
            success = bool(succeeded)
        return bool(success), grad_norm, num_zeros

    @torch.no_grad()
    def step_on_device(self, skip_unless_finite: torch.Tensor | None = None,
                       outcome_known: OutcomeCallback | None = None,
                       ) -> tuple[bool | torch.Tensor, float | torch.Tensor | None, float | None]:
        """:meth:`step` without reading the device (an extension; Megatron has no such method).

        Where the update is queued on the device (clipping folded into a fused Adam: the flat distributed
        step or torch's fused ``Adam``/``AdamW``), ``update_successful`` (bool) and ``grad_norm`` (fp32) come
        back as 0-dim device tensors that nobody has read, so the host goes straight on to the next step
        while the GPU runs the update; read them when convenient (a log interval). Elsewhere the values are
        the host values :meth:`step` returns: a grad scaler or unfolded clipping has already read the device.

        ``outcome_known(update_successful, grad_norm)``, if given, is called with those same objects once
        they are queued and before the update is: work the caller queues there (a copy of the values to the
        host) does not wait for the update's kernels. It is not called on the paths that return host values;
        if the inner step then fails on the host, the returned ``update_successful`` is another tensor (False).
        """
        with self._timer("optimizer-copy-to-main-grad"):
            found_inf = self.prepare_grads()
        if found_inf:
            return False, None, None
        if self._fold_clipping_into_adam():
            return self._step_with_clipping_in_adam(skip_unless_finite, outcome_known)
        grad_norm = 0.0
        skip_threshold = self._grad_norm_skip_threshold()
        if self.config.clip_grad > 0.0:
            with self._timer("optimizer-clip-main-grad"):
                grad_norm = self.clip_grad_norm(self.config.clip_grad)
        elif not self.prepare_grads_checks_for_inf() or skip_threshold is not None:
            with self._timer("optimizer-clip-main-grad"):
                grad_norm = self.get_grad_norm()
        if not math.isfinite(grad_norm) or (
                skip_unless_finite is not None and not bool(torch.isfinite(skip_unless_finite).all())):
            return False, grad_norm, None
        if skip_threshold is not None and grad_norm > skip_threshold:
            logger.info("skipping the update: grad norm %s exceeds grad_norm_skip_threshold %s", grad_norm,
                        skip_threshold)
            return False, grad_norm, None
        num_zeros = None
        if self.config.log_num_zeros_in_grad:
            with self._timer("optimizer-count-zeros"):
                num_zeros = self.count_zeros()
        with self._timer("optimizer-inner-step"):
            success = self.step_with_ready_grads()
        return success, grad_norm, num_zeros

    def _grad_norm_skip_threshold(self) -> float | None:
        """``config.grad_norm_skip_threshold`` when it is finite (the skip is enabled), else None."""
        threshold = getattr(self.config, "grad_norm_skip_threshold", math.inf)
        return threshold if math.isfinite(threshold) else None

    def _clipping_can_fold(self) -> bool:
        """Whether the settings let clipping fold into a step that takes a clip factor: clipping on, no zero count,
        no skip threshold, no grad scaler (each needs the norm or the gradients on the host before the step), and
        no separate grad-norm group (its parameters take another factor)."""
        return (self.config.clip_grad > 0.0 and not self.config.log_num_zeros_in_grad
                and self._grad_norm_skip_threshold() is None and not self.prepare_grads_checks_for_inf()
                and not self._has_separate_grad_norm_groups())

    def _fold_clipping_into_adam(self) -> bool:
        """Clip inside the fused Adam step (see :mod:`.fused_clip`): same update, no extra pass, no early sync."""
        return self._clipping_can_fold() and self._step_takes_clip_factor()

    def _main_grads_rewritten_before_step(self) -> bool:
        """Whether a pass before the inner step rewrites the main gradients in place: a grad scaler's unscaling, or
        clipping that cannot fold into the step."""
        return self.prepare_grads_checks_for_inf() or (self.config.clip_grad > 0.0 and not self._clipping_can_fold())

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose steps take the clip factor when clipping folds into them."""
        return [self.optimizer]

    def _grad_norm_tensor(self) -> torch.Tensor:
        """The global gradient norm as a 0-dim fp32 device tensor (nothing read on the host)."""
        return grad_norm_tensor(self.get_main_grads_for_grad_norm(),
                                grad_stats_parallel_group=self.get_grad_stats_parallel_group()).reshape(())

    def _step_takes_clip_factor(self) -> bool:
        """Whether the inner step divides by ``grad_scale`` and skips on ``found_inf`` (torch's fused Adam does)."""
        return supports_fused_clipping(self.optimizer)

    def _step_with_clipping_in_adam(self, skip_unless_finite: torch.Tensor | None = None,
                                    outcome_known: OutcomeCallback | None = None,
                                    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """Queue the clipped update; ``(update_successful, grad_norm)`` as unread 0-dim device tensors."""
        with self._timer("optimizer-clip-main-grad"):
            norm = self._grad_norm_tensor()
        check = norm  # non-finite when the norm or the caller's value is (x * 0 is nan for an inf or nan x)
        if skip_unless_finite is not None:
            check = norm + skip_unless_finite.detach().to(device=norm.device, dtype=norm.dtype).sum() * 0
        # A non-finite check makes the kernel skip the update (weights, state and step counts untouched), as the
        # unfused path does.
        success = torch.isfinite(check)
        if outcome_known is not None:
            outcome_known(success, norm)
        with self._timer("optimizer-inner-step"):
            results: list[bool] = []
            fused_adam_step_with_clipping(self._inner_optimizers(), norm, self.config.clip_grad,
                                          lambda: results.append(self.step_with_ready_grads()), check)
        if not results[0]:  # an inner step that failed on the host: a new tensor, not the one announced
            success = torch.zeros((), dtype=torch.bool, device=norm.device)
        return success, norm, None


def clip_by_group_norms(params: list[torch.Tensor], clip_grad: float, grad_norm: float,
                        group_norms: dict[str, float]) -> None:
    """Clip the main parameters' gradients by ``grad_norm`` and each separate grad-norm group's by its norm in
    ``group_norms`` (a group without one is left as it is)."""
    main, grouped = split_by_grad_norm_group(params)
    clip_grad_by_total_norm_fp32(main, clip_grad, grad_norm)
    for group, group_params in grouped.items():
        if group in group_norms:
            clip_grad_by_total_norm_fp32(group_params, clip_grad, group_norms[group])


def combine_grad_norms(norms: list[float]) -> float:
    """The L2 norm of several disjoint sets of gradients, from each set's norm."""
    return math.sqrt(sum(n * n for n in norms))
