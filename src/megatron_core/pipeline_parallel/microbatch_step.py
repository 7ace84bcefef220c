"""One microbatch's forward and backward on one model chunk, shared by every schedule.

Megatron-Core's ``forward_step``/``backward_step`` with loss scaling (``1/num_microbatches``,
per-token via ``num_tokens``), ``grad_scale_func``, ``custom_backward`` and
``deallocate_output_tensor``, plus the helpers the schedules share: the P2P tensor shape and the
``no_sync`` switch.

Surprising but deliberate: after a stage sends its output, ``deallocate_output_tensor`` replaces
the output's ``.data`` with a 1-element tensor (only the autograd graph is still needed), so its
backward must go through ``custom_backward``, which skips autograd's shape check on the root.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Variable

from megatron_core import device, parallel_state
from megatron_core._ground import get_pg_size
from megatron_core._wrapped_model import get_attr_wrapped_model
from megatron_core.pipeline_parallel.p2p_communication import resolve_communicator as resolve_communicator
from megatron_core.process_groups_config import resolve_process_group


def deallocate_output_tensor(out: torch.Tensor | None, deallocate_pipeline_outputs: bool = False) -> None:
    """Pseudo-free ``out``: keep its ``grad_fn`` but swap its data for one element.

    Only when ``deallocate_pipeline_outputs``; ``out`` must not be a view of another tensor.
    """
    if out is None or not deallocate_pipeline_outputs:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"deallocate_output_tensor expects a tensor, got {type(out).__name__}")
    if out._base is not None:
        raise ValueError(
            f"cannot deallocate a pipeline output that is a view of another tensor (shape {tuple(out.shape)}); "
            "make the stage's output a fresh tensor (e.g. .contiguous() on a non-view, or .clone())"
        )
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Run the autograd engine from ``output`` with ``grad_output`` without checking their shapes.

    ``torch.autograd.backward`` insists that ``grad_output`` matches ``output``'s shape, which a
    pseudo-freed output no longer has.
    """
    if output.grad_fn is None:
        raise ValueError("custom_backward: the output tensor has no grad_fn (was it computed without autograd?)")
    if grad_output is None:
        if output.numel() != 1:
            raise ValueError(f"implicit gradient needs a scalar output, got shape {tuple(output.shape)}")
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad_output,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def check_first_val_step(first_val_step: bool | None, forward_only: bool, cond: bool) -> bool:
    """Whether this microbatch is the "first" one: ``first_val_step`` may veto it in validation."""
    if first_val_step is not None and forward_only:
        return first_val_step and cond
    return cond


def get_tensor_shapes(
    *, seq_length: int, micro_batch_size: int, decoder_seq_length: int | None, config: Any,
    tp_group: Any = None, cp_group: Any = None,
) -> list[tuple[int, int, int]]:
    """The ``[s, b, h]`` shape of the tensor passed between stages, ``s`` split by CP (and TP under SP)."""
    cp_size = get_pg_size(resolve_process_group("cp", group=cp_group))
    tp_size = get_pg_size(resolve_process_group("tp", group=tp_group))
    if seq_length % cp_size != 0:
        raise ValueError(f"seq_length ({seq_length}) must be divisible by context_parallel_size ({cp_size})")
    seq_length //= cp_size
    if getattr(config, "sequence_parallel", False):
        if seq_length % tp_size != 0:
            raise ValueError(
                f"seq_length / context_parallel_size ({seq_length}) must be divisible by "
                f"tensor_model_parallel_size ({tp_size}) under sequence_parallel"
            )
        seq_length //= tp_size
    hidden_size = getattr(config, "hidden_size", None)
    if hidden_size is None:
        raise ValueError("config.hidden_size is needed to size the tensors sent between pipeline stages")
    return [(seq_length, micro_batch_size, hidden_size)]


def context_parallel_size(pg_collection: Any = None) -> int:
    """CP size from ``pg_collection.cp`` if a collection is given, else from ``parallel_state`` (1 if none)."""
    return get_pg_size(resolve_process_group("cp", pg_collection))


