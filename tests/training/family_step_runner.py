"""Train a tiny model of a family (BERT, T5, Mamba, LLaVA, MIMO) for a few steps through the real path (rank side).

The family counterpart of :mod:`tests.training.parallel_step_runner`, on the same machinery: ``get_model``
(``DistributedDataParallel``), the one-process run's initial weights loaded through the sharded state dict,
``get_megatron_optimizer`` (its ``_optimizer``), ``configure_model_hooks`` (``finalize_model_grads``) and
``STEPS`` steps of ``get_forward_backward_func()`` + ``optimizer.step()``. The family
(:class:`~tests.training.family_step_features.Family`) gives the model, the batch and the forward step. The result
has the shape :func:`tests.training.parallel_step_compare.differences_from_one_process` reads.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import DistributedDataParallelConfig
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.training.model_builder import configure_model_hooks, get_model
from megatron_core.transformer.context_parallel_batch import get_batch_on_this_cp_rank
from tests.training.family_step_features import FAMILIES, MBS, Family
from tests.training.parallel_step_features import Layout
from tests.training.parallel_step_runner import (
    GLOBAL_MICROBATCHES,
    SEED,
    STEPS,
    _load,
    _optimizer,
    _parallel_fields,
    local_pieces,
)


def my_microbatches(family: Family, step: int) -> list[dict[str, torch.Tensor]]:
    """This rank's share of step ``step``'s microbatches: a contiguous slice per DP rank, cut per CP rank where
    the family's batch is cut outside the model."""
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per_rank = GLOBAL_MICROBATCHES // dp
    mine = family.batch(step, GLOBAL_MICROBATCHES)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [get_batch_on_this_cp_rank(dict(mb)) if family.cp_split else mb for mb in mine]


def build(family: Family, layout: Layout, seed: int = SEED) -> tuple[Any, list[torch.nn.Module]]:
    """``family``'s config and DDP chunks under ``layout`` (model parallel state already initialised)."""
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = family.make_config(**_parallel_fields(layout), pipeline_dtype=torch.float32)

    def provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                 config: Any = config, pg_collection: Any = None) -> torch.nn.Module:
        return family.build(config, pre_process, post_process, vp_stage, pg_collection)

    chunks = get_model(provider, config=config, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=layout.distributed_optimizer))
    return config, chunks


def train_step(family: Family, chunks: list[torch.nn.Module], optimizer: Any, step: int) -> tuple[Any, float]:
    """One optimizer step on global batch ``step``: the ``"lm loss"`` logs summed over this rank's microbatches
    (loss-holding ranks; else ``None``) and the grad norm."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    mine = my_microbatches(family, step)
    logs = get_forward_backward_func()(
        forward_step_func=family.forward_step, data_iterator=iter(mine), model=chunks[0],
        num_microbatches=len(mine), seq_length=family.seq_length, micro_batch_size=MBS)
    success, grad_norm, _ = optimizer.step()
    if not success:
        raise AssertionError(f"{family.name}: optimizer step {step} was skipped")
    owns_loss = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    return (torch.stack([log["lm loss"] for log in logs]).sum(0) if owns_loss else None), float(grad_norm)


def _train_one(name: str, layout: Layout, initial: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    family = FAMILIES[name]
    config, chunks = build(family, layout)
    result: dict[str, Any] = {}
    if initial is None:
        result["initial"] = local_pieces(chunks)
    else:
        _load(chunks, initial)
    optimizer = _optimizer(layout, chunks)
    configure_model_hooks(config, chunks, optimizer)
    losses, grad_norms = [], []
    for step in range(STEPS):
        loss, grad_norm = train_step(family, chunks, optimizer, step)
        losses.append(loss)
        grad_norms.append(grad_norm)
    result.update(final=local_pieces(chunks), losses=None if losses[0] is None else losses, grad_norms=grad_norms)
    return result


def initialize(layout: Layout) -> None:
    """``parallel_state`` for ``layout``'s TP / PP / CP sizes."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp, context_parallel_size=layout.cp)


def train_families(names: list[str], layout: Layout,
                   initial: dict[str, dict[str, torch.Tensor]] | None = None) -> dict[str, dict[str, Any]]:
    """Train every family in ``names`` on this rank under ``layout``; per family its pieces after the steps
    (``final``), step losses and grad norms, and without ``initial`` (the one-process run) its freshly
    initialised pieces (``initial``)."""
    initialize(layout)
    try:
        return {name: _train_one(name, layout, None if initial is None else initial[name]) for name in names}
    finally:
        parallel_state.destroy_model_parallel()
