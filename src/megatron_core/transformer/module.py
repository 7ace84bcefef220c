"""``MegatronModule`` (the base of every model part) and ``Float16Module`` (the bf16/fp16 wrapper).

``Float16Module`` casts its wrapped module's parameters to bf16/fp16 once, casts floating inputs
on the first pipeline stage, and returns fp32 outputs on the last stage, as Megatron-Core does.
``MegatronModule.sharded_state_dict`` describes a module generically (its own tensors from their
tensor-parallel attributes, then each child); a module with its own checkpoint layout (``MLP``,
``LanguageModule``, ``TransformerBlock``) overrides it. ``GraphableMegatronModule`` is the base of the modules CUDA
graphs can record (``TransformerLayer``, ``MambaLayer``, ``TransformerBlock``, ``HybridModel``), as in
Megatron-Core 0.19.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_core import parallel_state
from megatron_core._ground import get_pg_rank, get_pg_size, register_wrapper
from megatron_core._wrapped_model import submodules_with_attribute
from megatron_core.device import get_current_device
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.process_groups_config import resolve_pg_collection, resolve_process_group
from megatron_core.transformer.transformer_config import TransformerConfig
from megatron_core.transformer.utils import sharded_state_dict_default

__all__ = ["Float16Module", "GraphableMegatronModule", "MegatronModule", "conversion_helper", "float16_to_fp32",
           "fp32_to_float16", "param_is_not_shared"]


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """False for the duplicate of a tied weight (``param.shared``), counted on the stage that owns it."""
    return not getattr(param, "shared", False)


class MegatronModule(torch.nn.Module):
    """A ``torch.nn.Module`` that holds its ``config`` and knows how to describe its sharded state."""

    def __init__(self, config: ModelParallelConfig) -> None:
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The plain ``state_dict`` (kept for Megatron-LM compatibility)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """The state dict with each tensor described by its global shape and this rank's shard."""
        return sharded_state_dict_default(self, prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)

    def set_is_first_microbatch(self) -> None:
        """Tell every submodule that the next forward is the first microbatch (quantized weight caches refresh).

        Only when a quantization mode is configured (``fp8``, ``fp4``, ``use_kitchen`` or ``quant_recipe``), as in
        Megatron-Core: otherwise no module keeps such a cache and the flags are left alone.
        """
        config = self.config
        if (getattr(config, "fp8", None) is None and getattr(config, "fp4", None) is None
                and not getattr(config, "use_kitchen", False) and getattr(config, "quant_recipe", None) is None):
            return
        for module in submodules_with_attribute(self, "is_first_microbatch"):
            module.is_first_microbatch = True
            allocate_caches = getattr(module, "allocate_weight_caches", None)
            if allocate_caches is not None:  # FP8 layers keep their weights' transposes for the step
                allocate_caches()


class GraphableMegatronModule(MegatronModule):
    """A module that CUDA graphs can record and replay: Megatron-Core 0.19's base of ``TransformerLayer``,
    ``MambaLayer``, ``TransformerBlock`` and ``HybridModel``.

    With ``cuda_graph_impl='local'`` a ``TransformerLayer`` runs through its recorded graphs
    (:mod:`megatron_core.transformer.layer_cuda_graphs`) where :meth:`_should_call_local_cudagraph` says so; the other
    graphable modules run as any module. Transformer Engine's graphed callables (``'transformer_engine'``) are
    refused by the config, so their capture and replay methods are not here.
    """

    def __init__(self, config: ModelParallelConfig, vp_stage: int | None = None) -> None:
        """``vp_stage`` is taken as Megatron-Core's signature has it; nothing here depends on it."""
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"{type(self).__name__} needs a TransformerConfig, got {type(config).__name__}")
        super().__init__(config)
        # Forward pre-hooks a graph replay does not run, called by hand before it (``setup_manual_hooks``).
        self.cuda_graph_manual_hooks: list[tuple[Callable[..., Any], tuple[torch.nn.Module, ...]]] = []

    def _should_call_local_cudagraph(self, *args: Any, **kwargs: Any) -> bool:
        """Whether this call runs through the module's recorded CUDA graphs (``TransformerLayer`` decides; False
        here)."""
        return False

    def get_layer_static_inputs(self, seq_length: int, micro_batch_size: int) -> dict[str, torch.Tensor]:
        """``{"hidden_states": ones}`` of the shape this module sees, ``[s, b, h]`` with ``s`` the sequence divided by
        the context-parallel size (and by the tensor-parallel size with ``sequence_parallel``), both from the
        module's process groups, in ``params_dtype`` on the current device, requiring grad (a graph capture's
        static input). Override it for a module with other inputs."""
        groups = getattr(self, "pg_collection", None) or resolve_pg_collection(None)
        tokens = seq_length // get_pg_size(getattr(groups, "cp", None))
        if self.config.sequence_parallel:
            tokens //= get_pg_size(getattr(groups, "tp", None))
        hidden = torch.ones(tokens, micro_batch_size, self.config.hidden_size, dtype=self.config.params_dtype,
                            device=get_current_device(), requires_grad=True)
        return {"hidden_states": hidden}

    def setup_manual_hooks(self, make_hook_func: Callable[[], Callable[..., Any]]) -> None:
        """Set ``cuda_graph_manual_hooks``: one hook from ``make_hook_func()`` for each module under the graphs
        (:meth:`_get_submodules_under_cudagraphs`) that holds parameters of its own, whose forward pre-hooks a
        replay would skip."""
        owners: dict[int, torch.nn.Module] = {}
        for submodule in self._get_submodules_under_cudagraphs():
            for module in submodule.modules():
                if next(module.parameters(recurse=False), None) is not None:
                    owners[id(module)] = module
        self.cuda_graph_manual_hooks = [(make_hook_func(), (module,)) for module in owners.values()]

    def _get_submodules_under_cudagraphs(self) -> list[torch.nn.Module]:
        """The submodules the graphs cover: the whole module."""
        return [self]


