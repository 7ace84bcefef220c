"""The README main job's corpus (the Python standard library's sources) as one byte stream, and the held-out loss on
it, for the post-training examples that train byte-level models on it."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from examples.main_job import collect_corpus

from megatron_core.post_training.modelopt.qat import token_windows


def corpus(megabytes: float) -> torch.Tensor:
    """The main job's corpus, about ``megabytes`` of it, as a 1-D tensor of byte values."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stdlib.jsonl"
        collect_corpus(path, int(megabytes * 1e6))
        text = "\n".join(json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines())
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def eval_loss(model: torch.nn.Module, data: torch.Tensor, args: argparse.Namespace) -> float:
    """Mean LM loss on 4 held-out batches (seed 1000) of ``args.batch`` windows of ``args.seq`` bytes."""
    model.eval()
    with torch.no_grad():
        losses = [model(b["tokens"], b["position_ids"], None, labels=b["labels"]).mean().item()
                  for b in token_windows(data, args.seq, args.batch, 4, seed=1000)]
    return sum(losses) / len(losses)