class GradSyncSwitch:
    """Enters ``config.no_sync_func()`` while gradients must not be reduced, exits to allow it."""

    def __init__(self, no_sync_func: Callable[[], Any] | None) -> None:
        self._no_sync_func = no_sync_func or contextlib.nullcontext
        self._context: Any = None

    def disable(self) -> None:
        """Stop gradient reduction (enter the no-sync context) if it is running."""
        if self._context is None:
            self._context = self._no_sync_func()
            self._context.__enter__()

    def enable(self) -> None:
        """Allow gradient reduction again (leave the no-sync context)."""
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def context(self) -> Any:
        """A fresh ``no_sync`` context (the ``no_sync_func`` itself, or a null context without one)."""
        return self._no_sync_func()

    @property
    def disabled(self) -> bool:
        """True while inside the no-sync context."""
        return self._context is not None


def forward_step(
    forward_step_func: Callable,
    data_iterator: Any,
    model: torch.nn.Module,
    num_microbatches: int,
    input_tensor: Any,
    forward_data_store: list,
    config: Any,
    collect_non_loss_data: bool = False,
    checkpoint_activations_microbatch: bool | None = None,
    is_first_microbatch: bool = False,
    current_microbatch: int | None = None,
    is_last_stage: bool = True,
    cp_size: int = 1,
    cp_group_size: int | None = None,
) -> tuple[Any, torch.Tensor]:
    """Forward one microbatch through one chunk; on the last stage apply ``loss_func`` and scale the loss.

    ``cp_group_size`` (Megatron-Core 0.19's name, as the hybrid CP schedule passes it) overrides ``cp_size``.
    Returns ``(output_tensor, num_tokens)``; ``output_tensor`` is a list when ``input_tensor`` is.
    """
    if cp_group_size is not None:
        cp_size = cp_group_size
    timers = getattr(config, "timers", None)
    if timers is not None:
        timers("forward-compute", log_level=2).start()
    if is_first_microbatch:
        _call_if_wrapped_model_has(model, "set_is_first_microbatch")
    unwrap_output = not isinstance(input_tensor, list)
    inputs = [input_tensor] if unwrap_output else input_tensor
    get_attr_wrapped_model(model, "set_input_tensor")(inputs)

    autocast = (
        torch.autocast(device.get_current_device().type, dtype=config.autocast_dtype)
        if getattr(config, "enable_autocast", False)
        else contextlib.nullcontext()
    )
    if getattr(config, "num_moe_experts", None) is not None:
        # Before the forward (Megatron sets it after): a compiled layer may read the scale in its forward.
        _set_moe_aux_loss_scale(config, num_microbatches, cp_size)
    if getattr(config, "mtp_num_layers", None):
        _set_mtp_loss_scale(config, num_microbatches)
    _set_attention_variant_loss_scale(config, num_microbatches, cp_size)
    with autocast:
        if checkpoint_activations_microbatch is None:
            output_tensor, loss_func = forward_step_func(data_iterator, model)
        else:
            output_tensor, loss_func = forward_step_func(data_iterator, model, checkpoint_activations_microbatch)

    num_tokens = torch.tensor(0, dtype=torch.int)
    if is_last_stage:
        if collect_non_loss_data:
            forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
        else:
            output_tensor, num_tokens, logs = _apply_loss_func(loss_func, output_tensor, num_microbatches, config, cp_size)
            forward_data_store.append(logs)
    if timers is not None:
        timers("forward-compute").stop()
    return (output_tensor if unwrap_output else [output_tensor]), num_tokens


