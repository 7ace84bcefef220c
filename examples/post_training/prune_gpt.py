"""Minitron pruning of a small GPT on CPU: train, prune width and depth, fine-tune, save and reload.

Data: the main job's corpus (the Python standard library's sources, collected as ``examples/main_job.py``
does), read as bytes (vocabulary 256) and cut into random windows. A GPT (4 layers, hidden 64, 4 heads in 2
query groups, SwiGLU 128) is trained for ``--train-steps`` steps, pruned with
``megatron_core.post_training.modelopt.pruning.prune`` (the arguments of Megatron-LM's
``mtp.prune(model, mode="mcore_minitron", ...)``; importance from ``--calib-batches`` calibration batches) to
``--export-config`` and fine-tuned for ``--finetune-steps`` steps; the held-out loss is printed at each stage.
``--save DIR`` writes the pruned model with ``dist_checkpointing`` and loads it into a fresh GPTModel of the
pruned config. Needs no optional package::

    python examples/post_training/prune_gpt.py
    python examples/post_training/prune_gpt.py --export-config '{"hidden_size": 32, "num_layers": 2}'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.post_training.byte_corpus import corpus, eval_loss  # noqa: E402

from megatron_core import dist_checkpointing, parallel_state  # noqa: E402
from megatron_core.models.gpt import GPTModel  # noqa: E402
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron_core.post_training.modelopt.pruning import prune  # noqa: E402
from megatron_core.post_training.modelopt.qat import token_windows, train_steps  # noqa: E402
from megatron_core.transformer import TransformerConfig  # noqa: E402

VOCAB = 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export-config", type=json.loads,
                   default={"hidden_size": 48, "ffn_hidden_size": 96, "num_attention_heads": 2, "num_layers": 3},
                   help="target sizes as JSON (keys: hidden_size, ffn_hidden_size, num_attention_heads, "
                        "num_query_groups, num_layers)")
    p.add_argument("--train-steps", type=int, default=60)
    p.add_argument("--finetune-steps", type=int, default=20)
    p.add_argument("--calib-batches", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus-mb", type=float, default=0.3)
    p.add_argument("--save", default=None, help="directory for the pruned checkpoint (must not exist)")
    return p.parse_args()



def build(config: TransformerConfig, seq: int, seed: int) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), VOCAB, seq,
                    position_embedding_type="rope")



def train(model: torch.nn.Module, data: torch.Tensor, steps: int, seed: int, args: argparse.Namespace) -> None:
    opt = get_megatron_optimizer(OptimizerConfig(lr=args.lr, weight_decay=0.0, clip_grad=1.0), [model])
    model.train()
    train_steps(model, opt, token_windows(data, args.seq, args.batch, steps, seed=seed))


def save_and_reload(model: GPTModel, path: str, data: torch.Tensor, args: argparse.Namespace) -> None:
    # dist_checkpointing is collective: a one-rank gloo group stands in for a launched job.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        dist_checkpointing.save(model.sharded_state_dict(), path)
        fresh = build(model.config, args.seq, seed=5)
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), path))
        print(f"reloaded from {path}: eval loss {eval_loss(fresh, data, args):.4f}", flush=True)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def main() -> None:
    args = parse_args()
    data = corpus(args.corpus_mb)
    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=128, normalization="RMSNorm", gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True)
    model = build(config, args.seq, seed=1)
    train(model, data, args.train_steps, seed=0, args=args)
    params = sum(p.numel() for p in model.parameters())
    print(f"trained ({args.train_steps} steps, {params} parameters): eval loss {eval_loss(model, data, args):.4f}")

    def forward_loop(m: torch.nn.Module) -> None:
        for batch in token_windows(data, args.seq, args.batch, args.calib_batches, seed=99):
            m(batch["tokens"], batch["position_ids"], None)

    _, result = prune(model, mode="mcore_minitron", constraints={"export_config": args.export_config},
                      dummy_input=None, config={"forward_loop": forward_loop})
    c = model.config
    print(f"pruned to {args.export_config}: layer Block Importance {result['importance'].layers.tolist()}")
    print(f"pruned (layers {c.num_layers}, hidden {c.hidden_size}, ffn {c.ffn_hidden_size}, heads "
          f"{c.num_attention_heads} in {c.num_query_groups} groups, {sum(p.numel() for p in model.parameters())} "
          f"parameters): eval loss {eval_loss(model, data, args):.4f}")
    train(model, data, args.finetune_steps, seed=1, args=args)
    print(f"fine-tuned ({args.finetune_steps} steps): eval loss {eval_loss(model, data, args):.4f}", flush=True)
    if args.save:
        save_and_reload(model, args.save, data, args)


if __name__ == "__main__":
    main()
