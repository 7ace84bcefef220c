"""The MoE gate: ``Router`` (gating weight) and ``TopKRouter`` (Megatron-Core's ``router``).

``TopKRouter.forward(input [s, b, h])`` returns ``(probs, routing_map)``, both
``[s * b, num_experts]``. Steps: optional input jitter, logits in ``moe_router_dtype``, z-loss,
top-k with the score function (optionally group-limited and expert-biased), optional token
dropping to capacity, the balance losses (attached to ``probs`` by :class:`MoEAuxLossAutoScaler`),
and, with aux-loss-free balancing, the per-expert token count that ``finalize_model_grads``
turns into an ``expert_bias`` update once per step. The gating weight is replicated on every rank
(marked ``sequence_parallel`` under sequence parallelism so its gradient is summed over TP).

Two load-balancing types replace the top-k selection: ``"sinkhorn"`` (S-BASE: in training the experts
are the top-k of the Sinkhorn-balanced logits, probs the sigmoid (top-1) or softmax of the logits) and
``"quantile_balancing"`` (the top-k of ``logits - qb_beta``; each training micro-batch adds the quantile
of :func:`.moe_utils.qb_dual_update` to ``qb_beta_accum``, and ``finalize_model_grads`` moves ``qb_beta``
to its data-parallel average once per global batch).

``InferenceTopKRouter`` (the router of the inference-optimized MoE spec) is a ``TopKRouter`` that, while an
inference engine uses the model (``InferenceMode.is_active()``), skips the training-only steps and returns dense
``(probs, indices)`` ``[tokens, topk]``; otherwise it is the plain ``TopKRouter``.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core._ground.inference_mode import InferenceMode
from megatron_core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron_core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    apply_biased_logits,
    apply_random_logits,
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    get_default_pg_collection,
    get_tokens_per_expert_and_token_count,
    get_updated_expert_bias,
    qb_dual_update,
    router_gating_linear,
    sinkhorn,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
    z_loss_func,
)
from megatron_core.transformer.moe.router_replay import RouterReplay
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["InferenceTopKRouter", "Router", "TopKRouter", "is_dense_routing", "sparse_routing_from_dense"]

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
# Buffers kept in fp32 whatever the model's dtype (Float16Module casts floating buffers).
_FP32_BUFFERS = ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert", "qb_beta", "qb_beta_accum")


def _gather_rows(tensor: torch.Tensor, group: Any) -> tuple[torch.Tensor, int]:
    """``tensor``'s rows from every rank of ``group`` (rank order), and this rank's index (``group`` None: this
    rank alone)."""
    if get_pg_size(group) == 1:
        return tensor, 0
    return gather_from_sequence_parallel_region(tensor, group=group), get_pg_rank(group)


class Router(MegatronModule):
    """Base router: the gating linear layer ``weight [num_experts, hidden]`` (and bias with ``add_bias_linear``)."""

    def __init__(self, config: TransformerConfig, pg_collection: Any = None, is_mtp_layer: bool = False) -> None:
        super().__init__(config)
        pgs = get_default_pg_collection(pg_collection)
        self.num_experts = config.num_moe_experts
        self.layer_number: int | None = None
        self.is_mtp_layer = is_mtp_layer
        # The metrics tracker's 1-based slot as a tensor: compiled code reads it without specialising on its
        # value (an int attribute would make torch.compile build one graph per layer).
        self.register_buffer("metrics_slot", None, persistent=False)
        self.tp_group, self.cp_group = pgs.tp, pgs.cp
        self.tp_cp_group, self.tp_dp_cp_group = pgs.tp_cp, pgs.tp_dp_cp
        self.weight = torch.nn.Parameter(torch.empty(config.num_moe_experts, config.hidden_size, dtype=torch.float32))
        self.bias = (torch.nn.Parameter(torch.empty(config.num_moe_experts, dtype=torch.float32))
                     if config.add_bias_linear else None)
        self.calculate_per_token_loss = config.calculate_per_token_loss
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise with ``config.init_method`` (in fp32, then cast to ``params_dtype``)."""
        if self.config.perform_initialization:
            self.config.init_method(self.weight)
            if self.bias is not None:
                with torch.no_grad():
                    self.bias.zero_()
        self.weight.data = self.weight.data.to(self.config.params_dtype)
        self.weight.sequence_parallel = self.config.sequence_parallel
        if self.bias is not None:
            self.bias.data = self.bias.data.to(self.config.params_dtype)
            self.bias.sequence_parallel = self.config.sequence_parallel

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """Router logits ``[s, b, num_experts]`` in ``moe_router_dtype`` (else the input's dtype)."""
        dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
        return router_gating_linear(input, self.weight, self.bias, dtype)

    def routing(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs, routing_map)`` from ``logits``; implemented by subclasses."""
        raise NotImplementedError

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``input``; implemented by subclasses."""
        raise NotImplementedError

    def set_layer_number(self, layer_number: int) -> None:
        """The global 1-based layer number, used to log per-layer metrics (MTP layers after the decoder's)."""
        self.layer_number = layer_number
        if getattr(self, "router_replay", None) is not None:
            self.router_replay.layer_number = layer_number
        slot = layer_number + (self.config.num_layers if self.is_mtp_layer else 0)
        self.metrics_slot = torch.tensor(slot, dtype=torch.long, device=self.weight.device)