def forward_step_calc_loss(
    model: Any,
    output_tensor: Any,
    loss_func: Callable | None,
    config: Any,
    vp_stage: int | None,
    collect_non_loss_data: bool,
    num_microbatches: int,
    forward_data_store: list,
    cp_group_size: int | None = None,
    is_last_stage: bool | None = None,
) -> tuple[Any, torch.Tensor]:
    """The last stage's loss step of Megatron-Core's ``forward_step``; returns ``(output_tensor, num_tokens)``.

    On the last stage: no ``loss_func`` stores ``output_tensor`` as is; otherwise the loss is scaled as in
    :func:`forward_step` and the logging dict stored (``collect_non_loss_data`` stores ``loss_func``'s
    non-loss data). Then the backward scales of the MoE, MTP and attention-variant (DSA indexer) auxiliary
    losses are set. ``cp_group_size`` / ``is_last_stage`` default to ``parallel_state``'s.
    """
    model_vp_stage = getattr(model, "vp_stage", None)
    if vp_stage is not None and model_vp_stage is not None and vp_stage != model_vp_stage:
        raise ValueError(f"vp_stage ({vp_stage}) does not match the model's vp_stage ({model_vp_stage})")
    if cp_group_size is None and is_last_stage is None:
        cp_group_size = parallel_state.get_context_parallel_world_size()
        is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    elif is_last_stage is None or (is_last_stage and cp_group_size is None):
        raise ValueError("forward_step_calc_loss needs is_last_stage, and cp_group_size on the last stage")
    num_tokens = torch.tensor(0, dtype=torch.int)
    if is_last_stage:
        if loss_func is None:
            forward_data_store.append(output_tensor)
        elif collect_non_loss_data:
            forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
        else:
            output_tensor, num_tokens, logs = _apply_loss_func(loss_func, output_tensor, num_microbatches, config,
                                                               cp_group_size)
            forward_data_store.append(logs)
    if getattr(config, "timers", None) is not None:
        config.timers("forward-compute").stop()
    cp_size = cp_group_size if cp_group_size is not None else 1
    if getattr(config, "num_moe_experts", None) is not None:
        _set_moe_aux_loss_scale(config, num_microbatches, cp_size)
    if getattr(config, "mtp_num_layers", None):
        _set_mtp_loss_scale(config, num_microbatches)
    _set_attention_variant_loss_scale(config, num_microbatches, cp_size)
    return output_tensor, num_tokens


def _attention_variant_loss_scale_func(config: Any) -> Callable | None:
    """``config.experimental_attention_variant_loss_scale_func``, else DSA's scaler for the 'dsa' variant."""
    func = getattr(config, "experimental_attention_variant_loss_scale_func", None)
    if func is not None:
        return func
    if getattr(config, "experimental_attention_variant", None) == "dsa":
        # Imported here: the schedules sit below the transformer package.
        from megatron_core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

        return DSAIndexerLossAutoScaler.set_loss_scale
    return None


def _set_attention_variant_loss_scale(config: Any, num_microbatches: int, cp_size: int) -> None:
    """An attention variant's auxiliary loss (DSA's indexer loss) gets the main loss's backward scale times
    ``cp / num_microbatches`` (per token: unscaled), as Megatron-Core's ``forward_step_calc_loss`` sets it."""
    variant_scale_func = _attention_variant_loss_scale_func(config)
    if variant_scale_func is not None:
        scale = _main_loss_backward_scale(config, "_no_own_scale_func")
        per_token = getattr(config, "calculate_per_token_loss", False)
        variant_scale_func(scale if per_token else scale * cp_size / num_microbatches)


def _main_loss_backward_scale(config: Any, own_scale_func: str) -> torch.Tensor:
    """The main loss's backward scale for an auxiliary loss: ``config.<own_scale_func>()``, else
    ``grad_scale_func(1)``, else 1 (Megatron-Core's order)."""
    if getattr(config, own_scale_func, None) is not None:
        return torch.as_tensor(getattr(config, own_scale_func)(), dtype=torch.float32)
    if getattr(config, "grad_scale_func", None) is not None:
        return config.grad_scale_func(torch.ones(1, device=device.get_current_device()))
    return torch.ones(1)


