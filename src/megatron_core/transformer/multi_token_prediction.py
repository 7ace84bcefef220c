"""Multi-token prediction (DeepSeek-V3's MTP; Megatron-Core's ``megatron.core.transformer.multi_token_prediction``).

After the decoder, depth ``k`` (1..``mtp_num_layers``) predicts token ``i + k + 1`` at position ``i``: it normalises
the previous depth's hidden state (``hnorm``) and the embedding of token ``i + k`` (``enorm``; the ids rolled left
``k`` times), concatenates them ``[embedding; hidden]``, projects ``2h -> h`` (``eh_proj``), runs one transformer
layer and a final norm. Every depth shares the model's embedding and output layer. The GPT model concatenates the
depths' hidden states after the decoder's along the sequence axis; :func:`process_mtp_loss` splits them again,
computes each depth's cross entropy against the labels rolled once more per depth (masked, averaged over the valid
positions), and attaches ``mtp_loss_scaling_factor / mtp_num_layers`` times it to the main hidden states through
:class:`MTPLossAutoScaler`, so the reported loss is the main loss and the gradients include MTP's.

Rolling respects context parallelism (each rank holds two mirrored chunks of the sequence; boundary tokens are
exchanged with the neighbouring ranks) and packed sequences (no token crosses a sequence boundary). The MTP layers
live on the last pipeline stage.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core._misc_utils import make_viewless_tensor
from megatron_core.dist_checkpointing.sharded_module import make_tp_sharded_tensor_for_checkpoint
from megatron_core.dist_checkpointing.utils import apply_prefix_mapping, replace_prefix_for_sharding
from megatron_core.process_groups_config import resolve_pg_collection
from megatron_core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron_core.transformer.backends import LocalSpecProvider, te_spec_provider
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = [
    "MTPLossAutoScaler",
    "MTPLossLoggingHelper",
    "MultiTokenPredictionBlock",
    "MultiTokenPredictionBlockSubmodules",
    "MultiTokenPredictionLayer",
    "MultiTokenPredictionLayerSubmodules",
    "get_mtp_layer_offset",
    "get_mtp_layer_spec",
    "get_mtp_layer_spec_for_backend",
    "get_mtp_num_layers_to_build",
    "get_mtp_ranks",
    "mtp_on_this_rank",
    "process_mtp_loss",
    "roll_tensor",
    "tie_output_layer_state_dict",
    "tie_word_embeddings_state_dict",
]


# --- checkpoint ties ---------------------------------------------------------------------------------------------
def _retie(sharded_state_dict: dict, weight: torch.Tensor, key: str, tp_group: Any, dp_cp_group: Any) -> None:
    if key not in sharded_state_dict:
        raise KeyError(f"{key} is not in the sharded state dict")
    # Replica 1 on the pipeline axis: the copy on the MTP stage, saved by the stage that owns the original.
    sharded_state_dict[key] = make_tp_sharded_tensor_for_checkpoint(
        weight, key, replica_id=(1, 0, get_pg_rank(dp_cp_group)), tp_group=tp_group, allow_shape_mismatch=True)


def tie_word_embeddings_state_dict(sharded_state_dict: dict, word_emb_weight: torch.Tensor, word_emb_weight_key: str,
                                   tp_group: Any = None, dp_cp_group: Any = None) -> None:
    """Mark the MTP stage's copy of the word embedding as a replica of the first stage's (in place)."""
    _retie(sharded_state_dict, word_emb_weight, word_emb_weight_key, tp_group, dp_cp_group)


def tie_output_layer_state_dict(sharded_state_dict: dict, output_layer_weight: torch.Tensor,
                                output_layer_weight_key: str, tp_group: Any = None, dp_cp_group: Any = None) -> None:
    """Mark the MTP stage's copy of the output layer as a replica of the last stage's (in place)."""
    _retie(sharded_state_dict, output_layer_weight, output_layer_weight_key, tp_group, dp_cp_group)


# --- rolling -----------------------------------------------------------------------------------------------------
def _shift_left_within(segment: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """``segment`` (last axis = this rank's part of one sequence) shifted left by one token, zero-filled at the
    sequence's end. Under context parallelism the rank holds chunks ``r`` and ``2 * cp - 1 - r``: each chunk's
    first token goes to the neighbouring chunk's last slot."""
    cp_size = get_pg_size(cp_group)
    if cp_size == 1:
        out = torch.roll(segment, -1, dims=-1)
        out[..., -1] = 0
        return out
    front, back = (torch.roll(chunk, -1, dims=-1) for chunk in segment.chunk(2, dim=-1))
    rank, ranks = get_pg_rank(cp_group), dist.get_process_group_ranks(cp_group)
    # front chunk r's last slot <- chunk r + 1's first token (the next rank's front; for the last rank, its
    # own back chunk); back chunk's last slot <- chunk (2cp - 1 - r) + 1 = the previous rank's back chunk.
    recv_front = torch.empty_like(front[..., -1])
    recv_back = torch.empty_like(back[..., -1])
    ops = []
    if rank != 0:
        ops += [dist.P2POp(dist.isend, front[..., -1].contiguous(), ranks[rank - 1]),
                dist.P2POp(dist.irecv, recv_back, ranks[rank - 1])]
    else:
        recv_back.zero_()
    if rank != cp_size - 1:
        ops += [dist.P2POp(dist.irecv, recv_front, ranks[rank + 1]),
                dist.P2POp(dist.isend, back[..., -1].contiguous(), ranks[rank + 1])]
    else:
        recv_front.copy_(back[..., -1])
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    front[..., -1] = recv_front
    back[..., -1] = recv_back
    return torch.cat([front, back], dim=-1)


def roll_tensor(tensor: torch.Tensor | None, shifts: int = -1, dims: int = -1, cp_group: Any = None,
                packed_seq_params: Any = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(tensor shifted left by one token along the sequence axis, its sum)``, zero-filled at each sequence's end.

    ``tensor`` is ``[..., s]`` (ids, labels or a mask; the sequence is the last axis). With ``cp_group`` of size
    > 1 the tokens of this rank's two chunks are exchanged with the neighbouring ranks; with
    ``packed_seq_params`` (``cu_seqlens_q`` over the packed tokens, before the context-parallel split) each
    sequence is shifted on its own. Only ``shifts=-1`` along the last axis is supported, as in Megatron-Core.
    """
    if tensor is None:
        return None, None
    if shifts != -1 or dims not in (-1, tensor.dim() - 1):
        raise ValueError(f"roll_tensor shifts one token left along the last axis (shifts=-1, dims=-1); "
                         f"got shifts={shifts}, dims={dims}")
    if packed_seq_params is None:
        rolled = _shift_left_within(tensor, cp_group)
        return rolled, rolled.sum()
    cu_seqlens = packed_seq_params.cu_seqlens_q
    if cu_seqlens is None:
        raise ValueError("roll_tensor with packed sequences needs packed_seq_params.cu_seqlens_q")
    cp_size = get_pg_size(cp_group)
    rolled = tensor.clone()
    bounds = [int(b) // cp_size for b in cu_seqlens.tolist()]
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            rolled[..., start:end] = _shift_left_within(tensor[..., start:end], cp_group)
    return rolled, rolled.sum()


# --- placement ---------------------------------------------------------------------------------------------------
def _layout_counts(layout: Any) -> list[list[int]]:
    """``[pp_rank][vp_stage] -> MTP layers`` of a ``PipelineParallelLayerLayout`` (chunk ``v * pp + p``)."""
    pp = layout.pipeline_model_parallel_size
    vpp = len(layout.stages) // pp
    return [[layout.stages[v * pp + p].count("m") for v in range(vpp)] for p in range(pp)]


def _chunk_index(layout: Any, vp_stage: int | None) -> int:
    return (vp_stage or 0) * layout.pipeline_model_parallel_size + parallel_state.get_pipeline_model_parallel_rank()


def mtp_on_this_rank(layout: Any = None, mtp_num_layers: int | None = None, ignore_virtual: bool | None = True,
                     vp_stage: int | None = None) -> bool:
    """Whether this pipeline rank (and ``vp_stage`` when ``ignore_virtual`` is False) holds MTP layers: those of
    ``layout`` when given, else the last stage when ``mtp_num_layers`` is set."""
    if layout is None:
        return bool(mtp_num_layers) and parallel_state.is_pipeline_last_stage(ignore_virtual=ignore_virtual,
                                                                               vp_stage=vp_stage)
    counts = _layout_counts(layout)[parallel_state.get_pipeline_model_parallel_rank()]
    if not ignore_virtual and parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
        if vp_stage is None:
            raise ValueError("mtp_on_this_rank needs vp_stage under virtual pipeline parallelism")
        return counts[vp_stage] > 0
    return any(count > 0 for count in counts)


def get_mtp_ranks(pp_ranks: list[int], config: TransformerConfig) -> list[int]:
    """The global ranks among ``pp_ranks`` (one pipeline group) whose stage holds MTP layers."""
    if not config.mtp_num_layers:  # None or 0: no MTP
        return []
    layout = config.pipeline_model_parallel_layout
    if layout is None:
        return [pp_ranks[-1]]
    return [pp_ranks[r] for r, counts in enumerate(_layout_counts(layout)) if any(counts)]


def get_mtp_layer_offset(config: TransformerConfig, vp_stage: int | None = None) -> int:
    """How many MTP layers earlier model chunks hold (0 unless a pipeline layout spreads them)."""
    layout = config.pipeline_model_parallel_layout
    if config.pipeline_model_parallel_size > 1 and layout is not None:
        return sum(stage.count("m") for stage in layout.stages[:_chunk_index(layout, vp_stage)])
    return 0


def get_mtp_num_layers_to_build(config: TransformerConfig, vp_stage: int | None = None,
                                pp_rank: int | None = None) -> int:
    """The number of MTP layers this (pipeline, virtual) stage builds: all of them on the stage that has them."""
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        chunk = (vp_stage or 0) * layout.pipeline_model_parallel_size + (
            parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank)
        count = layout.stages[chunk].count("m")
        if count not in (0, config.mtp_num_layers or 0):
            raise ValueError(f"all {config.mtp_num_layers} MTP layers must be on one pipeline stage; the layout puts "
                             f"{count} on this one")
        return count
    if pp_rank is not None:
        last = pp_rank == config.pipeline_model_parallel_size - 1
        vpp = config.virtual_pipeline_model_parallel_size
        last = last and (vpp is None or vp_stage is None or vp_stage == vpp - 1)
    else:
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return (config.mtp_num_layers or 0) if last else 0


# --- loss --------------------------------------------------------------------------------------------------------
class MTPLossAutoScaler(torch.autograd.Function):
    """Identity on ``output`` whose backward also sends ``main_loss_backward_scale`` into ``mtp_loss``."""

    main_loss_backward_scale: torch.Tensor = torch.tensor(1.0)

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, mtp_loss: torch.Tensor) -> torch.Tensor:
        """Return ``output`` unchanged and keep ``mtp_loss`` for the backward."""
        ctx.save_for_backward(mtp_loss)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``grad_output`` for the output, the main loss's backward scale for every element of the MTP loss."""
        (mtp_loss,) = ctx.saved_tensors
        scale = MTPLossAutoScaler.main_loss_backward_scale
        return grad_output, torch.ones_like(mtp_loss) * scale.to(mtp_loss.device)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """The scale the main loss is backpropagated with (the schedules set ``loss_scale / num_microbatches``)."""
        MTPLossAutoScaler.main_loss_backward_scale = torch.as_tensor(scale)


class MTPLossLoggingHelper:
    """Per-depth MTP losses and next-token acceptance counts, accumulated over micro-batches for the logs."""

    tracker: dict[str, Any] = {}

    @staticmethod
    def save_metrics_to_tracker(loss: torch.Tensor, correct: torch.Tensor, total: torch.Tensor, layer_number: int,
                                num_layers: int, reduce_group: Any = None, avg_group: Any = None) -> None:
        """Add one micro-batch's loss and counts of depth ``layer_number`` (0-based)."""
        if layer_number is None:
            return
        tracker = MTPLossLoggingHelper.tracker
        for name in ("loss_values", "correct_values", "total_values"):
            if name not in tracker or tracker[name].shape != (num_layers,):  # first use, or another depth count
                tracker[name] = torch.zeros(num_layers, device=loss.device)
        tracker["loss_values"][layer_number] += loss.detach().float()
        tracker["correct_values"][layer_number] += correct.detach().float()
        tracker["total_values"][layer_number] += total.detach().float()
        tracker["reduce_group"], tracker["avg_group"] = reduce_group, avg_group

    @staticmethod
    def clean_metrics_in_tracker() -> None:
        """Zero the accumulated metrics."""
        tracker = MTPLossLoggingHelper.tracker
        for name in ("loss_values", "correct_values", "total_values"):
            if name in tracker:
                tracker[name].zero_()
        tracker["reduce_group"] = tracker["avg_group"] = None

    @staticmethod
    def reduce_metrics_in_tracker() -> None:
        """Sum over ``reduce_group``; average the losses and sum the counts over ``avg_group``."""
        tracker = MTPLossLoggingHelper.tracker
        if "loss_values" not in tracker:
            return
        for name, avg_op in (("loss_values", dist.ReduceOp.AVG), ("correct_values", dist.ReduceOp.SUM),
                             ("total_values", dist.ReduceOp.SUM)):
            values = tracker[name]
            if tracker.get("reduce_group") is not None:
                dist.all_reduce(values, group=tracker["reduce_group"])
            if tracker.get("avg_group") is not None:
                if avg_op == dist.ReduceOp.AVG and dist.get_backend(tracker["avg_group"]) == "gloo":
                    dist.all_reduce(values, group=tracker["avg_group"])  # gloo has no AVG
                    values /= get_pg_size(tracker["avg_group"])
                else:
                    dist.all_reduce(values, group=tracker["avg_group"], op=avg_op)

    @staticmethod
    def track_mtp_metrics(loss_scale: float, iteration: int, writer: Any, wandb_writer: Any = None,
                          total_loss_dict: dict | None = None) -> None:
        """Reduce, then log ``mtp_<k> loss`` and the acceptance rates (this step's and cumulative), and clean."""
        MTPLossLoggingHelper.reduce_metrics_in_tracker()
        tracker = MTPLossLoggingHelper.tracker
        if "loss_values" not in tracker:
            return
        losses = tracker["loss_values"] * loss_scale
        correct, total = tracker["correct_values"], tracker["total_values"]
        if tracker.get("cumulative_correct_values") is None or tracker["cumulative_correct_values"].shape != correct.shape:
            tracker["cumulative_correct_values"] = torch.zeros_like(correct)
            tracker["cumulative_total_values"] = torch.zeros_like(total)
        tracker["cumulative_correct_values"] += correct
        tracker["cumulative_total_values"] += total
        for depth in range(losses.shape[0]):
            name = f"mtp_{depth + 1}"
            rate = correct[depth] / total[depth].clamp(min=1) * 100.0
            cumulative = (tracker["cumulative_correct_values"][depth]
                          / tracker["cumulative_total_values"][depth].clamp(min=1) * 100.0)
            if total_loss_dict is not None:
                total_loss_dict[f"{name} loss"] = total_loss_dict.get(f"{name} loss", 0) + losses[depth]
            values = {f"{name} loss": losses[depth], f"{name}_acceptance_rate": rate,
                      f"{name}_cumulative_acceptance_rate": cumulative}
            if writer is not None:
                for key, value in values.items():
                    writer.add_scalar(key, value, iteration)
            if wandb_writer is not None:
                wandb_writer.log(values, iteration)
        MTPLossLoggingHelper.clean_metrics_in_tracker()


def _acceptance_counts(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, vocab_sharded: bool,
                       tp_group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """How many valid positions' argmax equals the label, and how many valid positions (``logits [s, b, V']``)."""
    with torch.no_grad():
        if vocab_sharded and get_pg_size(tp_group) > 1:
            local_max, local_arg = logits.max(dim=-1)
            maxima = [torch.empty_like(local_max) for _ in range(get_pg_size(tp_group))]
            args = [torch.empty_like(local_arg) for _ in range(get_pg_size(tp_group))]
            dist.all_gather(maxima, local_max, group=tp_group)
            dist.all_gather(args, local_arg, group=tp_group)
            winner = torch.stack(maxima).argmax(dim=0)
            preds = winner * logits.shape[-1] + torch.stack(args).gather(0, winner.unsqueeze(0)).squeeze(0)
        else:
            preds = logits.argmax(dim=-1)
        valid = loss_mask.transpose(0, 1).bool()
        correct = ((preds == labels.transpose(0, 1)) & valid).sum().float()
        return correct, valid.sum().float()


def process_mtp_loss(hidden_states: torch.Tensor, labels: torch.Tensor | None, loss_mask: torch.Tensor | None,
                     output_layer: Any, output_weight: torch.Tensor | None, runtime_gather_output: bool | None,
                     is_training: bool, compute_language_model_loss: Any, config: TransformerConfig,
                     cp_group: Any = None, tp_group: Any = None, packed_seq_params: Any = None,
                     scale_logits_fn: Any = None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Split ``hidden_states`` (the decoder's, then each MTP depth's, along the sequence) and return the decoder's
    part with every depth's loss attached for the backward (see the module docstring).

    ``labels [b, s]`` (else derived from ``input_ids`` rolled left); ``loss_mask [b, s]`` (else all ones). With
    ``calculate_per_token_loss`` each depth's summed loss is rescaled by ``original tokens / depth tokens``, since
    ``finalize_model_grads`` divides by the main loss's token count.
    """
    depths = config.mtp_num_layers
    parts = torch.chunk(hidden_states, 1 + depths, dim=0)
    hidden_states = parts[0]
    from_ids = labels is None
    if from_ids:
        if input_ids is None:
            return hidden_states
        labels, _ = roll_tensor(input_ids, cp_group=cp_group, packed_seq_params=packed_seq_params)
    if config.mtp_detach_heads:
        output_weight = (output_weight if output_weight is not None else output_layer.weight).detach()
    mtp_labels = labels.clone()
    loss_mask = torch.ones_like(mtp_labels) if loss_mask is None else loss_mask
    if from_ids:  # the rolled-in last label is not a real token
        loss_mask, _ = roll_tensor(loss_mask, cp_group=cp_group, packed_seq_params=packed_seq_params)
    original_num_tokens = loss_mask.sum()
    scale = config.mtp_loss_scaling_factor / depths
    vocab_sharded = (not runtime_gather_output if runtime_gather_output is not None
                     else not getattr(output_layer, "gather_output", False))
    for depth in range(depths):
        logits, _ = output_layer(parts[depth + 1], weight=output_weight, runtime_gather_output=runtime_gather_output)
        if scale_logits_fn is not None:
            logits = scale_logits_fn(logits)
        mtp_labels, _ = roll_tensor(mtp_labels, cp_group=cp_group, packed_seq_params=packed_seq_params)
        loss_mask, num_tokens = roll_tensor(loss_mask, cp_group=cp_group, packed_seq_params=packed_seq_params)
        mtp_loss = loss_mask * compute_language_model_loss(mtp_labels, logits)
        if is_training:
            logged = mtp_loss.sum() * (num_tokens > 0).to(mtp_loss.dtype) / num_tokens.clamp(min=1)
            correct, total = _acceptance_counts(logits, mtp_labels, loss_mask, vocab_sharded, tp_group)
            MTPLossLoggingHelper.save_metrics_to_tracker(
                logged, correct, total, depth, depths,
                avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True)
                if parallel_state.model_parallel_is_initialized() else None)
        if config.calculate_per_token_loss:
            attached = scale * mtp_loss * (original_num_tokens / num_tokens.clamp(min=1))
        else:
            attached = scale * mtp_loss / num_tokens.clamp(min=1)
        hidden_states = MTPLossAutoScaler.apply(hidden_states, attached)
    return hidden_states


# --- layers ------------------------------------------------------------------------------------------------------
@dataclass
class MultiTokenPredictionLayerSubmodules:
    """The norms of the embedding (``enorm``) and hidden state (``hnorm``), the ``2h -> h`` projection, the
    transformer layer and the final norm (``layer_norm``) of one MTP depth."""

    enorm: Any = None
    hnorm: Any = None
    layer_norm: Any = None
    eh_proj: ModuleSpec | type | None = None
    mtp_model_layer: ModuleSpec | type | None = None


def get_mtp_layer_spec_for_backend(mtp_model_layer_spec: ModuleSpec, backend: Any) -> ModuleSpec:
    """An MTP layer spec with ``backend``'s norm and column-parallel linear around ``mtp_model_layer_spec``."""
    norm = backend.layer_norm()
    return ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, layer_norm=norm, eh_proj=backend.column_parallel_linear(),
        mtp_model_layer=mtp_model_layer_spec))


def get_mtp_layer_spec(mtp_model_layer_spec: ModuleSpec, use_transformer_engine: bool) -> ModuleSpec:
    """An MTP layer spec for the Transformer Engine (``use_transformer_engine``) or the local backend."""
    backend = te_spec_provider() if use_transformer_engine else LocalSpecProvider()
    return get_mtp_layer_spec_for_backend(mtp_model_layer_spec, backend)


class MultiTokenPredictionLayer(MegatronModule):
    """One MTP depth: ``final_norm(layer(eh_proj([enorm(embed(ids rolled)); hnorm(h)])))`` (module docstring)."""

    def __init__(self, config: TransformerConfig, submodules: MultiTokenPredictionLayerSubmodules,
                 layer_number: int = 1, vp_stage: int | None = None, pg_collection: Any = None,
                 mtp_layer_pattern: str | None = None, name: str | None = None, **unused: Any) -> None:
        super().__init__(config)
        if mtp_layer_pattern is not None:
            raise ValueError("mtp_layer_pattern (hybrid Mamba MTP layers) is not supported by this library")
        pg_collection = resolve_pg_collection(pg_collection)
        self.submodules = submodules
        self.sequence_parallel = config.sequence_parallel
        self.layer_number = layer_number + get_mtp_layer_offset(config, vp_stage)
        self.vp_stage = vp_stage
        self.cp_group, self.tp_group = pg_collection.cp, pg_collection.tp
        self.mtp_layer_pattern = None
        norm_kwargs = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.enorm = build_module(submodules.enorm, **norm_kwargs)
        self.hnorm = build_module(submodules.hnorm, **norm_kwargs)
        self.eh_proj = build_module(
            submodules.eh_proj, 2 * config.hidden_size, config.hidden_size, config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name="mtp_eh_proj", tp_group=self.tp_group)
        self.mtp_model_layer = build_module(submodules.mtp_model_layer, config=config, layer_number=self.layer_number,
                                            vp_stage=vp_stage, is_mtp_layer=True, pg_collection=pg_collection)
        self.final_layernorm = build_module(submodules.layer_norm, **norm_kwargs)

    def _inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor, padding_mask: torch.Tensor | None,
                embedding: Any, packed_seq_params: Any) -> tuple:
        input_ids, _ = roll_tensor(input_ids, cp_group=self.cp_group, packed_seq_params=packed_seq_params)
        position_ids, _ = roll_tensor(position_ids, cp_group=self.cp_group, packed_seq_params=packed_seq_params)
        if padding_mask is not None:
            padding_mask, _ = roll_tensor(padding_mask, cp_group=self.cp_group, packed_seq_params=packed_seq_params)
        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)
        if self.config.mtp_detach_heads:
            decoder_input = decoder_input.detach()
        return input_ids, position_ids, padding_mask, decoder_input

    def _project(self, hidden_states: torch.Tensor, decoder_input: torch.Tensor) -> torch.Tensor:
        combined = torch.cat((self.enorm(decoder_input), self.hnorm(hidden_states)), dim=-1)
        projected, _ = self.eh_proj(combined)
        projected = gather_from_tensor_model_parallel_region(projected, group=self.tp_group)
        if self.sequence_parallel:
            projected = scatter_to_sequence_parallel_region(projected, group=self.tp_group)
        return projected

    def _project_and_layer(self, hidden_states: torch.Tensor, decoder_input: torch.Tensor,
                           **layer_kwargs: Any) -> torch.Tensor:
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if self.sequence_parallel else nullcontext()
        with rng:
            hidden_states = self._project(hidden_states, decoder_input)
            hidden_states, _ = self.mtp_model_layer(hidden_states=hidden_states, **layer_kwargs)
        hidden_states = self.final_layernorm(hidden_states)
        return make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, hidden_states: torch.Tensor,
                attention_mask: torch.Tensor | None, padding_mask: torch.Tensor | None = None, context: Any = None,
                context_mask: Any = None, rotary_pos_emb: torch.Tensor | None = None,
                rotary_pos_cos: torch.Tensor | None = None, rotary_pos_sin: torch.Tensor | None = None,
                attention_bias: Any = None, inference_params: Any = None, packed_seq_params: Any = None,
                sequence_len_offset: Any = None, embedding: Any = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(this depth's hidden states [s, b, h], ids, positions and padding mask rolled once more)``."""
        if context is not None:
            raise ValueError("multi-token prediction with cross-attention (context) is not supported")
        input_ids, position_ids, padding_mask, decoder_input = self._inputs(
            input_ids, position_ids, padding_mask, embedding, packed_seq_params)
        layer_kwargs = dict(attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                            packed_seq_params=packed_seq_params)
        if rotary_pos_cos is not None or rotary_pos_sin is not None:
            layer_kwargs.update(rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin)
        if self.config.recompute_granularity == "full" and self.training:
            hidden_states = tensor_parallel.checkpoint(
                lambda h, d: self._project_and_layer(h, d, **layer_kwargs), self.config.distribute_saved_activations,
                hidden_states, decoder_input)
        else:
            hidden_states = self._project_and_layer(hidden_states, decoder_input, **layer_kwargs)
        return hidden_states, input_ids, position_ids, padding_mask

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The generic sharded state with the transformer layer saved as ``transformer_layer.`` (Megatron's key)."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        apply_prefix_mapping(sharded, {f"{prefix}mtp_model_layer.": f"{prefix}transformer_layer."})
        return sharded


@dataclass
class MultiTokenPredictionBlockSubmodules:
    """One MTP layer spec per depth."""

    layer_specs: list[ModuleSpec] | None = None


def _block_submodules(spec: Any) -> MultiTokenPredictionBlockSubmodules:
    if isinstance(spec, MultiTokenPredictionBlockSubmodules):
        return spec
    if isinstance(spec, ModuleSpec) and isinstance(spec.module, type) and issubclass(spec.module,
                                                                                        MultiTokenPredictionBlock):
        return spec.submodules
    raise ValueError(f"mtp_block_spec must be MultiTokenPredictionBlockSubmodules or a ModuleSpec of "
                     f"MultiTokenPredictionBlock, got {type(spec).__name__}")


class MultiTokenPredictionBlock(MegatronModule):
    """The ``mtp_num_layers`` MTP depths, run one after the other (one shared layer with ``mtp_use_repeated_layer``)."""

    def __init__(self, config: TransformerConfig, spec: Any, vp_stage: int | None = None, pg_collection: Any = None,
                 name: str | None = None, **unused: Any) -> None:
        super().__init__(config)
        if not config.mtp_num_layers:
            raise ValueError("MultiTokenPredictionBlock needs mtp_num_layers >= 1")
        self.submodules = _block_submodules(spec)
        if not self.submodules.layer_specs:
            raise ValueError("MultiTokenPredictionBlock needs at least one layer spec")
        self.mtp_loss_scaling_factor = config.mtp_loss_scaling_factor
        self.mtp_use_repeated_layer = config.mtp_use_repeated_layer
        self.vp_stage = vp_stage
        pg_collection = resolve_pg_collection(pg_collection)
        self.cp_group = pg_collection.cp
        specs = self.submodules.layer_specs
        if self.mtp_use_repeated_layer:
            specs = specs[:1]
        self.layers = torch.nn.ModuleList([
            build_module(layer_spec, config=config, layer_number=i + 1, vp_stage=vp_stage,
                         pg_collection=pg_collection)
            for i, layer_spec in enumerate(specs)
        ])
        if config.mtp_detach_heads:
            for param in self.parameters():
                param.grad_norm_group = "mtp"

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, hidden_states: torch.Tensor,
                attention_mask: torch.Tensor | None, padding_mask: torch.Tensor | None = None,
                extra_block_kwargs: dict | None = None, embedding: Any = None, **layer_kwargs: Any) -> torch.Tensor:
        """The decoder's hidden states followed by each depth's, concatenated along the sequence ``[(1 + D) s, b, h]``."""
        offset = get_mtp_layer_offset(self.config, self.vp_stage)
        parts = list(torch.chunk(hidden_states, 1 + offset, dim=0))
        hidden_states = parts[offset].detach() if self.config.mtp_detach_heads else parts[offset]
        for depth in range(self.config.mtp_num_layers):
            layer = self.layers[0 if self.mtp_use_repeated_layer else depth]
            hidden_states, input_ids, position_ids, padding_mask = layer(
                input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                attention_mask=attention_mask, padding_mask=padding_mask, embedding=embedding,
                **layer_kwargs, **(extra_block_kwargs or {}))
            parts.append(hidden_states)
        return torch.cat(parts, dim=0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Each depth under ``layers.<global depth - 1>.`` (global across pipeline stages)."""
        out: dict = {}
        offset = get_mtp_layer_offset(self.config, self.vp_stage)
        for layer in self.layers:
            local = f"{prefix}layers.{layer.layer_number - 1 - offset}."
            sharded = layer.sharded_state_dict(local, (), metadata)
            replace_prefix_for_sharding(sharded, local, f"{prefix}layers.{layer.layer_number - 1}.")
            out.update(sharded)
        return out
