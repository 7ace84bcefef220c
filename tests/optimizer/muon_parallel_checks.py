"""Muon on several CPU ranks and its single-process references (module level, so the rank pool can import them).

``train_tensor_parallel`` loads the TP=1 weights into a TP=2 llama-like GPT (GQA, SwiGLU, RMSNorm), trains it with
Muon in one ``muon_tp_mode`` and returns the reassembled full weights. ``train_single`` is the TP=1 run; with
``per_block=True`` its Muon orthogonalises each TP block of a sharded weight separately (what "blockwise" does on
each rank). ``train_layer_wise`` runs Muon inside the layer-wise distributed optimizer on DP ranks, with a sharded
checkpoint saved, reloaded into a fresh model and trained on.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.optimizer import LayerWiseDistributedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron_core.optimizer.emerging_optimizers import TensorParallelMuon
from megatron_core.training import load_checkpoint, save_checkpoint
from tests.models.gpt_test_utils import COLUMN, ROW, _glu_split, batch, build, llama_like, shard, unshard
from tests.optimizer.dp_step import dp_train_step

TP, STEPS, LR = 2, 3, 2e-2


def config(**kw: Any) -> OptimizerConfig:
    """Muon for the matrices (fp32 Newton-Schulz, so ranks and references agree to rounding), Adam for the rest."""
    return OptimizerConfig(optimizer="muon", lr=LR, weight_decay=0.1, clip_grad=1.0, adam_eps=1e-6,
                           muon_fp32_matmul_prec="highest", muon_nesterov=True, **kw)


def _spec() -> dict:
    spec = llama_like()
    spec["model"] = {**spec["model"], "share_embeddings_and_output_weights": False}
    return spec


def initial_weights(seed: int = 1234) -> dict[str, torch.Tensor]:
    """The TP=1 model's initial weights."""
    torch.manual_seed(seed)
    return {n: p.detach().clone() for n, p in build(_spec()).named_parameters()}


def _train(model: torch.nn.Module, opt: Any) -> None:
    for step in range(STEPS):
        ids, pos, labels = batch(seed=step)
        opt.zero_grad()
        model(ids, pos, None, labels=labels).mean().backward()
        assert opt.step()[0]


class _PerBlockMuon(TensorParallelMuon):
    """TP=1 reference of "blockwise": each weight orthogonalised as the TP=2 blocks its shards would be."""

    names: dict[int, str] = {}

    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        name = self.names[id(p)]
        plain = types.SimpleNamespace(is_qkv=getattr(p, "is_qkv", False),
                                      qkv_split_shapes=getattr(p, "qkv_split_shapes", None))
        gated = name.endswith("linear_fc1.weight")
        if gated:
            blocks = _glu_split(grad, TP)
        elif name.endswith(COLUMN) or name.endswith(ROW):
            blocks = list(grad.chunk(TP, dim=0 if name.endswith(COLUMN) else 1))
        else:
            return super().orthogonalize(plain, grad)
        return unshard(name, [TensorParallelMuon.orthogonalize(self, plain, block.contiguous()) for block in blocks], gated)


def train_single(weights: dict[str, torch.Tensor], per_block: bool = False, **kw: Any) -> dict[str, torch.Tensor]:
    """The TP=1 run from ``weights``; ``per_block``: the blockwise reference."""
    torch.manual_seed(0)
    model = build(_spec())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    opt = get_megatron_optimizer(config(**kw), [model])
    if per_block:
        muon = opt.chained_optimizers[0].optimizer
        muon.__class__ = _PerBlockMuon
        _PerBlockMuon.names = {id(p): n for n, p in model.named_parameters()}
    _train(model, opt)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_tensor_parallel(weights: dict[str, torch.Tensor], tp_mode: str) -> dict[str, torch.Tensor]:
    """TP=2 run in ``tp_mode``; the full weights reassembled from the shards."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    rank, group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
    model = build(_spec(), tensor_model_parallel_size=TP)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard(name, weights[name], TP, rank, gated=True))
    opt = get_megatron_optimizer(config(muon_tp_mode=tp_mode), [model])
    muon = opt.chained_optimizers[0].optimizer
    assert isinstance(muon, TensorParallelMuon) and muon.tp_mode == tp_mode
    _train(model, opt)
    full = {}
    for name, param in model.named_parameters():
        pieces = [torch.empty_like(param) for _ in range(TP)]
        dist.all_gather(pieces, param.detach().contiguous(), group=group)
        full[name] = unshard(name, pieces, gated=True)
    return full


def _layer_wise(weights: dict[str, torch.Tensor]):
    model = build(_spec())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    opt = get_megatron_optimizer(config(use_layer_wise_distributed_optimizer=True), [ddp])
    assert isinstance(opt, LayerWiseDistributedOptimizer)
    assert any(isinstance(o.optimizer, TensorParallelMuon) for o in opt.chained_optimizers)
    return model, ddp, opt


def _tokens(step: int) -> torch.Tensor:
    ids, _, labels = batch(seed=step)
    return torch.cat([ids, labels[:, -1:]], dim=1)


def layer_wise_batches() -> list[torch.Tensor]:
    """``[B, S + 1]`` token batches (inputs and shifted labels) for the DP runs and their reference."""
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 64, (4, 9), generator=gen) for _ in range(STEPS)]


def train_single_on_tokens(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One process, plain Muon + Adam, the whole of each :func:`layer_wise_batches` batch."""
    torch.manual_seed(0)
    model = build(_spec())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    opt = get_megatron_optimizer(config(), [model])
    for tokens in layer_wise_batches():
        opt.zero_grad()
        seq = tokens.shape[1] - 1
        positions = torch.arange(seq).expand(tokens.shape[0], seq)
        model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean().backward()
        assert opt.step()[0]
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_layer_wise(weights: dict[str, torch.Tensor], path: str) -> dict[str, Any]:
    """Muon inside the layer-wise optimizer on DP ranks; then a checkpoint saved after step 2 is resumed."""
    parallel_state.initialize_model_parallel()
    model, ddp, opt = _layer_wise(weights)
    batches = layer_wise_batches()
    for tokens in batches[:-1]:
        dp_train_step(ddp, opt, tokens)
    save_checkpoint(path, STEPS - 1, [ddp], opt, None)
    dp_train_step(ddp, opt, batches[-1])
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    owned = sum(1 for o in opt.chained_optimizers for p in o.get_parameters())
    fresh_model, fresh_ddp, fresh = _layer_wise({n: torch.zeros_like(w) for n, w in weights.items()})
    load_checkpoint(path, [fresh_ddp], fresh, None, load_rng=False)
    dp_train_step(fresh_ddp, fresh, batches[-1])
    resumed = {n: p.detach().clone() for n, p in fresh_model.named_parameters()}
    return {"trained": trained, "resumed": resumed, "owned": owned}
