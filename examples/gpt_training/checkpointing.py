"""Checkpoints of ``pretrain_gpt.py`` through ``megatron_core.training``.

Each save writes ``<save>/iter_0000010/`` (model chunks, optimizer, scheduler, RNG states, iteration,
consumed samples and the run's flags) and then moves the ``latest_checkpointed_iteration.txt`` tracker.
With ``--async-save`` the files are written in the background while training goes on; the tracker moves
only once they are complete. A checkpoint taken under another parallel layout is resharded on load.
"""

from __future__ import annotations

import argparse
import os

from megatron_core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron_core.training import load_checkpoint, read_tracker, save_checkpoint

# Flags that change the trained model or the data order: a resumed run must use the same values.
_MUST_MATCH = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "global_batch_size", "seed")


class Checkpointer:
    """Saves and loads the training state of one run (model chunks, optimizer, scheduler, progress)."""

    def __init__(self, args: argparse.Namespace, chunks: list, optimizer, scheduler) -> None:
        self.args, self.chunks = args, chunks
        self.optimizer, self.scheduler = optimizer, scheduler
        self.async_queue = AsyncCallsQueue() if args.async_save else None
        self.last_saved: int | None = None

    def consumed_samples(self, iteration: int) -> int:
        """Samples consumed by ``iteration`` steps (a constant global batch)."""
        return iteration * self.args.global_batch_size

    def check_save_dir(self, start_iteration: int) -> None:
        """Refuse, before training, a ``--save`` directory whose published checkpoints this run would replace.

        Directories newer than the tracker are leftovers of a crashed save and are overwritten; the
        checkpoint the run resumed from is not saved again.
        """
        published = read_tracker(self.args.save) if self.args.save else None
        if published is not None and published > start_iteration:
            raise ValueError(
                f"--save {self.args.save} already holds checkpoints up to iteration {published}; this run starts "
                f"at iteration {start_iteration} and would replace them: resume with --load {self.args.save} "
                f"or choose another --save directory")
        if published is not None and published == start_iteration:
            self.last_saved = start_iteration

    def save(self, iteration: int) -> None:
        """Write a checkpoint of ``iteration`` (once per iteration)."""
        if self.last_saved == iteration:
            return
        if self.async_queue is not None:
            self.async_queue.maybe_finalize_async_calls(blocking=False)
        save_checkpoint(
            self.args.save, iteration, self.chunks, self.optimizer, self.scheduler,
            consumed_train_samples=self.consumed_samples(iteration),
            extra_state={"args": {k: v for k, v in vars(self.args).items() if _plain(v)}},
            async_queue=self.async_queue,
            overwrite=True,  # only leftovers of a crashed save: check_save_dir guards published checkpoints
        )
        self.last_saved = iteration

    def load(self) -> tuple[int, int]:
        """Resume from ``--load``; returns ``(iteration, consumed_samples)``.

        A ``--load`` without a checkpoint is an error (a mistyped path must not train from scratch),
        except with ``--load-if-present`` or when ``--load`` is the ``--save`` directory and still empty.
        """
        state = load_checkpoint(
            self.args.load, self.chunks,
            self.optimizer,  # not loaded under --no-load-optim, but its main params are refreshed from the weights
            None if self.args.no_load_optim else self.scheduler,
            load_optimizer=not self.args.no_load_optim, load_rng=not self.args.no_load_rng,
            missing_ok=self.args.load_if_present or _fresh_save_dir(self.args.load, self.args.save),
        )
        if state is None:
            return 0, 0
        saved = (state.get("extra_state") or {}).get("args", {})
        changed = [f"--{k.replace('_', '-')} {saved[k]} -> {getattr(self.args, k)}"
                   for k in _MUST_MATCH if k in saved and saved[k] != getattr(self.args, k)]
        if changed:
            raise ValueError(f"checkpoint in {self.args.load} was trained with other flags: {'; '.join(changed)}")
        return state["iteration"], state["consumed_train_samples"]

    def finalize(self) -> None:
        """Wait for a pending asynchronous save and move the tracker."""
        if self.async_queue is not None:
            self.async_queue.maybe_finalize_async_calls(blocking=True)
            self.async_queue.close()


def _plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str)) or (
        isinstance(value, list) and all(isinstance(v, (int, float, str)) for v in value))


def _fresh_save_dir(load: str, save: str | None) -> bool:
    """``--load`` is the ``--save`` directory and holds nothing yet (absent, empty, or only temporary
    directories of a first save that never finished): a resumable job's first run."""
    if save is None or os.path.realpath(load) != os.path.realpath(save):
        return False
    if not os.path.exists(load):
        return True
    return os.path.isdir(load) and all(".tmp-" in name for name in os.listdir(load))
