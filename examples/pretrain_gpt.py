"""Pretrain a GPT with megatron_core: tensor, pipeline and data parallelism, mixed precision, checkpoints.

Runs on CPU (gloo) and GPUs (NCCL), as one process or under torchrun::

    torchrun --nproc-per-node 4 examples/pretrain_gpt.py --model-preset tiny --mock-data --vocab-size 1024 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 2 \\
        --global-batch-size 8 --train-iters 50 --save /tmp/ckpt --save-interval 25

Flags keep Megatron-LM's names (``python examples/pretrain_gpt.py --help``).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gpt_training.arguments import build_parser, validate_args  # noqa: E402
from gpt_training.checkpointing import Checkpointer  # noqa: E402
from gpt_training.data import build_datasets, build_loader, build_tokenizer_from_args, cyclic  # noqa: E402
from gpt_training.distributed_init import init_distributed, set_random_seed  # noqa: E402
from gpt_training.hf_model import hf_model_chunks, hf_tokenizer, load_bridge  # noqa: E402
from gpt_training.logger import TrainingLogger  # noqa: E402
from gpt_training.loop import Trainer, exit_run  # noqa: E402
from gpt_training.metrics import flops_per_token, peak_flops  # noqa: E402
from gpt_training.model_builder import build_model, count_parameters, transformer_config_from_args  # noqa: E402
from gpt_training.upcycling import upcycle_dense_checkpoint  # noqa: E402
from megatron_core import parallel_state  # noqa: E402
from megatron_core.command_line import run_command  # noqa: E402
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron_core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron_core.tensor_parallel import pad_vocab_size  # noqa: E402
from megatron_core.training.model_builder import configure_model_hooks  # noqa: E402
from megatron_core.transformer import TransformerConfig  # noqa: E402
from megatron_core.transformer.moe.router_trace import get_moe_router_tracer, init_moe_router_tracer  # noqa: E402

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_PRECISION_AWARE_DTYPES = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


def build_optimizer(args, chunks):
    """Megatron optimizer and LR scheduler from the flags."""
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
            sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
            loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
            use_distributed_optimizer=args.use_distributed_optimizer,
            use_precision_aware_optimizer=args.use_precision_aware_optimizer,
            **{name: _DTYPES[getattr(args, name)] for name in _PRECISION_AWARE_DTYPES},
        ),
        chunks,
    )
    wsd_steps = args.lr_wsd_decay_iters * args.global_batch_size if args.lr_wsd_decay_iters else None
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=args.lr_decay_iters * args.global_batch_size, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters * args.global_batch_size,
        wd_incr_style="constant", wsd_decay_steps=wsd_steps,
        lr_wsd_decay_style="linear" if wsd_steps else None,
    )
    return optimizer, scheduler


@dataclass
class TrainingSetup:
    """Everything ``setup`` builds: the model chunks, their optimizer and scheduler, and the data iterators."""

    model: list[torch.nn.Module]
    optimizer: Any
    scheduler: OptimizerParamScheduler
    train_data_iterator: Iterator[dict]
    valid_data_iterator: Callable[[], Iterator[dict]] | Iterator[dict] | None
    config: TransformerConfig
    checkpointer: Checkpointer
    iteration: int
    vocab_size: int


def setup(args: argparse.Namespace) -> TrainingSetup:
    """Model-parallel groups, tokenizer, model, optimizer, scheduler, checkpoint and data for validated ``args``.

    ``torch.distributed`` must be initialised and ``args`` validated (``validate_args``); with ``--load``
    the state is restored and the data iterators resume where the checkpoint left off.
    """
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    set_random_seed(args.seed)  # the CPU generator too: on a GPU the CPU-initialised weights were unseeded

    bridge = load_bridge(args.hf_model) if args.hf_model else None
    tokenizer = hf_tokenizer(bridge, args, build_tokenizer_from_args) if bridge else build_tokenizer_from_args(args)
    vocab_size = pad_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    config, models = transformer_config_from_args(args), None
    if bridge is not None:  # --hf-model: the model and its weights come from the Hugging Face directory
        config, models, vocab_size = hf_model_chunks(bridge, args, config)
    model = build_model(args, config, vocab_size, models=models)
    optimizer, scheduler = build_optimizer(args, model)
    configure_model_hooks(config, model, optimizer)

    checkpointer = Checkpointer(args, model, optimizer, scheduler)
    if args.moe_use_upcycling:  # --load holds a dense checkpoint: upcycle it and save the MoE model first
        iteration, consumed = upcycle_dense_checkpoint(args, model, optimizer, vocab_size), 0
        checkpointer.save(iteration)
    else:
        iteration, consumed = checkpointer.load() if args.load else (0, 0)
        checkpointer.check_save_dir(iteration)
    train_ds, valid_ds, _ = build_datasets(args, tokenizer)  # the dataset builder builds on rank 0 first
    train_iter = iter(build_loader(train_ds, args, consumed))
    valid_loader = build_loader(valid_ds, args, 0)
    # A fresh iterator per evaluation (the same batches each time) or one that carries on through the split.
    valid_iter = (lambda: iter(valid_loader)) if args.fixed_validation_set else cyclic(valid_loader)
    checkpointer.consumed_samples = lambda it: it * args.global_batch_size
    return TrainingSetup(model, optimizer, scheduler, train_iter, valid_iter, config, checkpointer, iteration,
                         vocab_size)


PROG = "pretrain_gpt.py"


def _prepare(argv: list[str] | None, prepared: dict) -> None:
    """Flags, process groups and everything :func:`setup` builds, into ``prepared``; user errors raise."""
    args = build_parser().parse_args(argv)
    rank, world_size = init_distributed(args.distributed_timeout_minutes)
    prepared.update(rank=rank, world_size=world_size)
    args = validate_args(args, world_size)
    logger = TrainingLogger(args, rank)
    prepared.update(args=args, logger=logger, run=setup(args))


def _tear_down() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Parse flags, build everything, train, checkpoint and evaluate; returns the exit status.

    A bad flag, path or checkpoint ends the run before training with one line and status 2
    (:func:`megatron_core.command_line.run_command`); failures while training keep their traceback.
    """
    prepared: dict = {}
    status = run_command(PROG, lambda: _prepare(argv, prepared))
    if status:
        _tear_down()
        return status
    args, logger, run = prepared["args"], prepared["logger"], prepared["run"]
    rank, world_size = prepared["rank"], prepared["world_size"]
    logger.info(
        f"world {world_size} = tp {args.tensor_model_parallel_size} x pp {args.pipeline_model_parallel_size} x "
        f"cp {args.context_parallel_size} x "
        f"dp {args.data_parallel_size}; {args.num_microbatches} micro-batches of {args.micro_batch_size}; "
        f"{count_parameters(run.model) / 1e6:.2f}M parameters on rank 0; vocab {run.vocab_size}; "
        f"start at {run.iteration}"
    )
    if args.moe_routing_trace_path:  # hooks on every router; the loop ends each traced iteration
        init_moe_router_tracer(
            output_dir=args.moe_routing_trace_path, rank=rank, training_mode=True,
            max_steps=args.moe_routing_trace_max_training_iters or args.train_iters,
            capture_hidden_states=args.moe_routing_trace_capture_hidden_states,
            capture_logits=args.moe_routing_trace_capture_logits,
            dump_router_weights=args.moe_routing_trace_dump_weights,
        )
        get_moe_router_tracer().register_hooks(run.model)
    trainer = Trainer(args, run.config, run.model, run.optimizer, run.scheduler, run.train_data_iterator,
                      run.valid_data_iterator, logger, run.checkpointer)
    try:
        final = trainer.train(run.iteration, flops_per_token(args, run.vocab_size), peak_flops())
        if final >= args.train_iters:
            # The trained state is saved first: nothing after training (the final evaluation) can lose it.
            if args.save and not (args.save_interval and final % args.save_interval == 0):
                run.checkpointer.save(final)
            if args.eval_iters > 0 and (not args.eval_interval or final % args.eval_interval != 0):
                logger.log(final, {"validation loss": trainer.evaluate()}, kind="valid")
    finally:
        trainer.close()
    if get_moe_router_tracer() is not None:
        get_moe_router_tracer().flush()
    run.checkpointer.finalize()
    logger.close()
    _tear_down()
    return 0


if __name__ == "__main__":
    exit_run(main())
