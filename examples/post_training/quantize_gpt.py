"""Post-training quantization of a small GPT with NVIDIA Model Optimizer, on CPU (fake quantization).

Builds a GPT on the Model Optimizer layer spec, trains it briefly on a toy next-token task (repeat
the previous token) so that it has something to lose, quantizes it with one of Model Optimizer's
predefined recipes after a few calibration batches, and evaluates both models: loss and greedy
next-token accuracy on held-out batches, and how far the quantized logits move. Needs the
``modelopt`` extra (``pip install "nvidia-modelopt[torch]"``)::

    python examples/post_training/quantize_gpt.py --recipe FP8_DEFAULT_CFG
    python examples/post_training/quantize_gpt.py --recipe INT4_AWQ_CFG --save /tmp/gpt_int4

``--save`` writes a quantized checkpoint (``dist_checkpointing`` + Model Optimizer's state) and loads
it back into a fresh model to show the logits survive the round trip.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from megatron_core import dist_checkpointing, parallel_state
from megatron_core.models.gpt import GPTModel
from megatron_core.post_training.modelopt.calibration import check_calibrated
from megatron_core.post_training.modelopt.checkpointing import load_modelopt_state, save_modelopt_state
from megatron_core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec
from megatron_core.post_training.modelopt.recipes import get_quant_config
from megatron_core.transformer import TransformerConfig

VOCAB, SEQ, BATCH = 128, 32, 8


def build(seed: int) -> GPTModel:
    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=256, normalization="RMSNorm", gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True)
    spec = get_gpt_modelopt_spec(config, local_core_attention=True)
    return GPTModel(config, spec, VOCAB, SEQ, position_embedding_type="rope", parallel_output=False)


def toy_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random tokens; the label of each position is its own token (a copy task)."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return ids, torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ), ids


def train(model: GPTModel, steps: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        ids, pos, labels = toy_batch(step)
        loss = model(ids, pos, None, labels=labels).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@torch.no_grad()
def evaluate(model: GPTModel, batches: range) -> tuple[float, float, torch.Tensor]:
    """(mean loss, next-token accuracy, logits of the first batch) on held-out batches."""
    losses, hits, first = [], [], None
    for step in batches:
        ids, pos, labels = toy_batch(step)
        logits = model(ids, pos, None)
        first = logits if first is None else first
        losses.append(F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).item())
        hits.append((logits.argmax(-1) == labels).float().mean().item())
    return sum(losses) / len(losses), sum(hits) / len(hits), first


def main() -> None:
    import modelopt.torch.quantization as mtq

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="FP8_DEFAULT_CFG",
                        help="a Model Optimizer config name; CPU runs FP8_DEFAULT_CFG, INT8_SMOOTHQUANT_CFG, "
                             "INT4_AWQ_CFG, INT8_DEFAULT_CFG (an unknown name lists the known ones)")
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--calib-batches", type=int, default=4)
    parser.add_argument("--save", default=None, help="directory for a quantized checkpoint (must not exist)")
    args = parser.parse_args()

    model = build(seed=0)
    train(model, args.train_steps)
    held_out = range(10_000, 10_004)
    loss, acc, ref_logits = evaluate(model, held_out)
    print(f"fp32      loss {loss:.4f}  accuracy {acc:.3f}")

    def forward_loop(m: GPTModel) -> None:
        for step in range(5_000, 5_000 + args.calib_batches):
            ids, pos, _ = toy_batch(step)
            m(ids, pos, None)

    mtq.quantize(model, get_quant_config(args.recipe), forward_loop)
    check_calibrated(model)
    q_loss, q_acc, q_logits = evaluate(model, held_out)
    rel = ((q_logits - ref_logits).norm() / ref_logits.norm()).item()
    print(f"{args.recipe:<10s} loss {q_loss:.4f}  accuracy {q_acc:.3f}  relative logit change {rel:.4f}")

    if args.save:
        # dist_checkpointing is collective: a one-rank gloo group stands in for a launched job.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        dist_checkpointing.save(model.sharded_state_dict(), args.save)
        save_modelopt_state(model, args.save)
        fresh = build(seed=1)
        load_modelopt_state(fresh, args.save)
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), args.save))
        _, _, loaded_logits = evaluate(fresh, held_out)
        print(f"reloaded from {args.save}: max |logit difference| {(loaded_logits - q_logits).abs().max().item():.3g}")
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
