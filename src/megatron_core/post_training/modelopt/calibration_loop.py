"""Calibration batches from Megatron datasets: the ``forward_loop`` that Model Optimizer's ``quantize`` runs.

Megatron-LM's post-training scripts calibrate on text batches; here the batches come from this library's
datasets: :func:`build_calibration_dataset` builds the training split of a ``GPTDataset`` (or any
``MegatronDataset`` class, e.g. ``MockGPTDataset``) through ``BlendedMegatronDatasetBuilder``, and
:func:`get_forward_loop` returns a loop that runs its first ``num_batches`` micro-batches through a
``GPTModel`` (tokens, position ids and, where the dataset makes one, the attention mask), with this
library's progress bar (:mod:`megatron_core.progress`) on the first rank.

Every tensor-parallel rank of a model must run the same batches, so the loop reads the same samples on
every rank unless ``sample_offset`` says otherwise (e.g. ``data_parallel_rank * num_batches * batch_size``
to give data-parallel replicas different samples; Model Optimizer takes the maximum amax over them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron_core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_core.progress import track

__all__ = ["build_calibration_dataset", "calibration_batches", "get_forward_loop"]


def build_calibration_dataset(config: GPTDatasetConfig, num_samples: int, dataset_cls: type = GPTDataset) -> Any:
    """The training split of ``dataset_cls`` over ``config``'s blend, holding ``num_samples`` samples.

    ``ValueError`` when ``num_samples`` is not positive or the config builds no training split.
    """
    if num_samples <= 0:
        raise ValueError(f"num_samples ({num_samples}) must be positive: calibration needs at least one sample")
    train, _, _ = BlendedMegatronDatasetBuilder(dataset_cls, [num_samples, None, None], lambda: True, config).build()
    if train is None:
        raise ValueError(f"the dataset config builds no training split (split {config.split!r}); "
                         "calibration reads the training split")
    return train


def calibration_batches(dataset: Any, num_batches: int, batch_size: int = 1, sample_offset: int = 0,
                        ) -> Iterator[dict[str, torch.Tensor]]:
    """The ``num_batches`` micro-batches of ``batch_size`` samples from ``sample_offset`` on, stacked per field.

    The sizes are checked at once (``ValueError`` naming the numbers when ``num_batches`` or ``batch_size``
    is not positive or the dataset holds fewer than ``sample_offset + num_batches * batch_size`` samples);
    the samples are read as the returned iterator is consumed.
    """
    if num_batches <= 0:
        raise ValueError(f"num_batches ({num_batches}) must be positive: a calibration loop without batches "
                         "leaves every activation quantizer uncalibrated")
    if batch_size <= 0:
        raise ValueError(f"batch_size ({batch_size}) must be positive")
    if sample_offset < 0:
        raise ValueError(f"sample_offset ({sample_offset}) must not be negative")
    needed = sample_offset + num_batches * batch_size
    if len(dataset) < needed:
        raise ValueError(f"the calibration dataset holds {len(dataset)} samples; {num_batches} batches of "
                         f"{batch_size} from sample {sample_offset} need {needed}")

    def read() -> Iterator[dict[str, torch.Tensor]]:
        for b in range(num_batches):
            start = sample_offset + b * batch_size
            samples = [dataset[i] for i in range(start, start + batch_size)]
            yield {key: torch.stack([s[key] for s in samples]) for key in samples[0]}

    return read()


def get_forward_loop(dataset: Any, num_batches: int, batch_size: int = 1, sample_offset: int = 0,
                     progress: bool = True) -> Callable[[torch.nn.Module], None]:
    """Model Optimizer's ``forward_loop``: ``model(tokens, position_ids, attention_mask)`` on each calibration batch.

    The sizes are checked here (so bad arguments fail before quantizing); each run of the loop reads
    its batches from the dataset again (AWQ runs it twice), one at a time. Forwards run without
    gradients, on the device of the model's first parameter. ``progress`` shows a bar on rank 0's
    terminal (plain lines when not a terminal).
    """
    calibration_batches(dataset, num_batches, batch_size, sample_offset)  # check the sizes now
    show = progress and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0)

    def forward_loop(model: torch.nn.Module) -> None:
        device = next(model.parameters()).device
        with torch.no_grad():
            batches = calibration_batches(dataset, num_batches, batch_size, sample_offset)
            for batch in track(batches, num_batches, "calibrating", unit="batch", enabled=show, lines=4):
                mask = batch.get("attention_mask")
                model(batch["tokens"].to(device), batch["position_ids"].to(device),
                      None if mask is None else mask.to(device))

    return forward_loop
