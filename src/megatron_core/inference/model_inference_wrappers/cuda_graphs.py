"""CUDA graphs of decode steps (used when ``InferenceConfig.num_cuda_graphs`` is set and the model is on a GPU).

A decode step's inputs live in the context's fixed-address tensors for its padded batch size
(:class:`DecodeGraphInputs`). The first step of each batch size runs the model twice on a side
stream (allocating the KV buffers and warming the kernels; it writes the same keys and values the
replay will, and state that a forward advances, such as Mamba states, is put back after each warm-up run),
then captures one forward into a graph; later steps of that size replay it. All
graphs share one memory pool. Each replay's logits are valid until the next replay.

The captured forward must run the code the warm-up ran. A ``torch.compile``'d forward whose guards change
on every call (one on the length of a list the forward appends to, say) compiles again inside the capture:
Inductor then loads new kernels, and on a compile-cache miss benchmarks them, on the captured stream, which
can invalidate the capture (``cudaErrorStreamCaptureInvalidated``, reported by a later launch). The capture
therefore runs under ``torch.compiler.set_stance("fail_on_recompile")``: such a forward raises at once,
naming the guard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DecodeGraphRunner"]


class DecodeGraphRunner:
    """Captures and replays one graph per padded decode batch size."""

    def __init__(self) -> None:
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self.pool: Any = None

    def run(self, batch: int, forward: Callable[[], torch.Tensor],
            snapshot: Callable[[], Callable[[], None] | None] | None = None) -> torch.Tensor:
        """The logits of ``forward()`` for this padded ``batch`` (captured on first use, then replayed).

        ``snapshot``, for state a forward advances rather than overwrites (a hybrid model's Mamba states), is
        called before the warm-up and returns a function that puts that state back: it runs after each warm-up
        forward, so the replay starts from the state the step began with.
        """
        entry = self.graphs.get(batch)
        if entry is None:
            restore = snapshot() if snapshot is not None else None
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    forward()
                    if restore is not None:
                        restore()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool), torch.compiler.set_stance("fail_on_recompile"):
                output = forward()
            self.pool = graph.pool()
            entry = self.graphs[batch] = (graph, output)
        graph, output = entry
        graph.replay()
        return output
