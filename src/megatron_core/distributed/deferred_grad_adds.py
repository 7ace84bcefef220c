"""Small gradients added to ``main_grad`` a backward pass at a time, in a few kernels instead of one add each.

DDP's hook adds each parameter's ``.grad`` to its ``main_grad`` as soon as autograd has it. For the many small
parameters of a transformer (two norm weights per layer, biases) each add is a kernel of a few microseconds that
moves a few kilobytes: on one H100 the 45 norm weights of a 22-layer model cost about 0.17 ms per micro-batch.
With ``DistributedDataParallelConfig.batch_small_grad_adds`` the hook hands such gradients to a
:class:`DeferredGradAdds` of the parameter's bucket group instead; it adds them all when the backward pass ends
(an autograd engine callback) or, earlier, when that group's reduction starts.
"""

from __future__ import annotations

import torch

__all__ = ["SMALL_GRAD_NUMEL", "DeferredGradAdds"]

SMALL_GRAD_NUMEL = 1 << 16
"""Parameters with at most this many elements count as small."""


class DeferredGradAdds:
    """``main_grad += grad`` pairs held back until :meth:`flush` (each ``main_grad`` at most once between flushes)."""

    def __init__(self) -> None:
        self._main_grads: list[torch.Tensor] = []
        self._grads: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self._main_grads)

    def add(self, main_grad: torch.Tensor, grad: torch.Tensor) -> None:
        """Hold ``main_grad += grad`` back (``grad`` is kept alive until then)."""
        self._main_grads.append(main_grad)
        self._grads.append(grad)

    def flush(self) -> None:
        """Do every held-back add: one ``_foreach_add_`` per gradient dtype (a mixed-dtype list is first packed
        into one buffer and cast once, so that the foreach kernel's fast path applies)."""
        if not self._main_grads:
            return
        main_grads, grads = self._main_grads, self._grads
        self._main_grads, self._grads = [], []
        by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for main_grad, grad in zip(main_grads, grads):
            targets, sources = by_dtype.setdefault(main_grad.dtype, ([], []))
            targets.append(main_grad)
            sources.append(grad)
        for dtype, (targets, sources) in by_dtype.items():
            if any(source.dtype != dtype for source in sources):
                packed = torch.cat([source.reshape(-1) for source in sources]).to(dtype)
                pieces = packed.split([source.numel() for source in sources])
                sources = [piece.view(target.shape) for piece, target in zip(pieces, targets)]
            torch._foreach_add_(targets, sources)
