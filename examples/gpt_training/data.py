"""Tokenizer, train/valid/test datasets and data loaders for ``pretrain_gpt.py``."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch

from megatron_core import device, parallel_state
from megatron_core.datasets import (
    BlendedMegatronDatasetBuilder,
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    build_pretraining_data_loader,
    get_blend_from_list,
)
from megatron_core.datasets.tokenizers import build_tokenizer


def build_tokenizer_from_args(args: argparse.Namespace):
    """The tokenizer the flags name."""
    return build_tokenizer(
        args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
    )


def build_datasets(args: argparse.Namespace, tokenizer) -> list:
    """Train, valid and test datasets sized for the whole run (through the blended builder)."""
    eval_runs = 1 if args.fixed_validation_set else (args.train_iters // args.eval_interval if args.eval_interval else 0) + 1
    sizes = [
        args.train_iters * args.global_batch_size,
        eval_runs * args.eval_iters * args.global_batch_size,
        args.eval_iters * args.global_batch_size,
    ]
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else get_blend_from_list(args.data_path),
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,
    )
    cls = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


def build_loader(dataset, args: argparse.Namespace, consumed_samples: int):
    """A DataLoader over ``dataset`` sharded by data-parallel rank, resumable at ``consumed_samples``."""
    if dataset is None:
        return None
    return build_pretraining_data_loader(
        dataset,
        consumed_samples,
        args.micro_batch_size,
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        num_workers=args.num_workers,
        pin_memory=device.get_current_device().type == "cuda",  # lets batches copy to the GPU asynchronously
    )


def cyclic(loader) -> Iterator[dict]:
    """Iterate ``loader`` forever (evaluation restarts the validation set when it runs out)."""
    while True:
        yield from loader


def to_device(batch: dict) -> dict[str, torch.Tensor]:
    """Move a batch's tensors to this rank's device."""
    target = device.get_current_device()
    return {k: v.to(target, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}

