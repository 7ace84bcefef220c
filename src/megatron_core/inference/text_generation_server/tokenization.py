"""Prompt tokenization shared across ranks (Megatron-Core's ``text_generation_server.tokenization``).

:func:`tokenize_prompts` tokenizes the prompts on the source rank (optionally with the end-of-document
token as BOS), pads every prompt with that token to ``longest prompt + tokens_to_generate``, and
broadcasts the ``[batch, length]`` token tensor and the ``[batch]`` prompt lengths to every rank
(``data_parallel=True``: within this rank's model-parallel group, from its first rank). Without
``torch.distributed`` it returns the local tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.device import get_current_device
from megatron_core.inference.communication_utils import broadcast_int_list, broadcast_tensor

__all__ = ["tokenize_prompts"]


def _end_token(tokenizer: Any) -> int:
    for name in ("eod", "eos_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return value
    raise AttributeError(f"tokenize_prompts: the tokenizer ({type(tokenizer).__name__}) has neither 'eod' nor "
                         "'eos_id'")


def _tokenize_and_pad(tokenizer: Any, prompts: list[str], tokens_to_generate: int,
                      add_BOS: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [batch, max prompt + tokens_to_generate], lengths [batch])``, padded with the end token."""
    end = _end_token(tokenizer)
    rows = [([end] if add_BOS else []) + list(tokenizer.tokenize(p)) for p in prompts]
    lengths = [len(r) for r in rows]
    width = max(lengths) + tokens_to_generate
    padded = [r + [end] * (width - len(r)) for r in rows]
    device = get_current_device()
    return (torch.tensor(padded, dtype=torch.long, device=device),
            torch.tensor(lengths, dtype=torch.long, device=device))


def tokenize_prompts(tokenizer: Any, prompts: list[str] | None = None, tokens_to_generate: int | None = None,
                     add_BOS: bool | None = None, rank: int = 0,
                     data_parallel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded prompt tokens and the prompt lengths, on every rank (``prompts`` needed on the source only)."""
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed:
        if prompts is None or tokens_to_generate is None:
            raise ValueError("tokenize_prompts: prompts and tokens_to_generate are required without torch.distributed")
        return _tokenize_and_pad(tokenizer, prompts, tokens_to_generate, add_BOS)
    source = parallel_state.get_model_parallel_src_rank() if data_parallel else rank
    tokens = lengths = sizes = None
    if dist.get_rank() == source:
        if prompts is None or tokens_to_generate is None:
            raise ValueError(f"tokenize_prompts: the source rank ({source}) needs prompts and tokens_to_generate")
        tokens, lengths = _tokenize_and_pad(tokenizer, prompts, tokens_to_generate, add_BOS)
        sizes = [tokens.size(0), tokens.size(1)]
    sizes = broadcast_int_list(2, int_list=sizes, rank=rank, data_parallel=data_parallel).tolist()
    tokens = broadcast_tensor(sizes, torch.int64, tensor=tokens, rank=rank, data_parallel=data_parallel)
    lengths = broadcast_tensor([sizes[0]], torch.int64, tensor=lengths, rank=rank, data_parallel=data_parallel)
    return tokens, lengths
