"""The Mamba-2 mixer (Megatron-Core's ``MambaMixer``).

``in_proj`` (column-parallel) gives ``[z, x, B, C, dt]`` for this TP rank's heads and groups; ``x, B, C``
go through a depthwise causal convolution and SiLU (:mod:`megatron_core.ssm.causal_conv1d`), then the chunked
SSD scan: the fused Triton kernels of :mod:`megatron_core.ssm.ssd_scan_triton` on CUDA, else the pure-PyTorch
:func:`megatron_core.ssm.ssd_scan.ssd_chunk_scan` (the CPU path and the reference); the result is gated by
``silu(z)``, normalised per group (RMS) and projected back by ``out_proj`` (row-parallel). Under context parallelism
the convolution and scan run on the whole sequence for ``1/cp`` of the heads, between the all-to-alls of
:class:`megatron_core.ssm.mamba_context_parallel.MambaContextParallel` (``self.cp``). Parameter names, shapes and the
sharded checkpoint keys are Megatron-Core 0.19's. Under the dynamic inference context each request's states
live in a slot of the context's Mamba state cache (:func:`megatron_core.ssm.mamba_inference.mixer_inference`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron_core._ground import get_pg_rank
from megatron_core.device import get_current_device
from megatron_core.dist_checkpointing.sharded_module import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from megatron_core.process_groups_config import check_parallel_size, resolve_pg_collection
from megatron_core.ssm.causal_conv1d import causal_conv1d_silu
from megatron_core.ssm.mamba_context_parallel import MambaContextParallel
from megatron_core.ssm.mamba_inference import mixer_inference
from megatron_core.ssm.ssd_scan import ssd_chunk_scan
from megatron_core.ssm.ssd_scan_triton import ssd_chunk_scan_triton, ssd_scan_triton_supported
from megatron_core.ssm.utils import _split_tensor_factory
from megatron_core.tensor_parallel import get_cuda_rng_tracker
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["ExtendedRMSNorm", "MambaMixer", "MambaMixerSubmodules"]


class ExtendedRMSNorm(nn.Module):
    """Gated RMSNorm over groups: ``weight * rms_norm_per_group(x * silu(z))`` (``norm_before_gate=False``).

    With ``norm_before_gate=True`` the gate is applied after the normalisation instead. Its weight is
    TP-sharded along dim 0 in the checkpoint.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = False, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.group_size = group_size or hidden_size
        if hidden_size % self.group_size != 0:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by group_size ({self.group_size})")
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.tp_group = None

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """Normalise ``x`` (last dim ``hidden_size``), gated by ``silu(z)`` when ``z`` is given."""
        dtype = x.dtype
        h = x.float()
        if z is not None and not self.norm_before_gate:
            h = h * F.silu(z.float())
        grouped = h.reshape(*h.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        h = grouped.reshape(h.shape)
        if z is not None and self.norm_before_gate:
            h = h * F.silu(z.float())
        return (h * self.weight.float()).to(dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict[str, Any]:
        """The weight, TP-sharded along dim 0."""
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets,
                                                   tp_group=self.tp_group,
                                                   dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"])


@dataclass
class MambaMixerSubmodules:
    """Specs of the mixer's input (column-parallel) and output (row-parallel) projections."""

    in_proj: ModuleSpec | type | None = None
    out_proj: ModuleSpec | type | None = None


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _init_rng(config: TransformerConfig) -> Any:
    """Where the mixer's own parameters draw their initial values, as the tensor-parallel linears do.

    With ``use_cpu_initialization`` (or no initialization) the default generator fills full-size tensors
    that every rank then slices, so the values do not depend on the TP size or on any RNG-tracker state
    (a tracker seeded for an earlier, since destroyed, model-parallel setup survives
    ``destroy_model_parallel``). Otherwise each rank draws its shard from the tracker's model-parallel
    stream (Megatron-Core's behaviour; it raises if ``model_parallel_cuda_manual_seed`` was not called).
    """
    if config.use_cpu_initialization or not config.perform_initialization:
        return contextlib.nullcontext()
    return get_cuda_rng_tracker().fork()


def _local_rows(full: torch.Tensor, sections: list[int], tp_size: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's rows of ``full``: its chunk of each stacked section along dim 0."""
    return torch.cat([part.chunk(tp_size, dim=0)[tp_rank] for part in full.split(sections, dim=0)], dim=0)


def _mark_tp(param: nn.Parameter) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = 0


class MambaMixer(MegatronModule):
    """Mamba-2 mixer over ``[s, b, h]`` inputs; ``forward`` returns ``(out, out_bias)`` like a row-parallel linear.

    Sizes come from the config: ``mamba_state_dim`` (n), ``mamba_head_dim`` (p), ``mamba_num_groups`` (g)
    and ``mamba_num_heads`` (else ``expand * d_model / p``). Heads and groups are split over the
    tensor-parallel group, which must divide both; the context-parallel group (``pg_collection.cp``) then
    splits each TP rank's heads for the scan (see :class:`MambaContextParallel` for the divisibility rules).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MambaMixerSubmodules,
        d_model: int,
        d_conv: int = 4,
        conv_init: float | None = None,
        expand: int = 2,
        A_init_range: tuple[float, float] = (1, 16),
        D_has_hdim: bool = False,
        rmsnorm: bool = True,
        norm_before_gate: bool = False,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init: str = "random",
        dt_scale: float = 1.0,
        dt_init_floor: float = 1e-4,
        bias: bool = False,
        conv_bias: bool = True,
        chunk_size: int = 128,
        layer_number: int | None = None,
        pg_collection: Any = None,
        pp_layer_offset: int = 0,
        name: str | None = None,
    ) -> None:
        super().__init__(config)
        self.pg_collection = pg_collection = resolve_pg_collection(pg_collection)
        self.tp_group = pg_collection.tp
        self.d_model, self.d_conv, self.conv_init, self.expand = d_model, d_conv, conv_init, expand
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.chunk_size, self.layer_number, self.pp_layer_offset = chunk_size, layer_number, pp_layer_offset
        self.use_mem_eff_path = config.use_mamba_mem_eff_path
        self.d_state = config.mamba_state_dim
        self.headdim = config.mamba_head_dim
        self.ngroups = config.mamba_num_groups
        for field_name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups"):
            value = getattr(config, field_name)
            _require(value is not None and value > 0, f"config.{field_name} ({value}) must be a positive integer")
        _require(chunk_size > 0, f"chunk_size ({chunk_size}) must be positive")
        _require(d_conv > 0, f"d_conv ({d_conv}) must be positive")
        _require(not bias, f"bias={bias}: the Mamba mixer's projections have no bias (as in Megatron-Core)")
        _require(conv_bias, f"conv_bias={conv_bias}: the Mamba mixer's convolution always has a bias")
        _require(not norm_before_gate, f"norm_before_gate={norm_before_gate}: only the gate-then-norm order "
                                       "(False) is supported, as in Megatron-Core")
        if config.mamba_num_heads is not None:
            _require(config.mamba_num_heads > 0, f"config.mamba_num_heads ({config.mamba_num_heads}) must be positive")
            self.nheads = config.mamba_num_heads
            self.d_inner = self.nheads * self.headdim
        else:
            self.d_inner = int(expand * d_model)
            _require(self.d_inner % self.headdim == 0,
                     f"d_inner = expand * d_model ({expand} * {d_model} = {self.d_inner}) must be divisible by "
                     f"config.mamba_head_dim ({self.headdim})")
            self.nheads = self.d_inner // self.headdim
        tp_size = check_parallel_size(config, "tensor_model_parallel_size", self.tp_group, "tensor-parallel")
        check_parallel_size(config, "context_parallel_size", pg_collection.cp, "context-parallel")
        _require(self.nheads % tp_size == 0,
                 f"the number of Mamba heads ({self.nheads}) must be divisible by the tensor-parallel size ({tp_size})")
        _require(self.ngroups % tp_size == 0,
                 f"config.mamba_num_groups ({self.ngroups}) must be divisible by the tensor-parallel size ({tp_size})")
        _require(self.nheads % self.ngroups == 0,
                 f"the number of Mamba heads ({self.nheads}) must be divisible by config.mamba_num_groups "
                 f"({self.ngroups})")
        self.nheads_local_tp = self.nheads // tp_size
        self.d_inner_local_tp = self.d_inner // tp_size
        self.ngroups_local_tp = self.ngroups // tp_size

        self.in_proj = build_module(
            submodules.in_proj, self.d_model, self.d_inner * 2 + 2 * self.ngroups * self.d_state + self.nheads,
            config=config, init_method=config.init_method, gather_output=False, bias=bias, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="fc1", tp_group=self.tp_group,
            name=f"{name}.in_proj" if name is not None else None,
        )
        self.in_proj.weight.partition_sizes = self._in_proj_sections()

        device = torch.device("cpu") if config.use_cpu_initialization else get_current_device()
        bc_local = self.ngroups_local_tp * self.d_state
        conv_sections = [self.d_inner_local_tp, bc_local, bc_local]
        # Full-size draws sliced per rank under CPU initialization, this rank's shard otherwise.
        full = config.use_cpu_initialization and config.perform_initialization
        draw_tp, tp_rank = (tp_size, get_pg_rank(self.tp_group)) if full else (1, 0)
        _require(A_init_range[0] > 0 and A_init_range[1] >= A_init_range[0],
                 f"A_init_range ({A_init_range}) must satisfy 0 < low <= high")
        with _init_rng(config), torch.no_grad():
            conv_weight = torch.empty(sum(conv_sections) * draw_tp, 1, d_conv, device=device,
                                      dtype=config.params_dtype)
            conv_bias = torch.empty(sum(conv_sections) * draw_tp, device=device, dtype=config.params_dtype)
            # nn.Conv1d's default init, then the optional re-init of the weight (Megatron-Core's order).
            nn.init.kaiming_uniform_(conv_weight, a=math.sqrt(5))
            bound = 1 / math.sqrt(d_conv)
            nn.init.uniform_(conv_bias, -bound, bound)
            if config.perform_initialization:
                if conv_init is not None:
                    nn.init.uniform_(conv_weight, -conv_init, conv_init)
                else:
                    nn.init.kaiming_uniform_(conv_weight, a=math.sqrt(5))
            # dt_bias: softplus(dt_bias) is log-uniform in [dt_min, dt_max] (floored).
            dt = torch.exp(torch.rand(self.nheads_local_tp * draw_tp, device=device, dtype=config.params_dtype)
                           * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=dt_init_floor)
            inv_dt = dt + torch.log(-torch.expm1(-dt))
            A = torch.empty(self.nheads_local_tp * draw_tp, dtype=torch.float32, device=device)
            if config.perform_initialization:
                A.uniform_(*A_init_range)
            else:
                A.fill_(1.0)
        global_sections = [size * draw_tp for size in conv_sections]
        self.conv1d_weight = nn.Parameter(_local_rows(conv_weight, global_sections, draw_tp, tp_rank))
        self.conv1d_bias = nn.Parameter(_local_rows(conv_bias, global_sections, draw_tp, tp_rank))
        for param in (self.conv1d_weight, self.conv1d_bias):
            _mark_tp(param)
            param.partition_sizes = conv_sections
        inv_dt = inv_dt.chunk(draw_tp)[tp_rank].clone()
        A = A.chunk(draw_tp)[tp_rank].clone()
        self.dt_bias = nn.Parameter(inv_dt)
        self.A_log = nn.Parameter(torch.log(A))  # kept in fp32
        self.D = nn.Parameter(torch.ones(self.d_inner_local_tp if D_has_hdim else self.nheads_local_tp,
                                         device=device))  # kept in fp32
        for param in (self.dt_bias, self.A_log, self.D):
            _mark_tp(param)
        self.activation = "silu"
        self.act = nn.SiLU()
        if rmsnorm:
            self.norm = ExtendedRMSNorm(self.d_inner_local_tp, eps=1e-5,
                                        group_size=self.d_inner_local_tp // self.ngroups_local_tp,
                                        norm_before_gate=norm_before_gate, device=device, dtype=config.params_dtype)
            _mark_tp(self.norm.weight)
            self.norm.tp_group = self.tp_group
        self.out_proj = build_module(
            submodules.out_proj, self.d_inner, self.d_model, config=config,
            init_method=config.output_layer_init_method, bias=bias, input_is_parallel=True, skip_bias_add=True,
            is_expert=False, tp_comm_buffer_name="fc2", tp_group=self.tp_group,
            name=f"{name}.out_proj" if name is not None else None,
        )
        # Every CP rank holds this TP rank's whole conv1d, dt_bias, A_log and D and uses its heads' slice.
        self.cp = MambaContextParallel(
            cp_group=pg_collection.cp, d_inner_local_tp=self.d_inner_local_tp, nheads_local_tp=self.nheads_local_tp,
            ngroups_local_tp=self.ngroups_local_tp, d_state=self.d_state, conv1d_weight_cp1=self.conv1d_weight,
            conv1d_bias_cp1=self.conv1d_bias, conv1d_padding=d_conv - 1, dt_bias_cp1=self.dt_bias,
            A_log_cp1=self.A_log, D_cp1=self.D, D_has_hdim=D_has_hdim,
        )

    def _in_proj_sections(self) -> list[int]:
        """Local sizes of ``z, x, B, C, dt`` along ``in_proj``'s output dimension."""
        bc = self.ngroups_local_tp * self.d_state
        return [self.d_inner_local_tp, self.d_inner_local_tp, bc, bc, self.nheads_local_tp]

    def mamba_state_shapes_per_request(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of one sequence's convolution state and SSM state on this TP rank."""
        return (self.conv1d_weight.shape[0], self.d_conv), (self.nheads_local_tp, self.headdim, self.d_state)

    def forward(self, hidden_states: torch.Tensor, inference_context: Any = None, *,
                inference_params: Any = None, packed_seq_params: Any = None) -> tuple[torch.Tensor, Any]:
        """``hidden_states`` ``[s, b, d_model]`` (sequence-split under sequence parallelism) -> ``(out, bias)``."""
        inference_context = inference_context if inference_context is not None else inference_params
        if inference_context is not None:  # the dynamic engine's per-request state slots (ssm.mamba_inference)
            if not hasattr(inference_context, "mamba_states_cache"):
                raise NotImplementedError(f"MambaMixer: inference under {type(inference_context).__name__} is not "
                                          "supported; hybrid models are served by the dynamic engine")
            return self.out_proj(mixer_inference(self, self.in_proj(hidden_states)[0], inference_context))
        if packed_seq_params is not None:
            raise NotImplementedError("MambaMixer: packed sequences (packed_seq_params) are not supported "
                                      "by this library")
        zxBCdt, _ = self.in_proj(hidden_states)
        zxBCdt = self.cp.pre_conv_ssm(zxBCdt, packed_seq_params)
        y = self._ssm_training(zxBCdt)
        return self.out_proj(y)

    def _ssm_training(self, zxBCdt: torch.Tensor) -> torch.Tensor:
        """Convolution, SSD scan, gate and norm on ``[l, b, .]`` (this CP rank's heads over the whole sequence);
        returns ``[l / cp, b, d_inner local]`` (this CP rank's part of the sequence, all heads of this TP rank)."""
        cp = self.cp
        length, batch, _ = zxBCdt.shape
        d_inner, ngroups, nheads = cp.d_inner_local_tpcp, cp.ngroups_local_tpcp, cp.nheads_local_tpcp
        bc = ngroups * self.d_state
        z, x, B, C, dt = torch.split(zxBCdt.transpose(0, 1), [d_inner, d_inner, bc, bc, nheads], dim=-1)
        # The mixer's current parameters are sliced (not the references cp keeps), so wrappers that swap them work.
        xBC = causal_conv1d_silu(torch.cat([x, B, C], dim=-1), cp._slice_conv_param(self.conv1d_weight),
                                 cp._slice_conv_param(self.conv1d_bias))
        x, B, C = torch.split(xBC, [d_inner, bc, bc], dim=-1)  # [b, l, *]
        dt = F.softplus(dt.float() + cp._slice_vector_param(self.dt_bias).float())
        A = -torch.exp(cp._slice_vector_param(self.A_log).float())
        D = cp._slice_vector_param(self.D, has_hdim=self.D_has_hdim)
        D = D.float().view(nheads, self.headdim) if self.D_has_hdim else D
        x = x.reshape(batch, length, nheads, self.headdim)
        B = B.reshape(batch, length, ngroups, self.d_state)
        C = C.reshape(batch, length, ngroups, self.d_state)
        if ssd_scan_triton_supported(x) and self.d_state <= 256:
            y = ssd_chunk_scan_triton(x, dt, A, B, C, D=D)
        else:
            y = ssd_chunk_scan(x, dt, A, B, C, self.chunk_size, D=D)
        y = y.reshape(batch, length, d_inner)
        if self.rmsnorm and cp.cp_size == 1:
            return self.norm(y, z).transpose(0, 1).contiguous()
        # The gate is per channel, so it runs on this CP rank's heads; the norm spans a group's heads, which
        # may sit on several CP ranks, so it runs after the all-to-all back.
        y = (y.float() * F.silu(z.float())).to(y.dtype)
        y = cp.post_conv_ssm(y.transpose(0, 1).contiguous())
        return self.norm(y) if self.rmsnorm else y

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict[str, Any]:
        """Megatron-Core's checkpoint layout: ``in_proj.weight`` stored as the TP-independent parts
        ``.z, .x, .B, .C, .dt`` and ``conv1d.weight`` / ``conv1d.bias`` as ``.x, .B, .C`` (each TP rank's
        conv channels are its own x, B and C rows, so unsplit they would only reload at the saving TP size)."""
        own: dict[str, Any] = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        axis_map = {name: 0 for name in ("A_log", "dt_bias", "D", "conv1d_weight", "conv1d_bias")}
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sharded = make_sharded_tensors_for_checkpoint(own, prefix, axis_map, sharded_offsets, tp_group=self.tp_group,
                                                      dp_cp_group=metadata["dp_cp_group"])
        for name, module in self.named_children():
            child_prefix = f"{prefix}{name}."
            if hasattr(module, "sharded_state_dict"):
                sharded.update(module.sharded_state_dict(child_prefix, sharded_offsets, metadata))
            else:
                sharded.update(sharded_state_dict_default(module, child_prefix, sharded_offsets, metadata,
                                                          tp_group=self.tp_group))
        for param_name, key in (("conv1d_weight", "conv1d.weight"), ("conv1d_bias", "conv1d.bias")):
            sharded[f"{prefix}{param_name}"].key = f"{prefix}{key}"
        weight_key = f"{prefix}in_proj.weight"
        sharded[weight_key] = _split_tensor_factory(sharded[weight_key], self._in_proj_sections(),
                                                    ["z", "x", "B", "C", "dt"], 0)
        conv_sections = self._in_proj_sections()[1:4]
        for param_name in ("conv1d_weight", "conv1d_bias"):
            if f"{prefix}{param_name}" in sharded:
                sharded[f"{prefix}{param_name}"] = _split_tensor_factory(sharded[f"{prefix}{param_name}"],
                                                                         conv_sections, ["x", "B", "C"], 0)
        return sharded
