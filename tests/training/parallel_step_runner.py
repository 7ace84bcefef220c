"""Train a tiny model for a few optimizer steps through the path users run, on any layout (rank side).

:func:`train_features` builds each feature's model with ``get_model`` (``DistributedDataParallel``), loads
the one-process run's initial weights through the sharded state dict (global, layout-independent tensors),
builds ``get_megatron_optimizer`` (fp32; distributed optimizer where the layout says so), wires
``configure_model_hooks`` (``finalize_model_grads``, ``no_sync``) and runs ``STEPS`` steps of
``get_forward_backward_func()`` + ``optimizer.step()`` (the layout's ``TrainOptions`` pick the optimizer,
clipping, weight-decay rule and batch; its path options the virtual pipeline, overlapped DDP and fused weight
gradients). It returns every local piece of every tensor of the sharded state dict (after the steps), the loss
sums and token counts of each step and each step's grad norm. :func:`assemble` (parent side) rebuilds the
global tensors from all ranks' pieces and reports pieces that several ranks hold (replicas) but that differ, and
elements no rank holds.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core._ground import unwrap_model
from megatron_core.distributed import DistributedDataParallelConfig
from megatron_core.optimizer import (
    OptimizerConfig,
    ParamGroupOverride,
    ParamKey,
    get_megatron_optimizer,
    get_standard_config_overrides,
)
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.training.model_builder import configure_model_hooks, get_model
from megatron_core.transformer.context_parallel_batch import get_batch_on_this_cp_rank
from tests.training.parallel_step_features import FEATURES, LAYOUTS, MBS, ONE_PROCESS, SEQ, VOCAB, Layout
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


def _global_batch(step: int, count: int = GLOBAL_MICROBATCHES) -> list[dict[str, torch.Tensor]]:
    """The ``count`` microbatches of ``step`` (every layout trains on the same data; a longer batch starts with
    the shorter one's microbatches)."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(count):
        mask = (torch.rand(MBS, SEQ, generator=gen) > 0.25).float()
        mask[0, 0] = 1.0
        out.append({"tokens": torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
                    "labels": torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
                    "loss_mask": mask,
                    "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ).contiguous()})
    return out


def _my_microbatches(step: int, count: int = GLOBAL_MICROBATCHES) -> list[dict[str, torch.Tensor]]:
    """This rank's share of ``count`` microbatches: a contiguous slice per DP rank, each cut for its CP rank."""
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per_rank = count // dp
    mine = _global_batch(step, count)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
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


def _parallel_fields(layout: Layout) -> dict[str, Any]:
    fields = dict(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                  context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
                  sequence_parallel=layout.sp, calculate_per_token_loss=layout.per_token,
                  virtual_pipeline_model_parallel_size=layout.vp, pipeline_model_parallel_layout=layout.pipeline_layout,
                  account_for_embedding_in_pipeline_split=layout.account_embedding,
                  account_for_loss_in_pipeline_split=layout.account_loss, expert_tensor_parallel_size=layout.etp,
                  gradient_accumulation_fusion=layout.grad_accum_fusion,
                  defer_embedding_wgrad_compute=layout.defer_embedding_wgrad, **dict(layout.config_extra))
    if layout.train.num_layers is not None:
        fields["num_layers"] = layout.train.num_layers
    return fields


def _optimizer(layout: Layout, chunks: list[torch.nn.Module]) -> Any:
    """``get_megatron_optimizer`` with the layout's ``TrainOptions`` (weight-decay rule as ``config_overrides``)."""
    train = layout.train
    config = OptimizerConfig(
        optimizer=train.optimizer, lr=LR if train.lr is None else train.lr, adam_eps=ADAM_EPS,
        weight_decay=train.weight_decay, clip_grad=train.clip_grad,
        use_distributed_optimizer=layout.distributed_optimizer,
        overlap_param_gather=layout.overlap_param_gather, use_precision_aware_optimizer=layout.precision_aware,
        apply_wd_to_qk_layernorm=train.wd_rule == "qk_layernorm")
    if train.wd_rule not in ("standard", "qk_layernorm", "overrides"):
        raise ValueError(f"wd_rule ({train.wd_rule!r}) must be 'standard', 'qk_layernorm' or 'overrides'")
    overrides = get_standard_config_overrides(config)
    if train.wd_rule == "overrides":
        overrides[ParamKey(attr="is_embedding_or_output_parameter")] = ParamGroupOverride(wd_mult=0.0)
        overrides[ParamKey(name="*.mlp.linear_fc2.weight")] = ParamGroupOverride(wd_mult=2.0)
    return get_megatron_optimizer(config, chunks, overrides)


def _train_one(feature_name: str, layout, initial: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    feature = FEATURES[feature_name]
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = feature.make_config(**_parallel_fields(layout), pipeline_dtype=torch.float32)
    chunks = get_model(partial(provider, feature), config=config, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=layout.distributed_optimizer, overlap_grad_reduce=layout.overlap_grad_reduce,
        overlap_param_gather=layout.overlap_param_gather, bucket_size=layout.bucket_size,
        align_param_gather=layout.align_sync and layout.overlap_param_gather,
        num_distributed_optimizer_instances=layout.optimizer_instances, **dict(layout.ddp_extra)))
    result: dict[str, Any] = {}
    if initial is None:
        result["initial"] = local_pieces(chunks)
    else:
        _load(chunks, initial)
    optimizer = _optimizer(layout, chunks)
    configure_model_hooks(config, chunks, optimizer, align_grad_reduce=layout.align_sync)
    owns_loss = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    losses, grad_norms = [], []
    for step in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        mine = _my_microbatches(step, layout.train.global_microbatches)
        virtual = len(chunks) > 1  # the interleaved schedule: every chunk reads its own iterator over the batch
        logs = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=[iter(mine) for _ in chunks] if virtual else iter(mine),
            model=chunks if virtual else chunks[0], num_microbatches=len(mine), seq_length=SEQ, micro_batch_size=MBS)
        success, grad_norm, _ = optimizer.step()
        if not success:
            raise AssertionError(f"{feature_name}: optimizer step {step} was skipped")
        grad_norms.append(float(grad_norm))
        if owns_loss:
            losses.append(torch.stack([log["lm loss"] for log in logs]).sum(0))
    if layout.overlap_param_gather:
        for chunk in chunks:  # the last step's gather waits for a forward that never comes: gather now
            chunk.disable_forward_pre_hook()
    result.update(final=local_pieces(chunks), losses=losses if owns_loss else None, grad_norms=grad_norms)
    return result


def train_features(feature_names: list[str], layout_name: str | Layout,
                   initial: dict[str, dict[str, torch.Tensor]] | None = None) -> dict[str, dict[str, Any]]:
    """Train every feature on this rank under ``layout_name`` (a name in ``LAYOUTS`` or ``ONE_PROCESS``, or a
    :class:`Layout`); per feature, its pieces after the steps (``final``), its step losses and grad norms, and
    without ``initial`` (the one-process run) its freshly initialised pieces (``initial``)."""
    if isinstance(layout_name, Layout):
        layout = layout_name
    else:
        layout = LAYOUTS.get(layout_name) or ONE_PROCESS[layout_name.removeprefix("one_process_")]
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vp, context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
        num_distributed_optimizer_instances=layout.optimizer_instances)
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