def _set_moe_aux_loss_scale(config: Any, num_microbatches: int, cp_size: int) -> None:
    """MoE aux losses get the main loss's backward scale: ``loss_scale * cp / num_microbatches`` (per token: ``loss_scale``)."""
    # Imported here: the schedules sit below the transformer package and only MoE models need it.
    from megatron_core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    scale = _main_loss_backward_scale(config, "moe_grad_scale_func")
    if not getattr(config, "calculate_per_token_loss", False):
        scale = scale * cp_size / num_microbatches
    MoEAuxLossAutoScaler.set_loss_scale(scale)


def _set_mtp_loss_scale(config: Any, num_microbatches: int) -> None:
    """MTP losses get the main loss's backward scale divided by ``num_microbatches`` (per token: undivided), as
    Megatron-Core's schedules set it (no context-parallel factor, unlike the MoE aux losses)."""
    # Imported here: the schedules sit below the transformer package and only MTP models need it.
    from megatron_core.transformer.multi_token_prediction import MTPLossAutoScaler

    scale = _main_loss_backward_scale(config, "mtp_grad_scale_func")
    if not getattr(config, "calculate_per_token_loss", False):
        scale = scale / num_microbatches
    MTPLossAutoScaler.set_loss_scale(scale)


def _call_if_wrapped_model_has(model: torch.nn.Module, method: str) -> None:
    try:
        func = get_attr_wrapped_model(model, method)
    except RuntimeError:
        return
    func()


