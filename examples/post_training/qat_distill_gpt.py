"""Quantization-aware training and knowledge distillation of a small GPT with NVIDIA Model Optimizer, on CPU.

Data: the main job's corpus (the Python standard library's sources, collected as ``examples/main_job.py``
does), read as bytes (vocabulary 256) and cut into random windows. Three stages, each with this
library's optimizer (Adam, clipping at 1.0):

1. ``teacher``: a GPT (hidden ``--teacher-hidden``) trained from scratch for ``--teacher-steps`` steps.
2. ``qat``: a copy of the teacher quantized with ``--recipe`` (calibrated on a few batches), then
   trained ``--steps`` more steps with the quantizers in place (straight-through gradients); the
   loss before and after, and the unquantized teacher's for comparison.
3. ``distill``: a smaller student (hidden ``--student-hidden``) trained ``--steps`` steps against the
   frozen teacher with the logit KL (``--temperature``) and an MSE loss between the final norms'
   outputs (through a projection to the teacher's width); the KL to the teacher before and after.
   ``--quantize-student`` quantizes the student first (quantization-aware distillation).

Needs the ``modelopt`` extra (``pip install "nvidia-modelopt[torch]"``); 16-70 s with the
defaults (16 s on an idle machine, a third of it importing Model Optimizer)::

    python examples/post_training/qat_distill_gpt.py
    python examples/post_training/qat_distill_gpt.py --recipe INT8_DEFAULT_CFG --quantize-student
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.post_training.byte_corpus import corpus, eval_loss  # noqa: E402

from megatron_core.models.gpt import GPTModel  # noqa: E402
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron_core.post_training.modelopt.distillation import (  # noqa: E402
    DistillationConfig,
    convert_to_distillation_model,
    distillation_loss,
    export_student,
)
from megatron_core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec  # noqa: E402
from megatron_core.post_training.modelopt.qat import quantize_for_training, token_windows, train_steps  # noqa: E402
from megatron_core.post_training.modelopt.recipes import get_quant_config  # noqa: E402
from megatron_core.transformer import TransformerConfig  # noqa: E402

VOCAB = 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="FP8_DEFAULT_CFG", help="Model Optimizer quantization config name")
    p.add_argument("--teacher-hidden", type=int, default=64)
    p.add_argument("--student-hidden", type=int, default=32)
    p.add_argument("--teacher-steps", type=int, default=40)
    p.add_argument("--steps", type=int, default=30, help="QAT and distillation steps")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--temperature", type=float, default=1.0, help="logit KL temperature (> 0)")
    p.add_argument("--quantize-student", action="store_true", help="quantize the student before distilling")
    p.add_argument("--corpus-mb", type=float, default=0.3)
    return p.parse_args()



def build(hidden: int, seq: int, seed: int) -> GPTModel:
    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=2 * hidden, normalization="RMSNorm", gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True)
    return GPTModel(config, get_gpt_modelopt_spec(config, local_core_attention=True), VOCAB, seq,
                    position_embedding_type="rope")


def optimizer(model: torch.nn.Module, lr: float):
    return get_megatron_optimizer(OptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1.0), [model])



def main() -> None:
    args = parse_args()
    data = corpus(args.corpus_mb)
    print(f"corpus: {data.numel() / 1e6:.2f} MB of stdlib sources, byte vocabulary {VOCAB}", flush=True)

    teacher = build(args.teacher_hidden, args.seq, seed=1)
    train_steps(teacher, optimizer(teacher, args.lr), token_windows(data, args.seq, args.batch, args.teacher_steps))
    print(f"teacher (hidden {args.teacher_hidden}, {args.teacher_steps} steps): eval loss "
          f"{eval_loss(teacher, data, args):.4f}", flush=True)

    def calibrate(model: torch.nn.Module) -> None:
        with torch.no_grad():
            for batch in token_windows(data, args.seq, args.batch, 4, seed=99):
                model(batch["tokens"], batch["position_ids"], None)

    qat = quantize_for_training(copy.deepcopy(teacher), get_quant_config(args.recipe), calibrate)
    before = eval_loss(qat, data, args)
    losses = train_steps(qat, optimizer(qat, args.lr / 3),
                         token_windows(data, args.seq, args.batch, args.steps, seed=1))
    print(f"QAT ({args.recipe}, {args.steps} steps): eval loss {before:.4f} after quantization -> "
          f"{eval_loss(qat, data, args):.4f}; train loss (mean of 5 steps) {sum(losses[:5]) / 5:.4f} -> "
          f"{sum(losses[-5:]) / 5:.4f}", flush=True)

    student = build(args.student_hidden, args.seq, seed=2)
    if args.quantize_student:
        student = quantize_for_training(student, get_quant_config(args.recipe), calibrate)
    config = DistillationConfig(logit_kl_temperature=args.temperature, intermediate_layer_pairs=[
        ("decoder.final_layernorm", "decoder.final_layernorm", "mse")])
    model = convert_to_distillation_model(student, teacher, config)
    kl = []
    train_steps(model, optimizer(model, args.lr), token_windows(data, args.seq, args.batch, args.steps, seed=2),
                loss_func=distillation_loss, on_step=lambda step, info: kl.append(info["report"]))
    first, last = kl[0], kl[-1]
    student = export_student(model)
    print(f"distillation (student hidden {args.student_hidden}{', quantized' if args.quantize_student else ''}, "
          f"{args.steps} steps): KL to the teacher {first['logits distillation loss']:.4f} -> "
          f"{last['logits distillation loss']:.4f}, final-norm MSE {first['intermediate distillation loss']:.4f} -> "
          f"{last['intermediate distillation loss']:.4f}; student eval loss {eval_loss(student, data, args):.4f}",
          flush=True)


if __name__ == "__main__":
    main()
