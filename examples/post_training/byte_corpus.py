"""The README main job's corpus (the Python standard library's sources) as one byte stream, for the post-training
examples that train byte-level models on it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from examples.main_job import collect_corpus


def corpus(megabytes: float) -> torch.Tensor:
    """The main job's corpus, about ``megabytes`` of it, as a 1-D tensor of byte values."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stdlib.jsonl"
        collect_corpus(path, int(megabytes * 1e6))
        text = "\n".join(json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines())
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
