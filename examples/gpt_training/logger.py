"""Training logs: console (a tqdm progress bar on a terminal, plain lines otherwise), TensorBoard, W&B, JSON lines."""

from __future__ import annotations

import argparse
import json
import sys
import time

from megatron_core.progress import progress_bar


class TrainingLogger:
    """Writes one record per log interval to every sink the flags ask for; only rank 0 writes."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.enabled = rank == 0
        self.total = args.train_iters
        # A bar only on a terminal with tqdm installed (and not --no-progress); else one line per record.
        self.bar = progress_bar(args.train_iters, "train", unit="step", stream=sys.stdout,
                                enabled=self.enabled and not args.no_progress)
        self.progress = self.bar is not None
        self.start = time.time()
        self.tensorboard = self.wandb = None
        self.json_path = args.log_json if self.enabled else None
        if not self.enabled:
            return
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir)
        if args.wandb_project:
            import wandb  # optional; installed by the user

            self.wandb = wandb.init(project=args.wandb_project, name=args.wandb_exp_name, config=vars(args))

    def info(self, message: str) -> None:
        """A plain message (rank 0 only)."""
        if self.bar is not None:
            self.bar.write(message)
        elif self.enabled:
            print(message, flush=True)

    def log(self, iteration: int, record: dict[str, float], kind: str = "train") -> None:
        """Write ``record`` for ``iteration`` to every sink."""
        if not self.enabled:
            return
        line = " | ".join(f"{k} {_fmt(v)}" for k, v in record.items())
        if self.bar is not None and kind == "train":
            self.bar.set_position(iteration, line)
        elif self.bar is not None:
            self.bar.write(f"[{kind}] iteration {iteration:6d}/{self.total} | {line}")
        else:
            print(f"[{kind}] iteration {iteration:6d}/{self.total} | {line}", flush=True)
        for key, value in record.items():
            if self.tensorboard is not None:
                self.tensorboard.add_scalar(f"{kind}/{key}", value, iteration)
        if self.wandb is not None:
            self.wandb.log({f"{kind}/{k}": v for k, v in record.items()}, step=iteration)
        if self.json_path:
            with open(self.json_path, "a") as handle:
                handle.write(json.dumps({"kind": kind, "iteration": iteration, **record}) + "\n")

    def close(self) -> None:
        """Flush and close the sinks."""
        if self.bar is not None:
            self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3e}"
