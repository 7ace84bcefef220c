"""The precision-aware distributed optimizer's Adam step over flat bucket shards, one fused kernel per shard slice.

A rank of the distributed optimizer owns one contiguous shard of every DDP bucket. Here the main
params and both Adam moments of a shard are three flat buffers laid out exactly like the bucket's
gradient and param buffers (same offsets, DDP padding included), so that one elementwise kernel
over the shard reads gradient, main param and moments once and writes main param, moments and the
model's (bf16) param once: the bytes Adam must move, in one pass, where a per-tensor optimizer
followed by a copy into the model params moves them in several passes and many launches.

Parameters of different param groups (weight decay or not, learning-rate multipliers) sit side by
side in a shard: a ``uint8`` group id per element selects the group's row of a small table
(step size ``-lr / bias_correction1``, decay ``1 - lr * weight_decay`` or the L2 coefficient, and
``sqrt(bias_correction2)``), formed each step in float64 as
:class:`~megatron_core.optimizer.precision_aware_adam.PrecisionAwareAdam` forms its scalars, on the device from
a step count kept there: a step skipped on the device (non-finite norm) takes its count back by a kernel, so
nothing is read on the host. The
arithmetic is that optimizer's, element by element, in fp32, rounded to each buffer's storage dtype.
On CUDA the update is ``torch.compile``d into one kernel (dynamic shapes), run over each shard in slices of at
most ``SLICE_ELEMENTS``; elsewhere it runs eagerly.

The optimizer's ``state`` keeps its usual per-parameter entries (``exp_avg``, ``exp_avg_sq``,
``step``), now views of the flat buffers (``step`` a 0-dim view of the device count), so checkpoints are
unchanged. Values loaded into
``state`` replace those views; :meth:`FlatAdamShards.bind` copies them back in before the next step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

__all__ = ["FlatAdamShards", "FlatShard", "flat_adam_update"]

_STEP_SIZE, _DECAY, _BIAS2_SQRT = 0, 1, 2
# Elements per call of the update: a shard is stepped in slices of at most this many elements, so the eager
# path's fp32 temporaries and the compiled kernel's autotuning copies of its in-place buffers stay bounded
# (a whole 4.5B-element shard needed tens of GB beside the optimizer state) at the cost of a few more launches.
SLICE_ELEMENTS = 1 << 26


def flat_adam_update(
    main: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    model_out: torch.Tensor | None, group_ids: torch.Tensor, table: torch.Tensor,
    grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None,
    beta1: float, beta2: float, eps: float, adam_w_mode: bool,
) -> None:
    """One Adam/AdamW step of a flat shard, in place; ``model_out`` (if given) receives the new params.

    ``table`` is ``[3, groups]`` fp32 (step size, decay or L2 coefficient, sqrt of bias correction 2),
    indexed per element by ``group_ids``. ``grad_scale`` divides the gradient (clipping folded in);
    where ``found_inf`` is non-zero nothing changes.
    """
    ids = group_ids.long()
    step_size, decay, bias2_sqrt = table[_STEP_SIZE][ids], table[_DECAY][ids], table[_BIAS2_SQRT][ids]
    g = grad.to(main.dtype).float()  # the gradient as the main params' dtype hands it to the update
    if grad_scale is not None:
        g = g / grad_scale
    p = main.float()
    if not adam_w_mode:
        g = g + decay * p  # L2: the coefficient sits in the decay row
    m = exp_avg.float()
    m = m + (1.0 - beta1) * (g - m)
    v = exp_avg_sq.float() * beta2 + (1.0 - beta2) * g * g
    denom = v.sqrt() / bias2_sqrt + eps
    if adam_w_mode:
        p = p * decay
    p = p + (step_size * m) / denom
    if found_inf is not None:
        keep = found_inf == 0
        m, v, p = torch.where(keep, m, exp_avg.float()), torch.where(keep, v, exp_avg_sq.float()), \
            torch.where(keep, p, main.float())
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    main.copy_(p)
    if model_out is not None:
        model_out.copy_(p.to(main.dtype))  # what copying the stored main param would give


@dataclass
class FlatShard:
    """One bucket shard: flat main params, moments, the bucket's gradient and (unless main is it) param slice."""

    main: torch.Tensor
    grad: torch.Tensor
    model_out: torch.Tensor | None
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    group_ids: torch.Tensor
    pieces: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)  # (main view, start, end) in the shard


