"""``--profile``: record steps ``--profile-step-start`` to ``--profile-step-end`` with the PyTorch profiler.

Rank 0 (or every rank in ``--profile-ranks``) prints a table of the operators and kernels that took the
most device time and writes a Chrome trace to ``--profile-dir`` (open it in Perfetto or chrome://tracing).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from megatron_core import device


class StepProfiler:
    """Starts and stops a ``torch.profiler`` session around a window of training iterations."""

    def __init__(self, args: argparse.Namespace) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.enabled = args.profile and rank in args.profile_ranks
        self.start, self.end = args.profile_step_start, args.profile_step_end
        self.directory, self.rank = args.profile_dir, rank
        self.session: torch.profiler.profile | None = None

    def before_step(self, iteration: int) -> None:
        """Call with the number of the step about to run (1-based)."""
        if self.enabled and iteration == self.start and self.session is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.get_current_device().type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.session = torch.profiler.profile(activities=activities, record_shapes=False)
            self.session.__enter__()

    def after_step(self, iteration: int) -> None:
        """Call with the number of the step that just ran; ends the session after ``--profile-step-end``."""
        if self.session is None or iteration < self.end:
            return
        device.synchronize()
        self.session.__exit__(None, None, None)
        sort_key = "self_cuda_time_total" if device.get_current_device().type == "cuda" else "self_cpu_time_total"
        steps = self.end - self.start + 1
        print(f"[profile] rank {self.rank}, steps {self.start}-{self.end} ({steps} steps), top operators by "
              f"{sort_key}:\n{self.session.key_averages().table(sort_by=sort_key, row_limit=25)}", flush=True)
        os.makedirs(self.directory, exist_ok=True)
        trace = os.path.join(self.directory, f"trace_rank{self.rank}_steps{self.start}-{self.end}.json")
        self.session.export_chrome_trace(trace)
        print(f"[profile] Chrome trace: {trace}", flush=True)
        self.session = None
