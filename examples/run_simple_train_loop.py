"""The smallest complete training loop on megatron_core's public API.

Tensor parallelism over two ranks, a GPT built from the local (pure PyTorch) layer spec, data
parallel wrapping, a mock dataset through the blended builder, the pipeline schedule entry point,
gradient finalisation, five steps, and a distributed checkpoint saved and loaded back::

    torchrun --nproc-per-node 2 examples/run_simple_train_loop.py            # CPU (gloo) or GPUs (NCCL)
    torchrun --nproc-per-node 4 examples/run_simple_train_loop.py --pp 2     # TP=2 x PP=2

It is the counterpart of Megatron-Core's ``run_simple_mcore_train_loop.py``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from functools import partial

import torch
import torch.distributed as dist

from megatron_core import device, dist_checkpointing, parallel_state
from megatron_core.datasets import BlendedMegatronDatasetBuilder, GPTDatasetConfig, MockGPTDataset
from megatron_core.datasets.tokenizers import NullTokenizer
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_core.transformer import TransformerConfig

SEQ_LENGTH = 64
MICRO_BATCH = 8



def _free_local_port() -> int:
    """A port the OS reports free on 127.0.0.1 (for a run without torchrun's environment)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

def initialize_distributed(tensor_model_parallel_size: int, pipeline_model_parallel_size: int) -> None:
    """One process per device; NCCL on GPUs, gloo on CPU; then the model-parallel groups and seeds."""
    parallel_state.destroy_model_parallel()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.cuda_available():
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_local_port()))  # no fixed shared port
        dist.init_process_group(
            device.get_default_backend(),
            rank=int(os.environ.get("RANK", "0")), world_size=int(os.environ.get("WORLD_SIZE", "1")),
        )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)
    model_parallel_cuda_manual_seed(123)


def model_provider() -> GPTModel:
    """A two-layer GPT; each pipeline stage builds only its own layers."""
    config = TransformerConfig(
        num_layers=2, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
    )
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=100,
        max_sequence_length=SEQ_LENGTH,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
    )


def get_train_data_iterator():
    """Mock GPT samples through Megatron's blended dataset builder."""
    config = GPTDatasetConfig(
        random_seed=0, sequence_length=SEQ_LENGTH, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, tokenizer=NullTokenizer(vocab_size=64),
    )
    train_ds, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, [1000, None, None], lambda: True, config).build()
    loader = torch.utils.data.DataLoader(train_ds, batch_size=MICRO_BATCH, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    return iter(loader)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked mean of the per-token losses."""
    losses = output_tensor.float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def forward_step_func(data_iterator, model):
    """One micro-batch: move it to the device, run the model, hand back the loss function."""
    target = device.get_current_device()
    data = {k: v.to(target) for k, v in next(data_iterator).items()}
    output = model(data["tokens"], data["position_ids"], data.get("attention_mask"), labels=data["labels"])
    return output, partial(loss_func, data["loss_mask"])


def save_distributed_checkpoint(checkpoint_dir: str, model: DistributedDataParallel) -> None:
    """Write the model's sharded state dict."""
    dist_checkpointing.save(sharded_state_dict=model.sharded_state_dict(prefix=""), checkpoint_dir=checkpoint_dir)


def load_distributed_checkpoint(checkpoint_dir: str, model: DistributedDataParallel) -> None:
    """Read the sharded state dict back into ``model``."""
    state_dict = dist_checkpointing.load(sharded_state_dict=model.sharded_state_dict(prefix=""),
                                         checkpoint_dir=checkpoint_dir)
    model.module.load_state_dict(state_dict)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: min(2, world size))")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--checkpoint-dir", default=None, help="default: a fresh temporary directory")
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    initialize_distributed(args.tp or min(2, world_size // args.pp), args.pp)

    gpt_model = model_provider().to(device.get_current_device())
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    model = DistributedDataParallel(config=gpt_model.config, ddp_config=ddp_config, module=gpt_model)
    optim = torch.optim.Adam(model.parameters())
    train_iterator = get_train_data_iterator()
    forward_backward_func = get_forward_backward_func()

    for iteration in range(args.iterations):
        optim.zero_grad()
        model.zero_grad_buffer()
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=train_iterator, model=model, num_microbatches=1,
            seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH, decoder_seq_length=SEQ_LENGTH, forward_only=False,
        )
        finalize_model_grads([model])
        for param in model.parameters():
            param.grad = param.main_grad
        optim.step()
        if losses_reduced:
            print(f"rank {dist.get_rank()}: iteration {iteration} losses {[float(d['lm loss']) for d in losses_reduced]}",
                  flush=True)

    checkpoint_dir = args.checkpoint_dir
    if checkpoint_dir is None:
        shared = [tempfile.mkdtemp(prefix="simple_loop_ckpt_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        checkpoint_dir = os.path.join(shared[0], "ckpt")
    save_distributed_checkpoint(checkpoint_dir, model)
    before = [p.detach().clone() for p in model.module.parameters()]
    with torch.no_grad():
        for p in model.module.parameters():
            p.zero_()
    load_distributed_checkpoint(checkpoint_dir, model)
    restored = all(torch.equal(a, b) for a, b in zip(before, model.module.parameters()))
    if not restored:
        raise RuntimeError(f"rank {dist.get_rank()}: parameters differ after loading {checkpoint_dir}")
    if dist.get_rank() == 0:
        print(f"saved and reloaded a distributed checkpoint in {checkpoint_dir}: parameters identical", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
