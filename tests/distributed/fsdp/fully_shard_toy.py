"""A small plain-torch model trained under Megatron-FSDP's ``fully_shard``, and its single-process reference.

Both sides start from the same weights (seed 1234) and take the same AdamW steps on the same global
batches; each data-parallel rank feeds its own slice of a batch, so the averaged gradients equal the
reference's. Sizes are odd on purpose: several dim-0 shards are uneven and some ranks hold none of the
3-row head.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist

IN, HIDDEN, OUT, BLOCKS = 5, 10, 3, 3
GLOBAL_BATCH, STEPS, LR, WD = 8, 3, 1e-2, 0.1


class Block(torch.nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc1 = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.fc2 = torch.nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x + fc2(gelu(fc1(norm(x))))``."""
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class ToyModel(torch.nn.Module):
    """Linear embedding, ``BLOCKS`` blocks, final norm and a 3-row head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(IN, HIDDEN)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, IN] -> [b, OUT]``."""
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(seed: int = 1234, device: str | torch.device = "cpu") -> ToyModel:
    """A fresh :class:`ToyModel` from ``seed``."""
    torch.manual_seed(seed)
    with torch.device(device):
        return ToyModel()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs [GLOBAL_BATCH, IN], targets [GLOBAL_BATCH, OUT])`` of step ``step``."""
    gen = torch.Generator().manual_seed(700 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=gen), torch.randn(GLOBAL_BATCH, OUT, generator=gen)


def optimizer(params, eps: float = 1e-8) -> torch.optim.AdamW:
    """The AdamW both sides use (a larger ``eps`` keeps near-zero gradients from amplifying rounding)."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, eps=eps)


def reference(steps: int = STEPS) -> tuple[list[float], list[dict], dict]:
    """``(losses, gradients of each step, final weights)`` of single-process training on whole batches."""
    model = build()
    opt = optimizer(model.parameters())
    losses, grads = [], []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective), or the tensor itself."""
    return tensor.full_tensor().detach().clone() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def train(model, opt, steps: int = STEPS, microbatches: int = 1,
          before_last: Callable | None = None, first_step: int = 0) -> tuple[list[float], list[dict]]:
    """``(DP-averaged losses, gathered gradients of each step)`` of ``model`` trained on this rank's slices.

    With ``microbatches > 1`` the slice is split; all but the last run under ``model.no_sync()`` unless
    ``before_last`` is given, which is then called before the last microbatch (the others run plainly).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    local = GLOBAL_BATCH // world
    losses, grads = [], []
    for step in range(first_step, first_step + steps):
        x, y = batch(step)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        opt.zero_grad()
        total = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches))):
            last = i == microbatches - 1
            if last and before_last is not None:
                before_last(model)
            plain = last or before_last is not None
            ctx = model.no_sync() if not plain else nullcontext()
            with ctx:
                loss = torch.nn.functional.mse_loss(model(xm), ym) / microbatches
                loss.backward()
            total += loss.detach()
        model.finish_grad_sync()
        grads.append({n: full(p.grad) for n, p in model.module.named_parameters()})
        opt.step()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, grads


def weights(model) -> dict[str, torch.Tensor]:
    """Every parameter of a fully-sharded model, gathered."""
    return {n: full(p) for n, p in model.module.named_parameters()}