class TopKRouter(Router):
    """Route each token to its top-k experts (see the module docstring for the steps)."""

    def __init__(self, config: TransformerConfig, pg_collection: Any = None, is_mtp_layer: bool = False) -> None:
        super().__init__(config, pg_collection, is_mtp_layer)
        self.topk = config.moe_router_topk
        self.routing_type = config.moe_router_load_balancing_type
        self.score_function = config.moe_router_score_function
        self.input_jitter = None
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        device = self.weight.device
        if self.enable_expert_bias:
            self.register_buffer("local_tokens_per_expert", torch.zeros(self.num_experts, device=device),
                                 persistent=False)
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, device=device))
        else:
            self.local_tokens_per_expert = None
            self.expert_bias = None
        if self.get_aux_loss_coeff("global_aux_loss") > 0:
            self.register_buffer("global_tokens_per_expert", torch.zeros(self.num_experts, device=device),
                                 persistent=False)
            self.register_buffer("ga_steps", torch.zeros((), device=device), persistent=False)
        else:
            self.global_tokens_per_expert = None
            self.ga_steps = None
        self._init_quantile_balancing(device)
        # moe_enable_routing_replay: this layer's top-k can be recorded and replayed (see .router_replay).
        self.router_replay = RouterReplay() if config.moe_enable_routing_replay else None

    def _init_quantile_balancing(self, device: torch.device) -> None:
        """Quantile balancing's buffers: the bias ``qb_beta`` (saved) and the step's accumulators (not saved)."""
        if self.routing_type != "quantile_balancing":
            self.qb_beta = self.qb_beta_accum = self.qb_beta_count = None
            return
        self.register_buffer("qb_beta", torch.zeros(self.num_experts, device=device))
        self.register_buffer("qb_beta_accum", torch.zeros(self.num_experts, device=device), persistent=False)
        self.register_buffer("qb_beta_count", torch.zeros((), dtype=torch.long, device=device), persistent=False)

    def get_aux_loss_coeff(self, aux_loss_type: str) -> float:
        """The coefficient of ``aux_loss_type`` (0 when that loss is not configured)."""
        kinds, coeffs = self.routing_type, self.config.moe_aux_loss_coeff
        if isinstance(kinds, str):
            return coeffs if kinds == aux_loss_type else 0.0
        return coeffs[kinds.index(aux_loss_type)] if aux_loss_type in kinds else 0.0

    def is_aux_loss_enabled(self) -> bool:
        """True when any balance loss has a positive coefficient."""
        return any(self.get_aux_loss_coeff(k) > 0 for k in ("aux_loss", "seq_aux_loss", "global_aux_loss"))

    def _num_layers(self) -> tuple[int, torch.Tensor | None]:
        """Slots in the metrics tracker and this layer's 1-based slot (a tensor; None before ``set_layer_number``)."""
        return self.config.num_layers + (self.config.mtp_num_layers or 0), self.metrics_slot

    def attach_and_log_load_balancing_loss(self, activation: torch.Tensor, aux_loss_coeff: float,
                                           aux_loss: torch.Tensor, aux_loss_name: str, reduce_group: Any,
                                           needs_dp_avg: bool = True, valid_token_count: Any = None
                                           ) -> torch.Tensor:
        """Record ``aux_loss / coeff`` for logging and attach ``aux_loss`` to ``activation``'s graph."""
        num_layers, layer = self._num_layers()
        get_moe_metrics_tracker().record(aux_loss_name, aux_loss / aux_loss_coeff, layer, num_layers,
                                         reduce_group=reduce_group, needs_dp_avg=needs_dp_avg)
        if self.calculate_per_token_loss:
            tokens = valid_token_count if valid_token_count is not None else activation.shape[0]
            aux_loss = aux_loss * tokens * get_pg_size(self.tp_cp_group)
        return MoEAuxLossAutoScaler.apply(activation, aux_loss)

    def _apply_aux_loss(self, probs, scores, routing_map, kind: str, seq_length: int, bsz: int):
        coeff = self.get_aux_loss_coeff(kind)
        if coeff == 0:
            return probs
        group, topk, divisor, needs_dp_avg = self.tp_cp_group, self.topk, 1, True
        if kind == "seq_aux_loss":
            # Folding the batch into the expert dim makes the loss a sum of per-sequence losses.
            scores, routing_map = scores.reshape(seq_length, -1), routing_map.reshape(seq_length, -1)
            topk, divisor = self.topk * bsz, bsz
        elif kind == "global_aux_loss":
            group, needs_dp_avg = self.tp_dp_cp_group, False
        counts, local_tokens, total_tokens = get_tokens_per_expert_and_token_count(routing_map, group, topk)
        if kind == "global_aux_loss":
            self.global_tokens_per_expert += counts
            self.ga_steps += 1
            counts = self.global_tokens_per_expert / self.ga_steps
        loss = switch_load_balancing_loss_func(scores, counts, total_tokens, self.topk, self.num_experts, coeff) / divisor
        name = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                "global_aux_loss": "global_load_balancing_loss"}[kind]
        return self.attach_and_log_load_balancing_loss(probs, coeff, loss, name, group, needs_dp_avg,
                                                       local_tokens * divisor)

    def apply_z_loss(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attach the z-loss to ``logits`` (training with grad only) and record it."""
        if self.config.moe_z_loss_coeff is None or not (self.training and torch.is_grad_enabled()):
            return logits
        coeff = self.config.moe_z_loss_coeff / get_pg_size(self.tp_cp_group)
        z_loss = z_loss_func(logits, coeff, padding_mask)
        scaled = z_loss
        if self.calculate_per_token_loss:
            tokens = (~padding_mask).sum() if padding_mask is not None else logits.shape[0]
            scaled = z_loss * tokens * get_pg_size(self.tp_cp_group)
        logits = MoEAuxLossAutoScaler.apply(logits, scaled)
        num_layers, layer = self._num_layers()
        get_moe_metrics_tracker().record("z_loss", z_loss / coeff, layer, num_layers, avg_group=self.tp_dp_cp_group,
                                         needs_dp_avg=False)
        return logits

    def apply_input_jitter(self, input: torch.Tensor) -> torch.Tensor:
        """Multiply ``input`` by uniform noise in ``[1 - eps, 1 + eps]`` (``moe_input_jitter_eps``)."""
        eps = self.config.moe_input_jitter_eps
        if eps is None:
            return input
        noise = torch.empty_like(input).uniform_(1.0 - eps, 1.0 + eps)
        return input * noise

    def _record_expert_load(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None) -> None:
        if not torch.is_grad_enabled():
            return
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & (~padding_mask).unsqueeze(-1)
            counts = routing_map.sum(dim=0).float()
            if self.enable_expert_bias:
                self.local_tokens_per_expert += counts
            if self.training:
                num_layers, layer = self._num_layers()
                imbalance = counts.max() / counts.mean().clamp(min=1e-6)
                get_moe_metrics_tracker().record("load_imbalance", imbalance, layer, num_layers,
                                                 avg_group=self.tp_cp_group)

    def _sinkhorn_activation(self, logits: torch.Tensor) -> torch.Tensor:
        """Sinkhorn routing's probabilities over all experts: sigmoid for top-1, else softmax (fp32, cast back)."""
        if self.topk == 1:
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)

    def sinkhorn_load_balancing(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sinkhorn (S-BASE) routing of ``logits [num_tokens, num_experts]``: ``(probs, routing_map)``.

        Training picks each token's top-k of the Sinkhorn-balanced fp32 logits (no gradient); evaluation
        the top-k of the activated logits. The probs are the activated logits on the chosen experts.
        """
        activated = self._sinkhorn_activation(logits)
        if self.training:
            with torch.no_grad():
                indices = torch.topk(sinkhorn(logits.detach().float()), k=self.topk, dim=1).indices
        else:
            indices = torch.topk(activated, k=self.topk, dim=1).indices
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
        return activated * routing_map, routing_map

    def quantile_balancing(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantile-balancing routing of ``logits [num_tokens, num_experts]``: ``(probs, routing_map)``.

        The experts are the top-k of ``logits - qb_beta`` over the TP x CP group's tokens (fp32, no
        gradient); a training micro-batch with gradients adds its quantile to ``qb_beta_accum``. The probs
        come from the score function at the chosen experts (``topk_routing_with_score_function``).
        """
        update = self.training and torch.is_grad_enabled()
        local_tokens = logits.shape[0]
        with torch.no_grad():
            full, rank = _gather_rows(logits.detach().float(), self.tp_cp_group)
            indices, quantile = qb_dual_update(full, self.topk, self.qb_beta, update_beta=update)
            if update:
                self.qb_beta_accum.add_(quantile)
                self.qb_beta_count.add_(1)
            indices = indices[rank * local_tokens:(rank + 1) * local_tokens]
        cfg = self.config
        return topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=cfg.moe_router_pre_softmax,
            scaling_factor=cfg.moe_router_topk_scaling_factor, score_function=self.score_function,
            fused=cfg.moe_router_fusion, precomputed_indices=indices,
        )

    def _select_experts(self, logits: torch.Tensor, padding_mask: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs, routing_map)`` by the configured load-balancing type."""
        if self.routing_type == "sinkhorn":
            return self.sinkhorn_load_balancing(logits)
        if self.routing_type == "quantile_balancing":
            if padding_mask is not None:
                raise ValueError("moe_router_load_balancing_type='quantile_balancing' does not take a padding_mask "
                                 "(as in Megatron-Core)")
            return self.quantile_balancing(logits)
        cfg = self.config
        return topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=cfg.moe_router_pre_softmax, num_groups=cfg.moe_router_num_groups,
            group_topk=cfg.moe_router_group_topk, scaling_factor=cfg.moe_router_topk_scaling_factor,
            score_function=self.score_function, expert_bias=self.expert_bias, fused=cfg.moe_router_fusion,
            router_replay=self.router_replay,
        )

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs, routing_map)`` ``[s * b, num_experts]`` from ``logits [s, b, num_experts]``."""
        seq_length, bsz = logits.shape[:2]
        logits = logits.reshape(-1, self.num_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask)
        cfg = self.config
        probs, routing_map = self._select_experts(logits, padding_mask)
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, self.topk, cfg.moe_expert_capacity_factor, cfg.moe_token_drop_policy,
                cfg.moe_pad_expert_input_to_capacity,
            )
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            aux_map, scores = compute_routing_scores_for_aux_loss(logits, self.topk, self.score_function,
                                                                  padding_mask=padding_mask)
            for kind in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
                probs = self._apply_aux_loss(probs, scores, aux_map, kind, seq_length, bsz)
        self._record_expert_load(routing_map, padding_mask)
        return probs, routing_map

    def _maintain_float32_expert_bias(self) -> None:
        """Keep the biases and their accumulators in fp32 (``Float16Module`` casts buffers to half precision)."""
        for name in _FP32_BUFFERS:
            buffer = getattr(self, name, None)
            if buffer is not None and buffer.dtype != torch.float32:
                buffer.data = buffer.data.float()

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._maintain_float32_expert_bias()
        super()._load_from_state_dict(*args, **kwargs)

    def update_expert_bias(self) -> None:
        """Move ``expert_bias`` toward balance and restart the token counts (aux-loss-free balancing).

        Called once per step by :func:`megatron_core.distributed.finalize_model_grads`, after the
        gradients are reduced; a no-op unless ``moe_router_enable_expert_bias``.
        """
        if not self.enable_expert_bias or self.expert_bias is None:
            return
        updated = get_updated_expert_bias(self.local_tokens_per_expert, self.expert_bias,
                                          self.config.moe_router_bias_update_rate, self.tp_dp_cp_group)
        self.expert_bias.copy_(updated)
        self.local_tokens_per_expert.zero_()

    def reset_global_aux_loss_tracker(self) -> None:
        """Restart the global-batch token counts of ``global_aux_loss``."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()

    def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs, routing_map)`` for ``input [s, b, h]``; ``padding_mask [s, b]`` is True for padding."""
        self._maintain_float32_expert_bias()
        logits = self.gating(self.apply_input_jitter(input))
        if self.config.moe_router_force_load_balancing:  # benchmark aid: random logits, straight-through gradient
            logits = apply_random_logits(logits)
        if self.config.moe_router_force_biased is not None:  # benchmark aid: random logits plus a shared bias
            logits = apply_biased_logits(logits, self.config.moe_router_force_biased, self.layer_number)
        return self.routing(logits, padding_mask)


