"""``--moe-use-upcycling``: start a MoE run from a dense checkpoint (Megatron-LM's flag).

The dense model that ``--load`` holds is built from the same flags without experts, loaded, and its weights are
upcycled into the MoE model (``megatron_core.transformer.moe.upcycling_utils``). The upcycled model is saved to
``--save`` at iteration 1 and training goes on from there, as Megatron-LM does; later runs resume from
``--save`` without the flag.
"""

from __future__ import annotations

import argparse
import copy

import torch

from gpt_training.model_builder import build_model, transformer_config_from_args
from megatron_core.training import load_checkpoint, read_tracker
from megatron_core.transformer.moe.upcycling_utils import load_and_upcycle_model

UPCYCLED_ITERATION = 1


def validate_upcycling_args(args: argparse.Namespace) -> None:
    """The flags ``--moe-use-upcycling`` needs; ValueError naming the missing or conflicting one."""
    if not args.moe_use_upcycling:
        return
    needs = [("--num-experts", args.num_experts is not None), ("--load (the dense checkpoint)", args.load),
             ("--save (where the upcycled checkpoint goes)", args.save)]
    missing = [flag for flag, given in needs if not given]
    if missing:
        raise ValueError(f"--moe-use-upcycling needs {', '.join(missing)}")
    conflicts = [flag for flag, given in (("--use-torch-fsdp2", args.use_torch_fsdp2), ("--hf-model", args.hf_model))
                 if given]
    if conflicts:
        raise ValueError(f"--moe-use-upcycling cannot be combined with {', '.join(conflicts)}")


def _dense_args(args: argparse.Namespace) -> argparse.Namespace:
    dense = copy.copy(args)
    dense.num_experts = None
    dense.expert_model_parallel_size = 1
    dense.expert_tensor_parallel_size = None
    return dense


def upcycle_dense_checkpoint(args: argparse.Namespace, model: list[torch.nn.Module], optimizer, vocab_size: int
                             ) -> int:
    """Fill ``model`` with the upcycled weights of the dense checkpoint in ``--load``; returns the iteration
    the MoE run starts at. Refuses a ``--save`` that already holds checkpoints (upcycling is a first run only)."""
    published = read_tracker(args.save)
    if published is not None:
        raise ValueError(f"--moe-use-upcycling: --save {args.save} already holds checkpoints (up to iteration "
                         f"{published}); upcycling is only for the first MoE run: resume with --load {args.save} "
                         "and without --moe-use-upcycling")
    dense_args = _dense_args(args)
    dense_model = build_model(dense_args, transformer_config_from_args(dense_args), vocab_size)

    def load_dense() -> tuple[int, float]:
        state = load_checkpoint(args.load, dense_model, None, None, load_optimizer=False, load_rng=False)
        return state["iteration"], 0.0

    load_and_upcycle_model(load_dense, model, dense_model)
    optimizer.reload_model_params()  # the optimizer's main (fp32) copies follow the new weights
    return UPCYCLED_ITERATION