def _apply_loss_func(
    loss_func: Callable, output_tensor: Any, num_microbatches: int, config: Any, cp_size: int
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    outputs = loss_func(output_tensor)
    if not isinstance(outputs, (tuple, list)) or len(outputs) not in (2, 3):
        raise ValueError(
            "loss_func must return (loss, logging_dict) or (loss, num_tokens, logging_dict); "
            f"got {type(outputs).__name__} of length {len(outputs) if isinstance(outputs, (tuple, list)) else '-'}"
        )
    if len(outputs) == 3:
        loss, num_tokens, logs = outputs
        num_tokens = torch.as_tensor(num_tokens)
        if not getattr(config, "calculate_per_token_loss", False):
            loss = loss / torch.clamp(num_tokens, min=1).to(loss.device)
            loss = loss / num_microbatches
        return loss, num_tokens.detach(), logs
    loss, logs = outputs
    loss = loss * cp_size / num_microbatches
    return loss, torch.tensor(0, dtype=torch.int), logs


def backward_step(input_tensor: Any, output_tensor: Any, output_tensor_grad: Any, *model_type_and_config: Any,
                  config: Any = None) -> Any:
    """Backpropagate one microbatch through one chunk; returns the gradient of its input (or list).

    Called as Megatron-Core 0.19 does, ``(input_tensor, output_tensor, output_tensor_grad, config)``, or in the
    older form with an (unused) ``model_type`` before ``config``.
    """
    if config is None:
        if len(model_type_and_config) not in (1, 2):
            raise TypeError("backward_step takes (input_tensor, output_tensor, output_tensor_grad, [model_type,] "
                            f"config); got {3 + len(model_type_and_config)} positional arguments")
        config = model_type_and_config[-1]
    timers = getattr(config, "timers", None)
    if timers is not None:
        timers("backward-compute", log_level=2).start()
    unwrap = not isinstance(input_tensor, list)
    inputs = [input_tensor] if unwrap else list(input_tensor)
    outputs = output_tensor if isinstance(output_tensor, list) else [output_tensor]
    grads = output_tensor_grad if isinstance(output_tensor_grad, list) else [output_tensor_grad]
    for tensor in inputs:
        if tensor is not None:
            tensor.retain_grad()
    if grads[0] is None and getattr(config, "grad_scale_func", None) is not None:
        outputs = [config.grad_scale_func(outputs[0]), *outputs[1:]]
    if getattr(config, "deallocate_pipeline_outputs", False):
        custom_backward(outputs[0], grads[0])
    else:
        torch.autograd.backward(outputs[0], grad_tensors=grads[0])
    input_grads = [None if tensor is None else tensor.grad for tensor in inputs]
    if timers is not None:
        timers("backward-compute").stop()
    return input_grads[0] if unwrap else input_grads


def _single(value: Any) -> Any:
    """The tensor of a one-element list (how stages pass a single tensor), or ``value`` itself."""
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(f"a multi-module pipeline passes one tensor per module, got a list of {len(value)}")
        return value[0]
    return value


def backward_step_multimodule(
    input_tensor: dict[str, Any],
    output_tensor: Any,
    output_tensor_grad: dict[str, Any] | None,
    config: Any,
    language_model_module_name: str,
) -> dict[str, torch.Tensor | None]:
    """Backpropagate one microbatch of a multi-module pipeline stage; returns the input gradients by module.

    Tensors travel as dicts keyed by module name (``MultiModulePipelineCommunicator``). On the language
    model's last stage ``output_tensor`` is the loss, filed under ``language_model_module_name``; there
    ``output_tensor_grad`` is empty and ``config.grad_scale_func`` (if any) scales the loss. Every output
    that requires grad is backpropagated (an encoder that saw no inputs in this microbatch has none).
    """
    timers = getattr(config, "timers", None)
    if timers is not None:
        timers("backward-compute", log_level=2).start()
    inputs = {name: _single(tensor) for name, tensor in (input_tensor or {}).items()}
    for tensor in inputs.values():
        if tensor is not None:
            tensor.retain_grad()
    outputs = dict(output_tensor) if isinstance(output_tensor, dict) else {language_model_module_name: output_tensor}
    grads = {name: _single((output_tensor_grad or {}).get(name)) for name in outputs}
    scale = getattr(config, "grad_scale_func", None)
    for name in outputs:
        out = _single(outputs[name])
        if grads[name] is None and scale is not None and out is not None:
            out = scale(out)
        if out is None or not out.requires_grad:
            continue
        if getattr(config, "deallocate_pipeline_outputs", False):
            custom_backward(out, grads[name])
        else:
            torch.autograd.backward(out, grad_tensors=grads[name])
    if timers is not None:
        timers("backward-compute").stop()
    return {name: None if tensor is None else tensor.grad for name, tensor in inputs.items()}


def new_token_counter() -> torch.Tensor:
    """A zero ``int`` scalar on the current device that sums ``num_tokens`` over microbatches."""
    return torch.zeros([], dtype=torch.int, device=device.get_current_device())


def add_token_count(total_num_tokens: torch.Tensor, num_tokens: torch.Tensor) -> None:
    """``total_num_tokens += num_tokens`` without a blocking host-to-device copy.

    A micro-batch's count is a 0-dim CPU tensor unless the loss function returned a device tensor:
    added as it is, PyTorch passes its value to the kernel as a scalar, where ``.to(device)`` would
    copy from pageable memory and wait for the device's queue to drain (once per micro-batch).
    """
    if num_tokens.numel() != 1:
        raise ValueError(f"loss_func returned num_tokens of shape {tuple(num_tokens.shape)}; expected one count")
    num_tokens = num_tokens.reshape(())
    if num_tokens.device.type != "cpu":  # a host scalar adds to any device; a device count must be on total's
        num_tokens = num_tokens.to(total_num_tokens.device)
    total_num_tokens.add_(num_tokens)


def finalize_model_grads_if_set(
    config: Any, model_chunks: list, total_num_tokens: torch.Tensor, pg_collection: Any, force_all_reduce: bool
) -> None:
    """Call ``config.finalize_model_grads_func(model_chunks, num_tokens)`` when it is set.

    ``num_tokens`` is the total only under ``calculate_per_token_loss``; ``pg_collection`` and
    ``force_all_reduce`` are passed only when given, so two-argument user functions keep working.
    """
    func = getattr(config, "finalize_model_grads_func", None)
    if func is None:
        return
    kwargs: dict[str, Any] = {}
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    if force_all_reduce:
        kwargs["force_all_reduce"] = True
    num_tokens = total_num_tokens if getattr(config, "calculate_per_token_loss", False) else None
    func(model_chunks, num_tokens, **kwargs)