def is_dense_routing(routing_map: torch.Tensor) -> bool:
    """Whether a router's second output is dense top-k indices ``[tokens, topk]`` (``InferenceTopKRouter`` in
    inference) rather than a boolean routing map ``[tokens, num_experts]``."""
    return routing_map.dtype != torch.bool


def sparse_routing_from_dense(probs: torch.Tensor, indices: torch.Tensor, num_experts: int
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, routing_map)`` ``[tokens, num_experts]`` from dense ``probs`` / ``indices`` ``[tokens, topk]``."""
    sparse_probs = probs.new_zeros(probs.shape[0], num_experts).scatter(1, indices, probs)
    routing_map = torch.zeros(probs.shape[0], num_experts, dtype=torch.bool, device=probs.device)
    return sparse_probs, routing_map.scatter(1, indices, True)


_compiled_routing: list[Any] = []  # topk_routing_with_score_function compiled at the first CUDA call


class InferenceTopKRouter(TopKRouter):
    """A top-k router for inference: dense ``[tokens, topk]`` output, no training-only steps.

    While ``InferenceMode.is_active()`` (an inference engine is using the model) ``forward`` returns
    ``(probs, indices)`` ``[tokens, topk]`` computed with the plain top-k of the score function (with the
    expert bias, and quantile balancing's fixed ``qb_beta`` when configured): no input jitter, z-loss, balance
    losses, token dropping or expert-load counting; the padding mask is ignored. Otherwise (training, or
    scoring outside an engine) it is :class:`TopKRouter`. On CUDA the routing runs through ``torch.compile``
    (built at the first call, never at import); on the CPU it runs eagerly.
    Configs it cannot serve raise ``ValueError``: ``moe_router_num_groups`` must be None and
    ``moe_router_score_function`` ``"softmax"`` or ``"sigmoid"``.
    """

    def __init__(self, config: TransformerConfig, pg_collection: Any = None, is_mtp_layer: bool = False) -> None:
        if config.moe_router_num_groups is not None:
            raise ValueError(f"InferenceTopKRouter needs moe_router_num_groups=None, got "
                             f"{config.moe_router_num_groups} (group-limited routing is not supported)")
        if config.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"InferenceTopKRouter needs moe_router_score_function 'softmax' or 'sigmoid', got "
                             f"{config.moe_router_score_function!r}")
        super().__init__(config, pg_collection, is_mtp_layer)

    def _topk_routing(self, logits: torch.Tensor, precomputed_indices: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        routing = topk_routing_with_score_function
        if logits.is_cuda:
            if not _compiled_routing:
                _compiled_routing.append(torch.compile(topk_routing_with_score_function, dynamic=True))
            routing = _compiled_routing[0]
        cfg = self.config
        return routing(logits, self.topk, use_pre_softmax=cfg.moe_router_pre_softmax,
                       scaling_factor=cfg.moe_router_topk_scaling_factor, score_function=self.score_function,
                       expert_bias=self.expert_bias, fused=cfg.moe_router_fusion, router_replay=self.router_replay,
                       dense_output=True, precomputed_indices=precomputed_indices)

    def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inference: ``(probs, indices)`` ``[tokens, topk]`` for ``input [s, b, h]`` (or ``[tokens, h]``);
        otherwise :meth:`TopKRouter.forward`."""
        if not InferenceMode.is_active():
            return super().forward(input, padding_mask)
        self._maintain_float32_expert_bias()
        logits = self.gating(input).reshape(-1, self.num_experts)
        precomputed = None
        if self.qb_beta is not None:  # quantile balancing selects on logits - qb_beta (fixed at inference)
            precomputed = (logits - self.qb_beta).topk(self.topk, dim=1).indices
        return self._topk_routing(logits, precomputed)
