"""A user's ``forward_step_func`` for GPT under pipeline parallelism, in a short training loop.

Each pipeline rank builds only its chunk of a tiny GPT with tied input/output embeddings through
``get_model`` (which wraps it in ``DistributedDataParallel``), and hands ``forward_step_func`` to
the schedule returned by ``get_forward_backward_func()`` (1F1B, or interleaved with ``--vpp``). The schedule calls the
function once per microbatch on every stage; only the last stage runs ``loss_func`` and gets the
loss dicts back. ``configure_model_hooks`` sets ``config.finalize_model_grads_func`` (data-parallel
reduction and the tied-embedding all-reduce between the first and last stage) and the other hooks::

    torchrun --nproc-per-node 2 examples/gpt_pipeline_forward_step.py                 # PP=2, CPU gloo or GPUs
    torchrun --nproc-per-node 2 examples/gpt_pipeline_forward_step.py --vpp 2         # two virtual stages per rank
    torchrun --nproc-per-node 4 examples/gpt_pipeline_forward_step.py --pp 2          # PP=2 x DP=2
    torchrun --nproc-per-node 2 examples/gpt_pipeline_forward_step.py --bf16          # bf16 (GPUs; CPU works, slowly)

With ``--bf16`` each chunk is wrapped in ``Float16Module`` (bf16 weights, fp32 loss on the last
stage), activations travel between stages in bf16, gradients are reduced in fp32 and the optimizer
keeps fp32 main weights.
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import torch
import torch.distributed as dist

from megatron_core import device, parallel_state
from megatron_core.distributed import DistributedDataParallelConfig
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_core.training.model_builder import configure_model_hooks, get_model
from megatron_core.transformer import TransformerConfig

VOCAB, SEQ_LENGTH, MICRO_BATCH = 128, 16, 4


def _free_local_port() -> int:
    """A port the OS reports free on 127.0.0.1 (for a run without torchrun's environment)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_batch(data_iterator) -> dict[str, torch.Tensor]:
    """The next microbatch on this device (GPTModel reads tokens on the first stage, labels on the last)."""
    batch = next(data_iterator)
    target = device.get_current_device()
    return {k: v.to(target) for k, v in batch.items()}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked mean of the per-token cross entropy the last stage's GPTModel returned (``labels`` given)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step_func(data_iterator, model):
    """One microbatch on one stage: returns ``(output_tensor, loss_func)``.

    On stages after the first, the schedule has already called ``model.set_input_tensor(...)`` with
    the activation received from the previous stage and GPTModel ignores ``input_ids``; on stages
    before the last, the output is the hidden state sent on and ``loss_func`` is never called.
    """
    batch = get_batch(data_iterator)
    output_tensor = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output_tensor, partial(loss_func, batch["loss_mask"])


def synthetic_batches(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` microbatches of a learnable toy task: the next token is the current one plus one."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        start = torch.randint(0, VOCAB, (MICRO_BATCH, 1), generator=gen)
        tokens = (start + torch.arange(SEQ_LENGTH + 1)) % VOCAB
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                    "loss_mask": torch.ones(MICRO_BATCH, SEQ_LENGTH),
                    "position_ids": torch.arange(SEQ_LENGTH).expand(MICRO_BATCH, SEQ_LENGTH)})
    return out


def gpt_config(pp: int, vpp: int | None, bf16: bool = False) -> TransformerConfig:
    """A 4-layer GPT config split into ``pp`` stages (``vpp`` virtual stages per rank)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, use_cpu_initialization=not device.cuda_available(),
        hidden_dropout=0.0, attention_dropout=0.0, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=dtype, bf16=bf16, params_dtype=dtype,
    )


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                   config: TransformerConfig | None = None, pg_collection=None) -> GPTModel:
    """One chunk: ``get_model`` calls this per virtual stage; each chunk builds only its own layers."""
    return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ_LENGTH, pre_process=pre_process,
                    post_process=post_process, share_embeddings_and_output_weights=True, vp_stage=vp_stage)


def train(pp: int, vpp: int | None = None, num_microbatches: int = 4, iterations: int = 5,
          bf16: bool = False) -> list[float]:
    """Train for ``iterations`` steps; returns the mean loss per step on the last stage (``[]`` elsewhere)."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
    model_parallel_cuda_manual_seed(1234)
    config = gpt_config(pp, vpp, bf16)
    # One DDP-wrapped chunk per virtual stage (in a Float16Module with bf16), then the schedule's hooks.
    model = get_model(model_provider, config=config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=bf16))
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=3e-3, weight_decay=0.0, clip_grad=1.0, bf16=bf16,
                                                       params_dtype=config.params_dtype), model)
    configure_model_hooks(config, model, optimizer)
    forward_backward_func = get_forward_backward_func()
    dp_rank = parallel_state.get_data_parallel_rank()
    history = []
    for step in range(iterations):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        batches = synthetic_batches(num_microbatches, seed=1000 * step + dp_rank)
        iterators = [iter(batches) for _ in model]  # every chunk reads the same microbatches in order
        losses = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=iterators if vpp else iterators[0],
            model=model if vpp else model[0], num_microbatches=num_microbatches,
            seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH,
        )
        optimizer.step()
        if losses:
            history.append(float(torch.stack([d["lm loss"] for d in losses]).mean()))
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=None, help="pipeline parallel size (default: world size)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual stages per pipeline rank")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--bf16", action="store_true", help="bf16 weights and activations, fp32 main weights")
    args = parser.parse_args()
    if device.cuda_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_local_port()))  # no fixed shared port
    dist.init_process_group(device.get_default_backend(), rank=int(os.environ.get("RANK", "0")),
                            world_size=int(os.environ.get("WORLD_SIZE", "1")))
    history = train(args.pp or dist.get_world_size(), args.vpp, args.microbatches, args.iterations, args.bf16)
    for step, loss in enumerate(history):
        print(f"rank {dist.get_rank()} (last stage): step {step} lm loss {loss:.4f}", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
