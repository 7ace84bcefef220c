"""``MimoModel``: modality encoders and projections feeding a language model.

Each modality's ``ModalitySubmodules`` turns its inputs into ``[tokens, hidden]`` embeddings; they replace,
in order, the positions of ``input_ids`` that hold the modality's special token; the other positions get
the language model's own token embeddings; the combined ``[s, b, h]`` sequence is the language model's
``decoder_input``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from megatron_core._ground import unwrap_model, wrapper_depth
from megatron_core.device import get_current_device
from megatron_core.distributed import DistributedDataParallel
from megatron_core.models.mimo.comm.colocated_communicator import ColocatedBridgeCommunicator
from megatron_core.models.mimo.config.base_configs import MimoModelConfig
from megatron_core.models.mimo.config.role import MIMO_LANGUAGE_MODULE_KEY, ModuleLayout, RankRole
from megatron_core.models.mimo.partition.utils import PartitionAdapter, PartitionConfig
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.spec_utils import build_module
from megatron_core.transformer.utils import sharded_state_dict_default

logger = logging.getLogger(__name__)


class MimoModel(MegatronModule):
    """Multimodal in/out model: ``modality_submodules`` (a ``ModuleDict`` by modality name) and ``language_model``.

    Built from a ``MimoModelConfig``. In the colocated layout every rank runs every module; in the
    non-colocated layout (grids on disjoint ranks) a rank runs only its modules: encoder ranks return their
    projected embeddings by modality name, language ranks read them (``set_input_tensor`` with a dict)
    and run the language model. ``cp_group`` / ``tp_group`` override the groups used for context and
    sequence parallel sharding of the combined embeddings.

    Colocated grids (``tp`` and ``dp`` axes) may differ in TP and DP: each modality's embeddings pass a
    ``ColocatedBridgeCommunicator`` (``colocated_comms[(modality, "language")]``) to the language model's DP
    layout. The caller slices the data to match (see that module): with more encoder than language replicas
    each rank gets its language replica's batch and its encoder slot's modality inputs; with fewer, its
    encoder replica's batch and its language slot's ``input_ids`` / labels / loss mask.
    """

    def __init__(self, mimo_config: MimoModelConfig, cp_group: Any = None, tp_group: Any = None) -> None:
        language_config = (mimo_config.language_model_spec.params or {}).get("config")
        if language_config is None:
            raise ValueError("MimoModelConfig.language_model_spec.params must hold the language model's 'config'")
        super().__init__(language_config)
        self.mimo_config = mimo_config
        self.role = RankRole.build(list(mimo_config.modality_submodules_spec), mimo_config.module_to_grid_map)
        self.colocated_comms: dict = {}
        if self.role.mode is ModuleLayout.COLOCATED and mimo_config.module_to_grid_map:
            self._build_colocated_communicators()
        self.special_token_ids = dict(mimo_config.special_token_ids or {})
        self.partition_adapter: PartitionAdapter | None = None
        if self.role.has_language_module and (language_config.context_parallel_size > 1
                                              or language_config.sequence_parallel):
            max_seq_len = mimo_config.language_model_spec.params.get("max_sequence_length", 4096)
            self.partition_adapter = PartitionAdapter(PartitionConfig.from_mp_config(
                language_config, max_seq_len=max_seq_len, kv_format=mimo_config.kv_format,
                cp_group=cp_group, tp_group=tp_group))
        self.modality_submodules = torch.nn.ModuleDict()
        self._initialize_submodules()
        self._initialize_language_model()

    def _build_colocated_communicators(self) -> None:
        """One ``ColocatedBridgeCommunicator`` per modality, from its grid to the language model's.

        Grids without ``tp`` and ``dp`` axes get none (their DP sizes are unknown). Layouts the bridge
        cannot serve raise ``ValueError`` naming the grids and their sizes (see the communicator).
        """
        grid_map = self.mimo_config.module_to_grid_map
        if any("tp" not in g.dim_names or "dp" not in g.dim_names for g in grid_map.values()):
            logger.info("MimoModel: no colocated bridges, not every grid of module_to_grid_map has tp and dp axes")
            return
        language_grid = grid_map[MIMO_LANGUAGE_MODULE_KEY]
        for name in self.mimo_config.modality_submodules_spec:
            self.colocated_comms[(name, MIMO_LANGUAGE_MODULE_KEY)] = ColocatedBridgeCommunicator(
                grid_map[name], language_grid, src_module_name=name, dest_module_name=MIMO_LANGUAGE_MODULE_KEY,
                dim_mapping={"b": 0, "h": 1})

    def _initialize_submodules(self) -> None:
        for name, spec in self.mimo_config.modality_submodules_spec.items():
            info = self.role.modules.get(name)
            if info is None:
                continue
            self.modality_submodules[name] = spec.module.from_spec(
                spec, is_first_stage=info.is_first_stage, is_last_stage=info.is_last_stage)

    def _initialize_language_model(self) -> None:
        self.language_model = (build_module(self.mimo_config.language_model_spec)
                               if self.role.has_language_module else None)

    # --- checkpointing ---------------------------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Sharded state of every modality submodule and the language model (wrappers add ``module.``).

        Each module is described on its own groups: the language model's ``pg_collection.dp_cp`` goes into its
        ``metadata["dp_cp_group"]`` (each ``ModalitySubmodules`` puts its own), so replica ids and TP offsets
        follow each module's grid, not ``parallel_state``; heterogeneous grids save one main replica per shard.
        """
        out: dict = {}
        for name, module in self.named_children():
            children = module.items() if name == "modality_submodules" else [(None, module)]
            for sub_name, child in children:
                child_prefix = f"{prefix}{name}." + (f"{sub_name}." if sub_name is not None else "")
                child_metadata = metadata
                pg = getattr(unwrap_model(child, DistributedDataParallel), "pg_collection", None)
                if sub_name is None and getattr(pg, "dp_cp", None) is not None:
                    child_metadata = {**(metadata or {}), "dp_cp_group": pg.dp_cp}
                child_prefix += "module." * wrapper_depth(child)
                child = unwrap_model(child)
                if hasattr(child, "sharded_state_dict"):
                    out.update(child.sharded_state_dict(child_prefix, sharded_offsets, child_metadata))
                else:
                    out.update(sharded_state_dict_default(child, child_prefix, sharded_offsets, child_metadata))
        return out

    # --- embeddings ------------------------------------------------------------------------------------------
    def align_embeddings_by_token_positions(self, modality_embeddings: dict[str, torch.Tensor],
                                            input_ids: torch.Tensor,
                                            special_token_ids: dict[str, int]) -> torch.Tensor:
        """Scatter each modality's ``[n, h]`` embeddings, in order, onto its special-token positions of
        ``input_ids`` ``[b, s]`` (``"text"``: every other position); returns ``[s, b, h]``.

        ``ValueError`` if a modality has no special token id, if a modality's token count differs from its
        number of embeddings, or if ``input_ids`` hold tokens of a modality without embeddings.
        """
        if not modality_embeddings:
            raise ValueError("align_embeddings_by_token_positions: no modality embeddings given")
        reference = modality_embeddings.get("text", next(iter(modality_embeddings.values())))
        batch, seq = input_ids.shape
        combined = torch.zeros(batch, seq, reference.size(-1), dtype=reference.dtype, device=reference.device)
        for name, emb in modality_embeddings.items():
            if name == "text":
                mask = torch.ones_like(input_ids, dtype=torch.bool)
                for token_id in special_token_ids.values():
                    mask &= input_ids != token_id
            elif name in special_token_ids:
                mask = input_ids == special_token_ids[name]
            else:
                raise ValueError(f"no special token id for modality '{name}' (special_token_ids: "
                                 f"{special_token_ids})")
            count = int(mask.sum().item())
            if count != emb.size(0):
                raise ValueError(f"number of '{name}' tokens in input_ids ({count}) does not match the number of "
                                 f"'{name}' embeddings ({emb.size(0)})")
            combined = combined.masked_scatter(mask.unsqueeze(-1).expand_as(combined), emb.to(combined.dtype))
        for name, token_id in special_token_ids.items():
            if name not in modality_embeddings:
                count = int((input_ids == token_id).sum().item())
                if count:
                    raise ValueError(f"input_ids hold {count} '{name}' tokens (id {token_id}) but no '{name}' "
                                     f"embeddings were produced (given: {sorted(modality_embeddings)})")
        return combined.transpose(0, 1).contiguous()

    def get_text_embeddings(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                            special_token_ids: dict[str, int]) -> torch.Tensor:
        """The language model's embeddings ``[n_text, h]`` of the non-special tokens of ``input_ids`` ``[b, s]``.

        ``position_ids`` ``[b, s]`` (or ``[channels, b, s]``, first channel used) are gathered alike.
        """
        mask = torch.ones_like(input_ids, dtype=torch.bool)
        for token_id in special_token_ids.values():
            mask &= input_ids != token_id
        b_idx, s_idx = mask.nonzero(as_tuple=True)
        text_ids = input_ids[b_idx, s_idx].unsqueeze(0)
        if position_ids is None:
            text_pos = None
        elif position_ids.dim() == 3:
            text_pos = position_ids[0, b_idx, s_idx].unsqueeze(0)
        else:
            text_pos = position_ids[b_idx, s_idx].unsqueeze(0)
        embedding = unwrap_model(self.language_model).embedding
        if (self.partition_adapter is not None and self.partition_adapter.cfg.seq_parallel
                and getattr(embedding, "scatter_to_sequence_parallel", False)):
            raise ValueError("MimoModel with sequence parallelism needs the language model built with "
                             "scatter_embedding_sequence_parallel=False (the combined embeddings are scattered "
                             "after alignment)")
        return embedding(input_ids=text_ids, position_ids=text_pos).squeeze(1)

    # --- pipeline / DDP plumbing -----------------------------------------------------------------------------
    def set_input_tensor(self, input_tensor: Any) -> None:
        """Inputs from an earlier stage: a dict by module name (multi-module), or the language model's tensor."""
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0]
        if isinstance(input_tensor, dict):
            self.input_tensors = {k: v[0] if isinstance(v, list) and len(v) == 1 else v
                                  for k, v in input_tensor.items()}
            return
        self.input_tensors = input_tensor
        if self.language_model is not None and hasattr(self.language_model, "set_input_tensor"):
            self.language_model.set_input_tensor(input_tensor)

    def _active_submodules(self) -> Iterator[torch.nn.Module]:
        if self.language_model is not None:
            yield self.language_model
        yield from (m for m in self.modality_submodules.values() if m is not None)

    def _active_ddp_modules(self) -> Iterator[DistributedDataParallel]:
        return (m for m in self._active_submodules() if isinstance(m, DistributedDataParallel))

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Hold back gradient reduction of the DDP-wrapped submodules that overlap it."""
        with ExitStack() as stack:
            for module in self._active_ddp_modules():
                if module.ddp_config.overlap_grad_reduce:
                    stack.enter_context(module.no_sync())
            yield

    def enable_forward_pre_hook(self) -> None:
        """Enable the parameter all-gather pre-hooks of DDP-wrapped submodules that overlap it."""
        for module in self._active_ddp_modules():
            if module.ddp_config.overlap_param_gather:
                module.enable_forward_pre_hook()

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Disable those pre-hooks (optionally syncing parameters now)."""
        for module in self._active_ddp_modules():
            if module.ddp_config.overlap_param_gather:
                module.disable_forward_pre_hook(param_sync=param_sync)

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Start the overlapped parameter all-gather of DDP-wrapped submodules."""
        for module in self._active_ddp_modules():
            if module.ddp_config.overlap_param_gather:
                module.start_param_sync(force_sync=force_sync, force_dispatch=force_dispatch)

    def start_grad_sync(self, *unused: Any) -> None:
        """Start the overlapped gradient reduction of DDP-wrapped submodules."""
        for module in self._active_ddp_modules():
            if module.ddp_config.overlap_grad_reduce:
                module.start_grad_sync()

    def free_overlap_buffers(self) -> None:
        """Release overlapped parameter-gather buffers of DDP-wrapped submodules (where they have any)."""
        for module in self._active_ddp_modules():
            if module.ddp_config.overlap_param_gather and hasattr(module, "free_overlap_buffers"):
                module.free_overlap_buffers()

    def zero_grad_buffer(self) -> None:
        """Zero the gradient buffers of every (DDP-wrapped) submodule."""
        for module in self._active_submodules():
            module.zero_grad_buffer()

    def destroy(self) -> None:
        """Destroy the process groups of the colocated bridges."""
        for comm in self.colocated_comms.values():
            comm.destroy()
        self.colocated_comms.clear()

    # --- forward ---------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, modality_inputs: dict[str, dict[str, Any]] | None = None,
                packing_kwargs: dict | None = None) -> tuple[Any, torch.Tensor | None]:
        """Returns ``(output, loss_mask)``; ``loss_mask`` is cut like the sequence under context parallelism.

        ``modality_inputs`` maps modality -> encoder name -> keyword arguments of that encoder. ``output``
        is the language model's (logits ``[b, s, v]``, or per-token loss ``[b, s]`` with ``labels``); on
        non-colocated encoder ranks a dict of embeddings by modality; on a language rank that is not the
        last stage ``{"language": hidden_states}``. ``packing_kwargs`` builds ``PackedSeqParams`` (thd).
        """
        if modality_inputs:
            unknown = sorted(set(modality_inputs) - set(self.mimo_config.modality_submodules_spec))
            if unknown:
                raise ValueError(f"modality_inputs has unknown modalities {unknown}; the model's modalities are "
                                 f"{list(self.mimo_config.modality_submodules_spec)}")
        input_tensors = getattr(self, "input_tensors", None)
        if self.role.mode is ModuleLayout.COLOCATED:
            return self._forward_all_modules(input_ids, position_ids, attention_mask, loss_mask, labels,
                                             modality_inputs, packing_kwargs)
        if self.role.has_modality_modules:
            return self._forward_encoders(input_ids, modality_inputs, input_tensors), loss_mask
        return self._forward_language_module(input_ids, position_ids, attention_mask, loss_mask, labels,
                                             input_tensors, packing_kwargs)

    @staticmethod
    def _build_packed_seq_params(packing_kwargs: dict | None) -> PackedSeqParams | None:
        if packing_kwargs is None:
            return None
        kwargs = {k: (v.to(torch.int32) if "cu_seqlens" in k and v is not None else v)
                  for k, v in packing_kwargs.items()}
        params = PackedSeqParams(**kwargs)
        params.qkv_format = "thd"
        return params

    def _shard_language_inputs(self, embeddings: torch.Tensor | None, labels: torch.Tensor | None,
                               loss_mask: torch.Tensor | None, packed_seq_params: Any = None) -> tuple:
        if self.partition_adapter is None:
            return embeddings, labels, loss_mask, packed_seq_params
        return self.partition_adapter.shard(embeddings, labels, loss_mask, packed_seq_params)

    def _combined_embeddings(self, modality_embeddings: dict[str, torch.Tensor], input_ids: torch.Tensor,
                             position_ids: torch.Tensor | None) -> torch.Tensor:
        modality_embeddings["text"] = self.get_text_embeddings(input_ids, position_ids, self.special_token_ids)
        return self.align_embeddings_by_token_positions(modality_embeddings, input_ids, self.special_token_ids)

    def _forward_all_modules(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                             attention_mask: torch.Tensor | None, loss_mask: torch.Tensor | None,
                             labels: torch.Tensor | None, modality_inputs: dict | None,
                             packing_kwargs: dict | None = None) -> tuple[Any, torch.Tensor | None]:
        """Colocated forward: every encoder, then the language model on the combined embeddings."""
        packed_seq_params = self._build_packed_seq_params(packing_kwargs)
        modality_embeddings = {}
        for name, submodule in self.modality_submodules.items():
            if modality_inputs and modality_inputs.get(name) is not None:
                emb = submodule(encoder_inputs=modality_inputs[name])
                if emb is not None:
                    comm = self.colocated_comms.get((name, MIMO_LANGUAGE_MODULE_KEY))
                    modality_embeddings[name] = emb if comm is None else comm.communicate(emb)
        combined = self._combined_embeddings(modality_embeddings, input_ids, position_ids)
        combined, labels, loss_mask, packed_seq_params = self._shard_language_inputs(
            combined, labels, loss_mask, packed_seq_params)
        output = self.language_model(input_ids=None, position_ids=position_ids, decoder_input=combined,
                                     labels=labels, attention_mask=None, packed_seq_params=packed_seq_params)
        return output, loss_mask

    def _forward_encoders(self, input_ids: torch.Tensor | None, modality_inputs: dict | None,
                          input_tensors: dict | None) -> dict[str, torch.Tensor]:
        """Non-colocated encoder rank: each of its modalities' (projected) embeddings, by modality name."""
        outputs = {}
        for name in self.role.modality_module_names:
            if name not in self.modality_submodules:
                continue
            inputs = modality_inputs.get(name) if modality_inputs else None
            hidden = input_tensors.get(name) if isinstance(input_tensors, dict) else None
            out = self.modality_submodules[name](encoder_inputs=inputs, hidden_states=hidden)
            if out is None and inputs is None and hidden is None:
                token_id = self.special_token_ids.get(name)
                if input_ids is not None and token_id is not None and bool((input_ids == token_id).any()):
                    raise ValueError(f"input_ids hold '{name}' tokens (id {token_id}) but no '{name}' inputs "
                                     f"were given")
                out = self._empty_encoder_output()
            if out is not None:
                outputs[name] = out
        return outputs

    def _empty_encoder_output(self) -> torch.Tensor:
        """A ``[0, hidden]`` payload for text-only batches on encoder ranks."""
        cfg = self.config
        dtype = getattr(cfg, "params_dtype", None) or torch.float32
        return torch.empty((0, cfg.hidden_size), dtype=dtype, device=get_current_device(), requires_grad=True)

    def _forward_language_module(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                                 attention_mask: torch.Tensor | None, loss_mask: torch.Tensor | None,
                                 labels: torch.Tensor | None, input_tensors: Any,
                                 packing_kwargs: dict | None = None) -> tuple[Any, torch.Tensor | None]:
        """Non-colocated language rank: combine received embeddings (first stage) or hidden states (later)."""
        lang = MIMO_LANGUAGE_MODULE_KEY
        if self.partition_adapter is not None and self.partition_adapter.cfg.use_cp and attention_mask is not None:
            raise ValueError("MimoModel with context parallelism needs attention_mask=None (use a causal mask type "
                             "or packed sequences)")
        packed_seq_params = self._build_packed_seq_params(packing_kwargs)
        received = input_tensors if isinstance(input_tensors, dict) else {}
        if self.role.is_first_stage(lang):
            embeddings = {k: v for k, v in received.items() if k != lang}
            combined = self._combined_embeddings(embeddings, input_ids, position_ids)
            combined, labels, loss_mask, packed_seq_params = self._shard_language_inputs(
                combined, labels, loss_mask, packed_seq_params)
        else:
            _, labels, loss_mask, packed_seq_params = self._shard_language_inputs(
                None, labels, loss_mask, packed_seq_params)
            hidden = received.get(lang)
            if hidden is not None:
                inner = unwrap_model(self.language_model)
                if hasattr(inner, "set_input_tensor"):
                    inner.set_input_tensor(hidden)
            combined = None
        output = self.language_model(input_ids=None, position_ids=position_ids, decoder_input=combined,
                                     labels=labels, attention_mask=attention_mask,
                                     packed_seq_params=packed_seq_params)
        if not self.role.is_last_stage(lang):
            return {lang: output}, loss_mask
        return output, loss_mask

__all__ = ["MimoModel"]
