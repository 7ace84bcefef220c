"""Run one inference forward, across pipeline stages (Megatron-Core's ``AbstractModelInferenceWrapper``).

``run_one_forward_step({"tokens", "position_ids", "attention_mask"})`` returns the full-vocabulary
logits ``[b, L, V]`` on every rank: tensor-parallel shards are gathered by the output layer, and
with pipeline parallelism each stage receives the previous stage's activations, runs its layers
(with the KV cache of its layers in the inference context) and sends them on; the last stage's
logits are then broadcast to all stages. Decode-only steps laid out for CUDA graphs (single
pipeline stage) replay a captured graph (:mod:`.cuda_graphs`); with
``InferenceConfig.compile_decode_graphs`` the captured forward is the ``torch.compile``'d one.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from megatron_core._ground import unwrap_model
from megatron_core._ground.decorators import deprecate_args
from megatron_core.inference import communication_utils as comm
from megatron_core.inference.contexts.base_context import BaseInferenceContext
from megatron_core.inference.contexts.step_layout import step_token_multiple
from megatron_core.inference.model_inference_wrappers.cuda_graphs import DecodeGraphRunner

__all__ = ["AbstractModelInferenceWrapper"]


DEPRECATED_ARGS = ["inference_wrapper_config", "pg_collection"]
"""Former wrapper keyword arguments (the settings now come from the model config and the inference context);
passing one raises ``TypeError``."""


class AbstractModelInferenceWrapper(abc.ABC):
    """Holds the model and its inference context; runs forward steps.

    ``decode_compile_options``: extra ``torch.compile`` keywords for the decode forward of
    ``compile_decode_graphs`` (for example ``{"mode": "max-autotune-no-cudagraphs"}``); set before the
    first decode step.
    """

    decode_compile_options: dict[str, Any] = {}

    @deprecate_args(*DEPRECATED_ARGS)
    def __init__(self, model: torch.nn.Module, inference_context: BaseInferenceContext | None = None) -> None:
        self.model = model
        self.inner_model = unwrap_model(model)
        self.config = self.inner_model.config
        self.inference_context = inference_context
        self.pp_group = comm.pipeline_group(self.inner_model)
        self.decode_graphs = DecodeGraphRunner()
        inference_config = getattr(inference_context, "inference_config", None)
        self.compile_decode_graphs = bool(getattr(inference_config, "compile_decode_graphs", False))
        self._compiled_decode_forward: Any = None
        self.prep_model_for_inference()

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters."""
        return next(self.model.parameters()).device

    def prep_model_for_inference(self) -> None:
        """Eval mode; the context's step tensors go to the model's device."""
        self.model.eval()
        if self.inference_context is not None and hasattr(self.inference_context, "device"):
            self.inference_context.device = self.device

    @abc.abstractmethod
    def prep_inference_input(self, prompts_tokens: torch.Tensor) -> dict[str, Any]:
        """Model inputs for a ``[b, s]`` batch of prompt tokens."""

    def _forward(self, inference_input: dict[str, Any]) -> torch.Tensor:
        return self.model(
            inference_input["tokens"], inference_input["position_ids"], inference_input.get("attention_mask"),
            inference_context=self.inference_context, runtime_gather_output=True,
        )

    def _decode_forward(self, inference_input: dict[str, Any]) -> torch.Tensor:
        """The forward a decode graph captures: ``torch.compile``'d with ``compile_decode_graphs``.

        Shapes are static per padded batch size, so each graph size compiles once (``dynamic=False``).
        """
        if not self.compile_decode_graphs:
            return self._forward(inference_input)
        if self._compiled_decode_forward is None:
            self._compiled_decode_forward = torch.compile(self._forward, dynamic=False,
                                                          **self.decode_compile_options)
        # One compiled graph per padded batch size: more than dynamo's default limit of 8 may be needed.
        with torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
            return self._compiled_decode_forward(inference_input)

    @torch.inference_mode()
    def run_one_forward_step(self, inference_input: dict[str, Any]) -> torch.Tensor:
        """Full-vocabulary logits ``[b, L, V]`` of one forward, on every rank."""
        graph_batch = getattr(self.inference_context, "graph_batch_size", None)
        if self.pp_group is None and graph_batch is not None:
            if self.device.type == "cuda":
                return self.decode_graphs.run(graph_batch, lambda: self._decode_forward(inference_input),
                                              getattr(self.inference_context, "snapshot_decode_states", None))
            return self._decode_forward(inference_input)  # the padded layout without graphs (CPU tests)
        if self.pp_group is None:
            return self._forward(inference_input)
        tokens = inference_input["tokens"]
        b, s = tokens.shape
        dtype = self.config.pipeline_dtype or self.config.params_dtype
        if not comm.is_pipeline_first_stage(self.pp_group):
            # A sequence-parallel stage passes its slice of the step (padded to a multiple of the TP size).
            hidden = comm.recv_from_prev_pipeline_rank((s // step_token_multiple(self.config), b,
                                                        self.config.hidden_size), dtype, self.device, self.pp_group)
            self.inner_model.set_input_tensor(hidden)
        output = self._forward(inference_input)
        last = comm.is_pipeline_last_stage(self.pp_group)
        if not last:
            comm.send_to_next_pipeline_rank(output.to(dtype), self.pp_group)
        rows = self._logit_rows(b, s)
        logits_dtype = torch.float32
        return comm.broadcast_from_last_pipeline_stage(
            [b, rows, self._vocab_size()], logits_dtype, output.float() if last else None, self.pp_group,
            device=self.device,
        )

    def _logit_rows(self, b: int, s: int) -> int:
        context = self.inference_context
        if context is not None and hasattr(context, "logit_index") and not context._all_rows:
            return int(context.logit_index.numel())
        return s

    def _vocab_size(self) -> int:
        return int(self.inner_model.vocab_size)
