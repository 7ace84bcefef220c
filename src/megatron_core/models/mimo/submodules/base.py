"""``ModalitySubmodules``: one modality's encoders, decoders and projections to and from the language model.

``forward`` runs every encoder on its own inputs, flattens each output to ``[tokens, hidden]``, concatenates
them, and maps the result to the language model's width with the (first) input projection.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.utils import sharded_state_dict_default


class ModalitySubmodules(ABC, nn.Module):
    """Encoders (``nn.ModuleDict``), decoders (``nn.ModuleDict``), input and output projections
    (``nn.ModuleList``) of one modality.

    ``is_first_stage`` / ``is_last_stage`` place this rank in the modality's pipeline: encoders run on
    the first stage, the input projection on the last. ``pg_collection`` (optional) supplies the
    ``dp_cp`` group recorded in ``sharded_state_dict``'s metadata. Subclasses implement ``decode``.
    """

    def __init__(
        self,
        encoders: dict[str, nn.Module] | None = None,
        decoders: dict[str, nn.Module] | None = None,
        input_projections: list[nn.Module] | None = None,
        output_projections: list[nn.Module] | None = None,
        is_first_stage: bool = True,
        is_last_stage: bool = True,
        pg_collection: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.encoders = nn.ModuleDict(encoders or {})
        self.decoders = nn.ModuleDict(decoders or {})
        self.input_projections = nn.ModuleList(input_projections or [])
        self.output_projections = nn.ModuleList(output_projections or [])
        self.pg_collection = pg_collection
        self._is_first_stage = is_first_stage
        self._is_last_stage = is_last_stage

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds the modality's first pipeline stage."""
        return self._is_first_stage

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the modality's last pipeline stage."""
        return self._is_last_stage

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Sharded state of every encoder, decoder and projection, under ``<prefix><container>.<name>.``.

        With a ``pg_collection``, its ``dp_cp`` group counts the DP replicas (``metadata["dp_cp_group"]``) and
        its ``tp`` group is the TP group of children that have none of their own.
        """
        dp_cp = getattr(self.pg_collection, "dp_cp", None)
        if dp_cp is not None:
            metadata = {**(metadata or {}), "dp_cp_group": dp_cp}
        out: dict = {}
        for name, container in self.named_children():
            for sub_name, module in container.named_children():
                sub_prefix = f"{prefix}{name}.{sub_name}."
                if hasattr(module, "sharded_state_dict"):
                    out.update(module.sharded_state_dict(sub_prefix, sharded_offsets, metadata))
                else:
                    out.update(sharded_state_dict_default(module, sub_prefix, sharded_offsets, metadata,
                                                          tp_group=getattr(self.pg_collection, "tp", None)))
        return out

    @classmethod
    def from_spec(cls, module_spec: ModuleSpec, is_first_stage: bool = True,
                  is_last_stage: bool = True) -> ModalitySubmodules:
        """Build from a spec whose ``submodules`` dict may hold ``encoders`` / ``decoders`` (name -> spec)
        and ``input_projections`` / ``output_projections`` (lists of specs); ``params`` go to the constructor.

        Input projections are built only on the last stage, output projections only on the first.
        """
        params = dict(module_spec.params or {})
        subs = module_spec.submodules or {}
        encoders = {name: build_module(spec) for name, spec in subs.get("encoders", {}).items()}
        decoders = {name: build_module(spec) for name, spec in subs.get("decoders", {}).items()}
        input_projections = [build_module(s) for s in subs.get("input_projections", [])] if is_last_stage else []
        output_projections = [build_module(s) for s in subs.get("output_projections", [])] if is_first_stage else []
        return cls(encoders=encoders, decoders=decoders, input_projections=input_projections,
                   output_projections=output_projections, is_first_stage=is_first_stage,
                   is_last_stage=is_last_stage, **params)

    def combine_embeddings(self, embeddings: list[torch.Tensor]) -> torch.Tensor:
        """Concatenate ``[tokens_i, hidden]`` embeddings along the token dimension."""
        if not embeddings:
            raise ValueError("combine_embeddings: got an empty list of embeddings")
        return embeddings[0] if len(embeddings) == 1 else torch.cat(embeddings, dim=0)

    def encode(self, encoders_data_batch: dict) -> list[torch.Tensor]:
        """Run each encoder on ``encoders_data_batch[name]`` (keyword arguments); outputs flattened to 2-D.

        An encoder returning a tuple contributes its first element; ``[b, s, h]`` becomes ``[b*s, h]``.
        """
        if not encoders_data_batch:
            return []
        unknown = sorted(set(encoders_data_batch) - set(self.encoders))
        if unknown:
            raise ValueError(f"inputs given for unknown encoders {unknown}; the encoders are {list(self.encoders)}")
        outputs = []
        for name, encoder in self.encoders.items():
            if name not in encoders_data_batch:
                raise ValueError(f"no inputs for encoder '{name}' (inputs given for {list(encoders_data_batch)})")
            out = encoder(**encoders_data_batch[name])
            if isinstance(out, tuple) and out and torch.is_tensor(out[0]):
                out = out[0]
            if out.ndim == 3:
                out = out.reshape(-1, out.size(-1))
            elif out.ndim != 2:
                raise ValueError(f"encoder '{name}' returned shape {tuple(out.shape)}; expected [b, s, h] or "
                                 f"[tokens, h]")
            outputs.append(out)
        return outputs

    @abstractmethod
    def decode(self, embeddings: torch.Tensor, data_batch: dict) -> torch.Tensor:
        """Turn language-model hidden states into this modality's outputs."""

    def project_embeddings(self, embeddings: list[torch.Tensor], is_input: bool = True) -> torch.Tensor | None:
        """Concatenate ``embeddings`` and apply the first input (or output) projection, if there is one."""
        combined = self.combine_embeddings(embeddings)
        projections = self.input_projections if is_input else self.output_projections
        return projections[0](combined) if len(projections) else combined

    def forward(self, encoder_inputs: dict[str, Any] | None = None,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor | None:
        """Encode (first stage) or take ``hidden_states`` (from an earlier stage), then project (last stage).

        Returns ``[tokens, hidden]`` or ``None`` when there is nothing to encode.
        """
        if encoder_inputs is not None and hidden_states is not None:
            raise ValueError("ModalitySubmodules.forward: pass encoder_inputs or hidden_states, not both")
        if hidden_states is not None:
            combined = hidden_states
        elif self.is_first_stage and encoder_inputs is not None:
            embeddings = self.encode(encoder_inputs)
            if not embeddings:
                return None
            combined = self.combine_embeddings(embeddings)
        else:
            return None
        if self.is_last_stage:
            return self.project_embeddings([combined], is_input=True)
        return combined

class EncoderOnlyModalitySubmodules(ModalitySubmodules):
    """A modality with encoders, at most one input and one output projection, and no decoder (vision, audio)."""

    def __init__(
        self,
        encoders: dict[str, nn.Module] | None = None,
        decoders: dict[str, nn.Module] | None = None,
        input_projections: list[nn.Module] | None = None,
        output_projections: list[nn.Module] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(encoders=encoders, decoders=decoders, input_projections=input_projections,
                         output_projections=output_projections, **kwargs)
        for kind, projections in (("input", self.input_projections), ("output", self.output_projections)):
            if len(projections) > 1:
                raise ValueError(f"{type(self).__name__} supports at most one {kind} projection, "
                                 f"got {len(projections)}")

    def decode(self, embeddings: torch.Tensor, data_batch: dict) -> torch.Tensor:
        """Decoding is not supported for this modality (as in Megatron-Core): raises ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__}.decode: decoders are not supported for this modality")


__all__ = ["EncoderOnlyModalitySubmodules", "ModalitySubmodules"]
