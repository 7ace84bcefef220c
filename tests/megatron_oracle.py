"""Megatron-Core (the installed megatron-core) as a numeric oracle inside a test process, on a machine without a GPU.

:func:`megatron_on_cpu` makes the few CUDA-only calls Megatron-Core's model path makes harmless
(``torch.cuda.synchronize``, ``torch.cuda.current_device`` and the CUDA RNG tracker's ``fork``), initialises its
``parallel_state`` at TP=PP=1, and undoes all of it on exit, so rank-pool workers stay clean for later tests.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Run Megatron-Core's models in this process (the default process group must exist); restored on exit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as their_state
        from megatron.core.tensor_parallel import random as their_random
    saved = (torch.cuda.synchronize, torch.cuda.current_device)
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"

    class _NoCudaTracker(their_random.CudaRNGStatesTracker):
        @contextlib.contextmanager
        def fork(self, name=None):
            yield

    saved_tracker = (their_random._CUDA_RNG_STATE_TRACKER, their_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    their_random._CUDA_RNG_STATE_TRACKER, their_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = _NoCudaTracker(), True
    their_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        their_state.destroy_model_parallel()
        their_random._CUDA_RNG_STATE_TRACKER, their_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved_tracker
        torch.cuda.synchronize, torch.cuda.current_device = saved