class FlatAdamShards:
    """Adam state in flat shard buffers, stepped by :func:`flat_adam_update` (see the module doc)."""

    def __init__(self, optimizer: torch.optim.Optimizer, shards: list[FlatShard], compiled: bool | None = None) -> None:
        self.optimizer = optimizer
        self.shards = shards
        device = shards[0].main.device if shards else torch.device("cpu")
        self.compiled = device.type == "cuda" if compiled is None else compiled
        self._update = torch.compile(flat_adam_update, dynamic=True) if self.compiled else flat_adam_update
        self.bound = False
        groups = optimizer.param_groups
        pinned = device.type == "cuda"
        # Two pinned slots of per-group host scalars (lr, decay), used in turn: a slot is refilled only after
        # its copy of two steps ago has left it, so the host never waits on the step just queued.
        self._rows_host = [torch.zeros(2, len(groups), dtype=torch.float64, pin_memory=pinned) for _ in range(2)]
        self._rows_copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self._slot = 0
        self._table = torch.zeros(3, len(groups), dtype=torch.float32, device=device)
        group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        for shard in shards:
            for view, start, end in shard.pieces:
                shard.group_ids[start:end] = group_of[id(view)]
        # Each param's moment views, made once: ``bind`` recognises its own views by identity.
        self._views = [(view, shard.exp_avg[start:end].view(view.shape), shard.exp_avg_sq[start:end].view(view.shape))
                       for shard in shards for view, start, end in shard.pieces]
        # The step count lives on the device: each param's ``step`` is its own 0-dim view of one buffer (a shared
        # tensor would be counted once per param by an optimizer that loads this state and increments every
        # param's step in place), advanced by a kernel and taken back by one when the update is skipped on the
        # device, so the host never reads it while training.
        self._step_counts = torch.zeros(max(len(self._views), 1), dtype=torch.float32, device=device)
        self._step_views = list(self._step_counts.unbind())[:len(self._views)]

    @staticmethod
    def make_shard(main: torch.Tensor, grad: torch.Tensor, model_out: torch.Tensor | None,
                   exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype) -> FlatShard:
        """A shard over ``main`` (flat) with zeroed moments; add its pieces with :meth:`add_piece`."""
        if main.shape != grad.shape or (model_out is not None and model_out.shape != main.shape):
            raise ValueError(f"flat shard buffers differ in size: main {tuple(main.shape)}, grad "
                             f"{tuple(grad.shape)}, model {None if model_out is None else tuple(model_out.shape)}")
        return FlatShard(main, grad, model_out, torch.zeros_like(main, dtype=exp_avg_dtype),
                         torch.zeros_like(main, dtype=exp_avg_sq_dtype),
                         torch.zeros(main.numel(), dtype=torch.uint8, device=main.device))

    def bind(self) -> None:
        """Make every param's ``exp_avg``/``exp_avg_sq`` state a view of the flat buffers (adopting loaded values)."""
        state = self.optimizer.state
        steps = []
        own_steps = {id(t) for t in self._step_views}
        for param, exp_avg, exp_avg_sq in self._views:
            entry = state.setdefault(param, {})
            for name, view in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                current = entry.get(name)
                if current is None:
                    view.zero_()
                elif current is not view:
                    view.copy_(current.reshape(view.shape))
                entry[name] = view
            if "step" in entry and id(entry["step"]) not in own_steps:
                steps.append(int(entry["step"]))
        if steps:
            self._step_counts.fill_(float(max(steps)))
        for (param, _, _), step in zip(self._views, self._step_views):
            state[param]["step"] = step
        self.bound = True

    def _fill_table(self, beta1: float, beta2: float) -> None:
        """Per-group scalars of this step (step size ``-lr / bias_correction1``, decay, ``sqrt(bias_correction2)``).

        Formed in float64 as ``PrecisionAwareAdam`` forms them, the bias corrections from the device step count.
        """
        self._slot = slot = 1 - self._slot
        host, copied = self._rows_host[slot], self._rows_copied[slot]
        if copied is not None:
            copied.synchronize()  # this slot's copy of two steps ago has left the pinned buffer
        adam_w = getattr(self.optimizer, "adam_w_mode", True)
        groups = self.optimizer.param_groups
        for i, group in enumerate(groups):
            lr, wd = group["lr"], group["weight_decay"]
            host[0, i] = lr
            host[1, i] = (1 - lr * wd) if adam_w else wd
        rows = host.to(self._table.device, non_blocking=True)
        if copied is not None:
            copied.record()
        n = self._step_counts[0].double()
        self._table.copy_(torch.stack([-rows[0] / (1 - beta1 ** n), rows[1],
                                       torch.sqrt(1 - beta2 ** n).expand(rows.shape[1])]))

    def step(self, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
        """One step of every shard (the model params are written too)."""
        if not self.bound:
            self.bind()
        groups = self.optimizer.param_groups
        betas, eps = groups[0]["betas"], groups[0]["eps"]
        if any(g["betas"] != betas or g["eps"] != eps for g in groups):
            raise ValueError("the flat Adam step needs the same betas and eps in every param group, got "
                             f"{[(g['betas'], g['eps']) for g in groups]}")
        self._step_counts.add_(1.0)
        self._fill_table(float(betas[0]), float(betas[1]))
        hyper = (float(betas[0]), float(betas[1]), float(eps), bool(getattr(self.optimizer, "adam_w_mode", True)))
        for shard in self.shards:
            for start in range(0, shard.main.numel(), SLICE_ELEMENTS):
                self._step_slice(shard, slice(start, start + SLICE_ELEMENTS), grad_scale, found_inf, hyper)
        if found_inf is not None:
            self._step_counts.sub_(found_inf.reshape(()))  # a skipped update's count does not stand

    def _step_slice(self, shard: FlatShard, part: slice, grad_scale: torch.Tensor | None,
                    found_inf: torch.Tensor | None, hyper: tuple[float, float, float, bool]) -> None:
        """The update of elements ``part`` of one shard (compiled; eager if the compiler fails)."""
        model_out = None if shard.model_out is None else shard.model_out[part]
        args = (shard.main[part], shard.grad[part], shard.exp_avg[part], shard.exp_avg_sq[part], model_out,
                shard.group_ids[part], self._table, grad_scale, found_inf, *hyper)
        try:
            self._update(*args)
        except Exception as error:  # torch.compile could not build the kernel (it fails before running)
            if not self.compiled:
                raise
            warnings.warn(f"flat Adam step: torch.compile failed ({type(error).__name__}: {error}); "
                          "running the same update eagerly (one pass per operation)", stacklevel=3)
            self.compiled, self._update = False, flat_adam_update
            self._update(*args)
