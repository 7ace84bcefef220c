"""Fine-tune a hybrid Mamba model (``HybridModel``) from a Hugging Face NemotronH or Mamba2 directory.

Megatron-LM's users run ``pretrain_hybrid.py`` for hybrid models (``pretrain_mamba.py`` is its deprecated
alias). Here it is ``pretrain_gpt.py``'s training loop (same flags, data, checkpoints, logging) with the
model, its layer pattern and its weights taken from ``--hf-model``, which is required::

    python examples/pretrain_hybrid.py --hf-model /models/nemotron-h --mock-data --seq-length 512 \\
        --micro-batch-size 2 --global-batch-size 8 --train-iters 100 --lr 1e-5 --save /tmp/ckpt

Building a hybrid model from flags (Megatron-LM's ``--hybrid-layer-pattern`` and Mamba sizes) is not offered.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt_training.hf_model import load_bridge  # noqa: E402
from gpt_training.loop import exit_run  # noqa: E402
from megatron_core.command_line import run_command  # noqa: E402

PROG = "pretrain_hybrid.py"


def check_hybrid_source(argv: list[str]) -> None:
    """Refuse a run without ``--hf-model`` or with a directory that does not hold a hybrid model."""
    parser = argparse.ArgumentParser(prog=PROG, add_help=False)
    parser.add_argument("--hf-model", default=None)
    known, _ = parser.parse_known_args(argv)
    if not known.hf_model:
        raise ValueError("--hf-model DIR is required: the hybrid model (layer pattern, Mamba sizes, weights) is "
                         "built from a Hugging Face NemotronHForCausalLM or Mamba2ForCausalLM directory")
    bridge = load_bridge(known.hf_model, load_weights=False)
    if bridge.family.hybrid_pattern is None:
        raise ValueError(f"--hf-model {known.hf_model} holds a {bridge.architecture}, not a hybrid Mamba model; "
                         "train it with pretrain_gpt.py")


def main(argv: list[str] | None = None) -> int:
    """Check the source is a hybrid model, then run ``pretrain_gpt.py``'s training; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" not in argv and "--help" not in argv:
        status = run_command(PROG, lambda: check_hybrid_source(argv))
        if status:
            return status
    from pretrain_gpt import main as train

    return train(argv)


if __name__ == "__main__":
    exit_run(main())