def conversion_helper(val: Any, conversion: Callable[[Any], Any]) -> Any:
    """``conversion`` applied to ``val``, or to every element of nested tuples/lists (their types kept)."""
    if not isinstance(val, (tuple, list)):
        return conversion(val)
    converted = [conversion_helper(v, conversion) for v in val]
    return tuple(converted) if isinstance(val, tuple) else converted


def _tensor_dtype(val: Any) -> torch.dtype | None:
    return val.dtype if isinstance(val, torch.Tensor) else None


def fp32_to_float16(val: Any, float16_convertor: Callable[[torch.Tensor], Any]) -> Any:
    """``float16_convertor`` applied to every fp32 tensor in ``val`` (a tensor or nested tuples/lists); other
    values as they are (Megatron-Core's input cast of ``Float16Module``)."""
    return conversion_helper(val, lambda v: float16_convertor(v) if _tensor_dtype(v) == torch.float32 else v)


def float16_to_fp32(val: Any) -> Any:
    """Every fp16/bf16 tensor in ``val`` (a tensor or nested tuples/lists) as fp32; other values as they are."""
    return conversion_helper(val, lambda v: v.float() if _tensor_dtype(v) in (torch.float16, torch.bfloat16) else v)


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


@register_wrapper
class Float16Module(MegatronModule):
    """Runs ``module`` in bf16 (``config.bf16``) or fp16 (``config.fp16``); outputs fp32 on the last stage."""

    def __init__(self, config: ModelParallelConfig, module: torch.nn.Module) -> None:
        super().__init__(config)
        if config.bf16:
            self.dtype = torch.bfloat16
        elif config.fp16:
            self.dtype = torch.float16
        else:
            raise ValueError("Float16Module needs config.fp16=True or config.bf16=True (both are False)")
        self.add_module("module", module.to(self.dtype))
        self.vp_stage = getattr(module, "vp_stage", None)
        self.vp_size = getattr(config, "virtual_pipeline_model_parallel_size", None)
        self.pg_collection = getattr(module, "pg_collection", None)

    def _pipeline_ends(self) -> tuple[bool, bool]:
        """(first, last): whether this chunk is the first / last of the whole pipeline (group of the module)."""
        pp_group = resolve_process_group("pp", self.pg_collection)
        rank, size = get_pg_rank(pp_group), get_pg_size(pp_group)
        vp_stage = self.vp_stage
        if vp_stage is None and self.vp_size is not None and self.vp_size > 1:
            vp_stage = parallel_state.get_virtual_pipeline_model_parallel_rank()  # set by the schedule
        vp_stage = vp_stage or 0
        vp_last = self.vp_size is None or self.vp_size <= 1 or vp_stage == self.vp_size - 1
        return rank == 0 and vp_stage == 0, rank == size - 1 and vp_last

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Forward the pipeline input to the wrapped module."""
        return self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs: Any, fp32_output: bool = True, **kwargs: Any) -> Any:
        """Cast floating inputs on the first stage, run, and cast outputs to fp32 on the last stage."""
        first, last = self._pipeline_ends()
        if first:
            inputs = _cast_floats(inputs, self.dtype)
            kwargs = _cast_floats(kwargs, self.dtype)
        outputs = self.module(*inputs, **kwargs)
        if fp32_output and last:
            outputs = _cast_floats(outputs, torch.float32)
        return outputs

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict (no ``module.`` prefix), as in Megatron-Core."""
        return self.module.state_dict(*args, **kwargs)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The wrapped module's checkpoint state dict."""
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """The wrapped module's sharded state dict."""
        return self.module.sharded_state_dict(prefix, sharded_offsets, metadata)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Load into the wrapped module."""
        return self.module.load_state_dict(state_dict, strict=strict)
