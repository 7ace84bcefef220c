"""Base class of language models: loss and tied input/output embeddings (Megatron-Core's ``LanguageModule``).

Tied embeddings with pipeline parallelism: the first stage owns ``embedding.word_embeddings.weight``;
the last stage holds a duplicate as ``output_layer.weight``, marked ``shared=True`` and
``shared_embedding=True``, zero-filled and then all-reduced over the embedding group at
construction so that both copies start equal. Their gradients are summed over the same group by
``finalize_model_grads`` every step. This file holds the models package's only collective.

In a checkpoint the last stage's copy is a replica of the first stage's tensor (see
:meth:`LanguageModule.tie_embeddings_and_output_weights_state_dict`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from megatron_core._ground import get_pg_size
from megatron_core.device import get_current_device
from megatron_core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron_core.process_groups_config import check_parallel_size, resolve_pg_collection
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.multi_token_prediction import tie_word_embeddings_state_dict
from megatron_core.transformer.rotary_pos_embedding import RotaryEmbedding
from megatron_core.transformer.transformer_config import TransformerConfig
from megatron_core.transformer.utils import ensure_metadata_has_dp_cp_group

__all__ = ["LanguageModule", "check_position_embedding_type", "output_layer_init_method"]


def check_position_embedding_type(position_embedding_type: str, allowed: tuple[str, ...], who: str = "") -> None:
    """Raise ``ValueError`` naming the value and the choices unless ``position_embedding_type`` is in ``allowed``;
    ``who`` prefixes the message (the model's name)."""
    if position_embedding_type not in allowed:
        raise ValueError(f"{who}position_embedding_type ({position_embedding_type!r}) must be one of {list(allowed)}")


def output_layer_init_method(config: TransformerConfig, share_embeddings_and_output_weights: bool) -> Any:
    """The output layer's init: under muP an untied output layer starts like the embedding
    (``embedding_init_method``, a width-independent std); otherwise ``config.init_method``."""
    if getattr(config, "use_mup", False) and not share_embeddings_and_output_weights:
        return config.embedding_init_method
    return config.init_method


def _check_context_parallel_config(config: TransformerConfig, cp_group: Any) -> None:
    """A language model splits its sequences over the context-parallel group, and its attention layers run context
    parallelism only where ``config.context_parallel_size > 1`` (as in Megatron-Core, so that an encoder beside it,
    with ``context_parallel_size=1``, sees whole sequences): the config must therefore state the group's size, else
    ``ValueError`` (the positions would be split and the attention not)."""
    ranks = get_pg_size(cp_group)
    if ranks > 1 and config.context_parallel_size != ranks:
        raise ValueError(
            f"config.context_parallel_size is {config.context_parallel_size} but the context-parallel process group "
            f"has {ranks} ranks: a language model splits its sequences over that group, and attention runs context "
            f"parallelism only where context_parallel_size > 1; set context_parallel_size={ranks}"
        )


class LanguageModule(MegatronModule):
    """A model with a vocab-parallel cross-entropy loss and optionally tied embedding/output weights."""

    def __init__(self, config: TransformerConfig, pg_collection: object = None) -> None:
        super().__init__(config)
        # Explicit groups, else parallel_state's (the one resolver in process_groups_config).
        self._explicit_groups = pg_collection is not None
        self.pg_collection = resolve_pg_collection(pg_collection)
        self.tp_group = self.pg_collection.tp
        _check_context_parallel_config(config, getattr(self.pg_collection, "cp", None))
        self.pre_process = True
        self.post_process = True
        self.share_embeddings_and_output_weights = False
        self.fp16_lm_cross_entropy = False

    def _check_vocab_split(self, vocab_size: int) -> None:
        """The vocabulary is split over the TP group (its size checked against the config): it must divide evenly."""
        tp_size = check_parallel_size(self.config, "tensor_model_parallel_size", self.tp_group, "tensor-parallel")
        if vocab_size % tp_size != 0:
            raise ValueError(
                f"{type(self).__name__} vocab_size ({vocab_size}) must be divisible by the tensor-parallel group size "
                f"({tp_size}); pad it with megatron_core.tensor_parallel.pad_vocab_size"
                f"({vocab_size}, make_vocab_size_divisible_by, {tp_size})"
            )

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy ``[b, s]`` from ``labels`` ``[b, s]`` and vocab-parallel ``logits`` ``[s, b, V/TP]``."""
        labels = labels.transpose(0, 1).contiguous()
        if self.config.cross_entropy_loss_fusion and not torch.compiler.is_compiling():
            # 'native' (also for 'te': no Transformer Engine kernel here). Computed in fp32 from the logits as they are, without an fp32 copy (fusions.fused_cross_entropy).
            loss = fused_vocab_parallel_cross_entropy(logits, labels, self.tp_group)
            return loss.transpose(0, 1).contiguous()
        # The model's flag, else the config's (a module used without the model's constructor, as Megatron allows).
        if not getattr(self, "fp16_lm_cross_entropy", getattr(self.config, "fp16_lm_cross_entropy", False)):
            logits = logits.float()
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels, tp_group=self.tp_group)
        return loss.transpose(0, 1).contiguous()

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """The sharded state without the output layer's (always empty) ``_extra_state``, as Megatron-Core saves it.

        A tied output layer on a stage without the embedding is stored as a replica of the embedding.
        """
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        sharded.pop(f"{prefix}output_layer._extra_state", None)
        word_emb_key = f"{prefix}embedding.word_embeddings.weight"
        if getattr(self, "mtp_process", False) and not self.pre_process:
            # The MTP stage's copy of the first stage's embedding: saved by the first stage only.
            tie_word_embeddings_state_dict(sharded, self.embedding.word_embeddings.weight, word_emb_key,
                                           tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        self.tie_embeddings_and_output_weights_state_dict(sharded, f"{prefix}output_layer.weight", word_emb_key)
        return sharded

    def tie_embeddings_and_output_weights_state_dict(
        self, sharded_state_dict: dict, output_layer_weight_key: str, first_stage_word_emb_key: str,
        metadata: dict | None = None,
    ) -> None:
        """Store a last stage's tied output weight under the first stage's embedding key, as a replica.

        As Megatron-Core: the entry ``output_layer_weight_key`` keeps its dict key but gets the
        checkpoint key ``first_stage_word_emb_key`` and pipeline replica id 1, so only the first stage
        writes the tensor and a checkpoint loads under any pipeline size. Nothing changes when the
        weights are untied or this stage also holds the embedding.
        """
        if not self.share_embeddings_and_output_weights or self.pre_process:
            return
        sharded = sharded_state_dict.get(output_layer_weight_key)
        if sharded is None:
            return
        _, tp_replica, dp_rank = sharded.replica_id
        sharded_state_dict[output_layer_weight_key] = replace(
            sharded, key=first_stage_word_emb_key, replica_id=(1, tp_replica, dp_rank)
        )

    def build_rotary_embedding(self, rotary_percent: float, seq_len_interpolation_factor: float | None,
                               rotary_base: int = 10000, rotary_interleaved: bool | None = None,
                               **scaling: Any) -> RotaryEmbedding:
        """The model's ``RotaryEmbedding`` (``position_embedding_type='rope'``), on this model's CP group.

        ``rotary_interleaved`` defaults to the config's; ``scaling``: ``rope_scaling`` / ``rope_scaling_factor``.
        """
        return RotaryEmbedding(
            kv_channels=self.config.kv_channels, rotary_percent=rotary_percent,
            rotary_interleaved=self.config.rotary_interleaved if rotary_interleaved is None else rotary_interleaved,
            seq_len_interpolation_factor=seq_len_interpolation_factor, rotary_base=rotary_base,
            use_cpu_initialization=self.config.use_cpu_initialization, cp_group=self.pg_collection.cp, **scaling,
        )

    def build_output_layer(self, vocab_size: int, parallel_output: bool, bias: bool = False,
                           skip_weight_param_allocation: bool = False) -> tensor_parallel.ColumnParallelLinear:
        """The vocab-parallel output layer every language model builds the same way (muP's init included).

        ``skip_weight_param_allocation``: the weight is the tied word embedding, passed at call time.
        """
        return tensor_parallel.ColumnParallelLinear(
            self.config.hidden_size, vocab_size, config=self.config,
            init_method=output_layer_init_method(self.config, self.share_embeddings_and_output_weights),
            bias=bias, skip_bias_add=False, gather_output=not parallel_output,
            skip_weight_param_allocation=skip_weight_param_allocation, tp_group=self.tp_group,
        )

    def _scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits times ``config.mup_output_mult`` under ``use_mup`` (muP's output multiplier), else as given."""
        if self.config.use_mup and self.config.mup_output_mult != 1.0:
            return logits * self.config.mup_output_mult
        return logits

    def compute_mtp_single_step(self, hidden_states: torch.Tensor, next_token_ids: torch.Tensor,
                                position_ids: torch.Tensor, depth: int | None = None, eager: bool = False,
                                cache_key: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP depth for speculative decoding: ``(hidden [N, 1, h], logits [N, 1, V])``.

        ``hidden_states`` ``[N, 1, h]`` are the states after the last verified token of each of N requests and
        ``next_token_ids`` / ``position_ids`` ``[1, N]`` the token that follows it. Each request's position attends
        only to itself (requests run as a batch of one-token sequences; no MTP KV cache). ``depth`` picks the MTP
        layer (None: the first, for ``mtp_use_repeated_layer``); ``eager`` and ``cache_key`` are accepted for
        signature compatibility (no CUDA-graph manager here).
        """
        del eager, cache_key
        layer = self.mtp.layers[0 if depth is None else depth]
        mtp_hidden = layer.forward_single_position(
            hidden_states=hidden_states.transpose(0, 1), next_token_ids=next_token_ids.transpose(0, 1),
            position_ids=position_ids.transpose(0, 1), embedding=self.embedding,
        ).transpose(0, 1)
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(mtp_hidden, weight=weight, runtime_gather_output=True)
        return mtp_hidden, self._scale_logits(logits)

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """The word-embedding weight on the first stage and on a stage with MTP layers (which holds a copy of the
        embedding), otherwise the output weight on the last stage."""
        if self.pre_process or getattr(self, "mtp_process", False):
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def setup_embeddings_and_output_layer(self) -> None:
        """Tag embedding/output parameters and synchronise the copies of the word embedding across stages.

        A later stage holds a copy of the first stage's word embedding when the output weights are tied to it
        (on the last stage) or when it runs the MTP layers (which embed the shifted tokens): that copy starts
        at zero and takes the first stage's values by an all-reduce over the embedding group, and
        ``finalize_model_grads`` all-reduces the copies' gradients the same way (``shared_embedding``).
        """
        mtp_process = getattr(self, "mtp_process", False)
        if self.pre_process or mtp_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        if self.config.use_mup:  # muP's optimizer overrides keep the base lr / eps for these
            if self.pre_process or mtp_process:
                for param in self.embedding.parameters():
                    param.is_embedding_parameter = True
            if self.post_process and self.output_layer.weight is not None:
                self.output_layer.weight.is_embedding_parameter = True
        # MTP layers on a stage other than the first: that stage holds a copy of the embedding.
        if not self.share_embeddings_and_output_weights and not getattr(self.config, "mtp_num_layers", None):
            return
        if self.pre_process and self.post_process:
            if self.share_embeddings_and_output_weights:
                self.shared_embedding_or_output_weight().zero_out_wgrad = True
            return
        if self.pre_process:
            self.shared_embedding_or_output_weight().shared_embedding = True
        elif (self.post_process and self.share_embeddings_and_output_weights) or mtp_process:
            weight = self.shared_embedding_or_output_weight()
            weight.data.fill_(0)
            weight.shared = True
            weight.shared_embedding = True
            if self.config.use_mup:
                weight.is_embedding_parameter = True
        else:  # a last stage with an untied output layer and no MTP layers holds no copy
            return
        group = self.pg_collection.embd
        if get_pg_size(group) <= 1:
            return
        if self._explicit_groups or mtp_process:  # an MTP stage's copy is synchronised on whichever stage it is
            member = dist.get_rank() in dist.get_process_group_ranks(group)
        else:
            member = parallel_state.is_rank_in_embedding_group(
                ignore_virtual=False, vp_stage=getattr(self, "vp_stage", None)
            )
        if member:
            # With use_cpu_initialization the weight is still on the CPU: reduce a copy on the device the
            # group's backend serves (NCCL cannot reduce CPU tensors) and copy the result back.
            weight = self.shared_embedding_or_output_weight()
            device = get_current_device()
            on_device = weight.data.to(device)
            dist.all_reduce(on_device, group=group)
            if on_device is not weight.data:
                weight.data.copy_(on_device)
