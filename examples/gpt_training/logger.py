"""Training logs: console (with a progress display on a terminal), TensorBoard, W&B and JSON lines."""

from __future__ import annotations

import argparse
import json
import sys
import time


class TrainingLogger:
    """Writes one record per log interval to every sink the flags ask for; only rank 0 writes."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.enabled = rank == 0
        self.total = args.train_iters
        self.progress = self.enabled and not args.no_progress and sys.stdout.isatty()
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
        if self.enabled:
            if self.progress:
                sys.stdout.write("\n")
            print(message, flush=True)

    def log(self, iteration: int, record: dict[str, float], kind: str = "train") -> None:
        """Write ``record`` for ``iteration`` to every sink."""
        if not self.enabled:
            return
        line = " | ".join(f"{k} {_fmt(v)}" for k, v in record.items())
        if self.progress and kind == "train":
            done = iteration / self.total
            bar = "#" * int(30 * done) + "-" * (30 - int(30 * done))
            sys.stdout.write(f"\r[{bar}] {iteration}/{self.total} | {line}")
            sys.stdout.flush()
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
        if self.progress:
            sys.stdout.write("\n")
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3e}"
