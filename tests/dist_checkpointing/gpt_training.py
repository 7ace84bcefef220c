"""A tiny GPT training setup (DDP, Megatron optimizer, scheduler, pipeline schedule) for checkpoint tests.

``build`` makes this rank's model chunks under the current ``parallel_state`` layout; ``train_step``
runs one optimizer step on a global batch that depends only on the step number, so any layout
trains on the same data. ``logits`` runs a fixed batch through the pipeline (full vocabulary).
"""

from __future__ import annotations

from functools import partial

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.device import get_current_device
from megatron_core.distributed import DistributedDataParallelConfig
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.training.model_builder import configure_model_hooks, get_model
from megatron_core.transformer import TransformerConfig
from tests.models.gpt_test_utils import BATCH as MBS
from tests.models.gpt_test_utils import MAX_SEQ, SEQ, VOCAB, llama_like

NUM_MICROBATCHES = 2
__all__ = ["MBS", "NUM_MICROBATCHES", "SEQ", "VOCAB", "build", "gpt_config", "logits", "train_step", "weights"]


def gpt_config(tp: int, pp: int, hidden: int = 32, num_layers: int = 4, dropout: float = 0.0,
               bf16: bool = False, vpp: int | None = None) -> TransformerConfig:
    """The shared ``llama_like`` tiny config (RMSNorm, SwiGLU, GQA, no bias) for a (tp, pp, vpp) layout."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    spec = llama_like(num_layers=num_layers, hidden_size=hidden, ffn_hidden_size=2 * hidden, hidden_dropout=dropout)
    return TransformerConfig(**spec["config"], bf16=bf16, params_dtype=dtype, tensor_model_parallel_size=tp,
                             pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                             pipeline_dtype=dtype)


def build(tp: int, pp: int, *, distributed_optimizer: bool = False, seed: int = 1234, hidden: int = 32,
          num_layers: int = 4, dropout: float = 0.0, bf16: bool = False, vpp: int | None = None):
    """``(ddp_chunks, optimizer, scheduler)`` for a fresh parallel_state layout (initialises it).

    With ``bf16`` the model is bf16 inside a ``Float16Module`` and the optimizer keeps fp32 main params;
    with ``vpp`` each rank holds ``vpp`` model chunks (interleaved schedule).
    """
    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = gpt_config(tp, pp, hidden, num_layers, dropout, bf16, vpp)
    provider = partial(GPTModel, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                       max_sequence_length=MAX_SEQ, position_embedding_type="rope")
    chunks = get_model(provider, config=config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=bf16, use_distributed_optimizer=distributed_optimizer))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        lr=1e-2, min_lr=1e-3, weight_decay=0.01, clip_grad=1.0, bf16=bf16,
        use_distributed_optimizer=distributed_optimizer), chunks)
    configure_model_hooks(config, chunks, optimizer)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2,
                                        lr_decay_steps=20, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=20, wd_incr_style="constant")
    return chunks, optimizer, scheduler


def _batches(step: int) -> list[dict]:
    """This DP rank's microbatches of global step ``step``."""
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (dp * NUM_MICROBATCHES, MBS, SEQ + 1), generator=gen)
    mine = tokens[dp_rank * NUM_MICROBATCHES:(dp_rank + 1) * NUM_MICROBATCHES]
    device = get_current_device()  # the CPU under gloo; the GPU under NCCL (the GPU golden curve)
    return [{"tokens": t[:, :-1].to(device), "labels": t[:, 1:].to(device)} for t in mine]


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    positions = torch.arange(SEQ, device=batch["tokens"].device).unsqueeze(0).expand(MBS, SEQ)
    output = model(batch["tokens"], positions, None, labels=batch["labels"])

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def _iterators(chunks, items: list):
    return [iter(items) for _ in chunks] if len(chunks) > 1 else iter(items)


def _model(chunks):
    return chunks if len(chunks) > 1 else chunks[0]


def train_step(chunks, optimizer, scheduler, step: int) -> list[torch.Tensor]:
    """One optimizer step on global batch ``step``; returns this rank's microbatch losses (last stage)."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    batches = _batches(step)
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=_iterators(chunks, batches), model=_model(chunks),
        num_microbatches=NUM_MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS)
    success, _, _ = optimizer.step()
    assert success
    scheduler.step(increment=MBS * NUM_MICROBATCHES * parallel_state.get_data_parallel_world_size())
    return [d["lm loss"] for d in losses]


def logits(chunks, seed: int = 99) -> torch.Tensor | None:
    """Full-vocab logits of a fixed batch through the pipeline (last stage only, else ``None``)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=gen)
    positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    out: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        output = model(tokens, positions, None)

        def collect(t):
            out.append(tensor_parallel.gather_from_tensor_model_parallel_region(t).detach().float().clone())
            return t.sum() * 0, {}

        return output, collect

    with torch.no_grad():
        microbatches = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=_iterators(chunks, microbatches),
                                    model=_model(chunks), num_microbatches=len(microbatches), seq_length=SEQ,
                                    micro_batch_size=MBS, forward_only=True)
    return out[0] if out else None


def weights(chunks) -> dict[str, torch.Tensor]:
    """This rank's parameters by chunk and local name (exact copies)."""
    return {f"{i}.{k}": v.detach().clone() for i, chunk in enumerate(chunks) for k, v in chunk.named_parameters()}
