"""Train a tiny model for a few optimizer steps through the path users run, on any layout (rank side).

:func:`train_features` builds each feature's model with ``get_model`` (``DistributedDataParallel``), loads
the one-process run's initial weights through the sharded state dict (global, layout-independent tensors),
builds ``get_megatron_optimizer`` (Adam, fp32; distributed optimizer where the layout says so), wires
``configure_model_hooks`` (``finalize_model_grads``, ``no_sync``) and runs ``STEPS`` steps of
``get_forward_backward_func()`` + ``optimizer.step()``. It returns every local piece of every tensor of
the sharded state dict (after the steps), the loss sums and token counts of each step and each step's
grad norm. :func:`assemble` (parent side) rebuilds the global tensors from all ranks' pieces and reports
pieces that several ranks hold (replicas) but that differ, and elements no rank holds.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core._ground import unwrap_model
from megatron_core.distributed import DistributedDataParallelConfig
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.training.model_builder import configure_model_hooks, get_model
from megatron_core.transformer.context_parallel_batch import get_batch_on_this_cp_rank
from tests.training.parallel_step_features import FEATURES, LAYOUTS, MBS, ONE_PROCESS, SEQ, VOCAB
from tests.training.parallel_step_features import model_provider as provider
from tests.transformer.moe.moe_parallel_utils import shards

STEPS = 3
GLOBAL_MICROBATCHES = 4  # per step, split over the data-parallel ranks
SEED = 1234
# Adam divides each gradient element by its own magnitude, so an element whose gradient is near zero moves by up to
# ``lr`` on a rounding difference. A small ``lr`` and an ``eps`` above such gradients keep the runs' rounding
# differences near 1e-6 while a missing or doubled reduction still moves weights by about ``lr`` (100x the tolerance).
LR, ADAM_EPS = 1e-3, 1e-6

Where = tuple[Any, ...]  # a hashable global_slice: ints on prepended axes, (start, stop) elsewhere
Piece = tuple[str, tuple[int, ...], Where, torch.Tensor]  # (key, global shape, where, data)


def _where(global_slice: tuple) -> Where:
    return tuple((s.start, s.stop) if isinstance(s, slice) else s for s in global_slice)


def _index(where: Where) -> tuple:
    return tuple(slice(*w) if isinstance(w, tuple) else w for w in where)


def local_pieces(chunks: list[torch.nn.Module]) -> list[Piece]:
    """Every piece of every tensor of this rank's chunks' sharded state dicts (copies)."""
    return [(sh.key, sh.global_shape, _where(sh.global_slice()), sh.data.detach().clone())
            for chunk in chunks for sh in shards(unwrap_model(chunk))]


def _load(chunks: list[torch.nn.Module], initial: dict[str, torch.Tensor]) -> None:
    """Copy each local piece from the global ``initial`` tensors, then check that every piece holds them."""
    with torch.no_grad():
        for chunk in chunks:
            for sh in shards(unwrap_model(chunk)):
                sh.data.copy_(initial[sh.key][sh.global_slice()])
    for key, _, where, data in local_pieces(chunks):
        if not torch.equal(data, initial[key][_index(where)]):
            raise AssertionError(f"{key}{where}: loading the initial weights did not reach the parameter")


def _global_batch(step: int) -> list[dict[str, torch.Tensor]]:
    """The ``GLOBAL_MICROBATCHES`` microbatches of ``step`` (every layout trains on the same data)."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(GLOBAL_MICROBATCHES):
        mask = (torch.rand(MBS, SEQ, generator=gen) > 0.25).float()
        mask[0, 0] = 1.0
        out.append({"tokens": torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
                    "labels": torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
                    "loss_mask": mask,
                    "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ).contiguous()})
    return out


def _my_microbatches(step: int) -> list[dict[str, torch.Tensor]]:
    """This rank's share: a contiguous slice of the global batch per DP rank, each cut for its CP rank."""
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per_rank = GLOBAL_MICROBATCHES // dp
    mine = _global_batch(step)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [get_batch_on_this_cp_rank(dict(mb)) for mb in mine]


def _forward_step(data_iterator, model):
    """Megatron-LM's GPT forward step: ``(loss sum, token count, {"lm loss": [sum, count]})``."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   loss_mask=batch["loss_mask"])

    def loss_func(per_token_loss: torch.Tensor):
        mask = batch["loss_mask"].float()
        loss = torch.sum(per_token_loss.float() * mask)
        count = mask.sum()
        return loss, count.to(torch.int), {"lm loss": torch.stack([loss.detach().clone(), count])}

    return output, loss_func


def _parallel_fields(layout) -> dict[str, Any]:
    return dict(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
                sequence_parallel=layout.sp, calculate_per_token_loss=layout.per_token)


def _train_one(feature_name: str, layout, initial: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    feature = FEATURES[feature_name]
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = feature.make_config(**_parallel_fields(layout), pipeline_dtype=torch.float32)
    chunks = get_model(partial(provider, feature), config=config,
                       ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=layout.distributed_optimizer))
    result: dict[str, Any] = {}
    if initial is None:
        result["initial"] = local_pieces(chunks)
    else:
        _load(chunks, initial)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        lr=LR, adam_eps=ADAM_EPS, weight_decay=0.01, clip_grad=0.5,
        use_distributed_optimizer=layout.distributed_optimizer), chunks)
    configure_model_hooks(config, chunks, optimizer)
    owns_loss = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    losses, grad_norms = [], []
    for step in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        mine = _my_microbatches(step)
        logs = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter(mine), model=chunks[0],
            num_microbatches=len(mine), seq_length=SEQ, micro_batch_size=MBS)
        success, grad_norm, _ = optimizer.step()
        if not success:
            raise AssertionError(f"{feature_name}: optimizer step {step} was skipped")
        grad_norms.append(float(grad_norm))
        if owns_loss:
            losses.append(torch.stack([log["lm loss"] for log in logs]).sum(0))
    result.update(final=local_pieces(chunks), losses=losses if owns_loss else None, grad_norms=grad_norms)
    return result


def train_features(feature_names: list[str], layout_name: str,
                   initial: dict[str, dict[str, torch.Tensor]] | None = None) -> dict[str, dict[str, Any]]:
    """Train every feature on this rank under ``layout_name`` (``LAYOUTS`` or ``ONE_PROCESS``); per feature,
    its pieces after the steps (``final``), its step losses and grad norms, and without ``initial`` (the
    one-process run) its freshly initialised pieces (``initial``)."""
    layout = LAYOUTS.get(layout_name) or ONE_PROCESS[layout_name.removeprefix("one_process_")]
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep)
    try:
        return {name: _train_one(name, layout, None if initial is None else initial[name]) for name in feature_names}
    finally:
        parallel_state.destroy_model_parallel()


def assemble(per_rank: list[list[Piece]]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The global tensors of all ranks' pieces, and the problems found: replicas (the same piece on several
    ranks) that differ, and elements of a global tensor that no rank holds."""
    out: dict[str, torch.Tensor] = {}
    first: dict[tuple[str, Where], tuple[int, torch.Tensor]] = {}
    problems = []
    for rank, pieces in enumerate(per_rank):
        for key, shape, where, data in pieces:
            if (key, where) in first:
                other, reference = first[(key, where)]
                if not torch.equal(reference, data):
                    diff = (reference - data).abs().max().item()
                    problems.append(f"{key}{list(where)}: replicas on ranks {other} and {rank} differ (max {diff:.3g})")
                continue
            first[(key, where)] = (rank, data)
            fill = float("nan") if data.is_floating_point() else 0
            full = out.setdefault(key, torch.full(shape, fill, dtype=data.dtype))
            full[_index(where)] = data
    for key, full in out.items():
        if full.is_floating_point() and torch.isnan(full).any():
            problems.append(f"{key}: {int(torch.isnan(full).sum())} elements held by no rank")
    return out, problems
