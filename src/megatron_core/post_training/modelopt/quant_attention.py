"""KV-cache quantization: this library's core attention registered with Model Optimizer's quantization.

Model Optimizer's Megatron plugin gives Megatron-Core's core attention three quantizers, ``q_bmm_quantizer``,
``k_bmm_quantizer`` and ``v_bmm_quantizer``, that fake-quantize the query, key and value (after RoPE) before
the attention product; KV-cache configs such as ``mtq.FP8_KV_CFG`` enable the key and value ones
(``*[kv]_bmm_quantizer``). :class:`QuantDotProductAttention` does the same for our
:class:`~megatron_core.transformer.dot_product_attention.DotProductAttention` (the core attention of the local
spec and of ``get_gpt_modelopt_spec(local_core_attention=True)``). :func:`kv_cache_quant_config` merges a
KV-cache config into a weight/activation config the way Megatron-LM's ``--export-kv-cache-quant`` does.

Which ranks agree: each rank holds its TP shard of the heads (and, under context parallelism, its chunk of
the sequence), but a per-tensor K or V scale belongs to the whole tensor. The quantizers' ``ParallelState``
names the data-parallel group with CP and the tensor-parallel group, and Model Optimizer's calibration takes
the maximum of the K and V amax over both, so every shard uses the one-process scale.

The inference engine keeps keys and values in its own cache (``inference.contexts``) and attends there,
without calling the core attention. :class:`QuantSelfAttention` hands the context a wrapper whose
``attention`` quantizes the value before the context stores it and the query and key right after the
context rotates them (the contexts' ``rotate_at_positions`` is swapped for the call, as Model Optimizer
swaps a linear layer's GEMM function), so the cache holds exactly what the core attention would see.
Multi-latent attention attends over its compressed cache instead: with enabled KV quantizers it refuses
the engine (:class:`QuantMLASelfAttention`).

:func:`check_kv_cache_quantized` turns a KV-cache config that reached no key/value quantizer (a core attention
class that is not registered) into an error; :func:`kv_cache_scales`, :func:`hf_kv_cache_tensors` and
:func:`kv_cache_quant_algo` give what Model Optimizer's Megatron export writes for the cache
(``<attention>.k_scale`` / ``v_scale`` and ``kv_cache_quant_algo``).
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_core.device import get_current_device
from megatron_core.dist_checkpointing.sharded_module import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron_core.inference.contexts import dynamic_context, static_context
from megatron_core.inference.contexts.rotary import rotate_at_positions
from megatron_core.post_training.modelopt._backend import modelopt_modules
from megatron_core.post_training.modelopt.quantizer_buffers import view_quantizer_buffers
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.transformer.attention import SelfAttention
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.multi_latent_attention import MLASelfAttention

_mo = modelopt_modules()

__all__ = ["KV_CACHE_QUANT_CFG_CHOICES", "QuantDotProductAttention", "QuantMLASelfAttention", "QuantSelfAttention",
           "check_kv_cache_quantized", "hf_kv_cache_tensors", "kv_cache_quant_algo", "kv_cache_quant_config",
           "kv_cache_scales"]

# Megatron-LM's --export-kv-cache-quant choices -> Model Optimizer's KV-cache config
KV_CACHE_QUANT_CFG_CHOICES = {"fp8": "FP8_KV_CFG", "fp8_affine": "FP8_AFFINE_KV_CFG", "nvfp4": "NVFP4_KV_CFG",
                              "nvfp4_affine": "NVFP4_AFFINE_KV_CFG", "nvfp4_rotate": "NVFP4_KV_ROTATE_CFG"}
_BMM_QUANTIZERS = ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer")
_KV_QUANTIZERS = ("k_bmm_quantizer", "v_bmm_quantizer")
_FP8_MAX = 448.0  # largest E4M3 value: Model Optimizer's FP8 scale is amax / 448
_CONTEXT_MODULES = (static_context, dynamic_context)  # the inference contexts that rotate and cache keys


def _group_or_unused(group: Any) -> Any:
    return -1 if group is None else group


def _tp_group(core_attention: torch.nn.Module) -> Any:
    """The attention's tensor-parallel group: its ``pg_collection``'s, else ``parallel_state``'s (None: size 1)."""
    tp_group = resolve_process_group("tp", pg_collection=getattr(core_attention, "pg_collection", None))
    return resolve_process_group("tp") if tp_group is None else tp_group


def attention_parallel_state(core_attention: torch.nn.Module) -> Any:
    """Model Optimizer's ``ParallelState`` of a core attention: data parallel with CP, and its TP group."""
    return _mo.distributed.ParallelState(_group_or_unused(resolve_process_group("dp_cp")),
                                         tensor_parallel_group=_group_or_unused(_tp_group(core_attention)))


def _enabled(module: torch.nn.Module, names: tuple[str, ...] = _BMM_QUANTIZERS) -> list[Any]:
    quantizers = (getattr(module, name, None) for name in names)
    return [q for q in quantizers if q is not None and q.is_enabled]


@_mo.nn.QuantModuleRegistry.register({DotProductAttention: "megatron_core_DotProductAttention"})
class QuantDotProductAttention(_mo.nn.QuantModule):
    """:class:`DotProductAttention` whose query, key and value pass ``q/k/v_bmm_quantizer`` before attending.

    Inputs are this rank's ``[s, b, heads, head_dim]`` after RoPE. Checkpoints store each quantizer buffer
    (a per-tensor amax) as a replicated ``[1]`` tensor; only scalar states are supported.
    """

    def _setup(self) -> None:
        for name in _BMM_QUANTIZERS:
            setattr(self, name, _mo.nn.TensorQuantizer())
        self._kv_tp_group = _tp_group(self)
        if self.parallel_state is None:
            self.parallel_state = attention_parallel_state(self)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
                ) -> torch.Tensor:
        """``DotProductAttention.forward`` on the fake-quantized query, key and value."""
        return super().forward(self.q_bmm_quantizer(query), self.k_bmm_quantizer(key), self.v_bmm_quantizer(value),
                               *args, **kwargs)

    def _quantizer_buffers(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, value in self.state_dict(prefix="", keep_vars=True).items():
            if name.split(".", 1)[0] not in _BMM_QUANTIZERS:
                continue
            if value.numel() != 1:
                raise NotImplementedError(f"{name} of {type(self).__name__} holds {value.numel()} values; only "
                                          "per-tensor (scalar) KV-cache quantizer states can be checkpointed")
            out[name] = value.reshape(1)
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The attention's sharded state with each quantizer buffer replicated as ``[1]`` (equal on every rank)."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        buffers = self._quantizer_buffers()
        for name in buffers:
            sharded.pop(f"{prefix}{name}", None)
        sharded.update(make_sharded_tensors_for_checkpoint(
            buffers, prefix, {}, sharded_offsets, tp_group=self._kv_tp_group,
            dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"]))
        return sharded

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        """Quantizer buffers come back as ``[1]``: view them in the quantizers' own shapes."""
        view_quantizer_buffers(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def modelopt_post_restore(self, prefix: str = "") -> None:
        """After ``restore_from_modelopt_state``: scalar states only, on the module's (or the current) device."""
        self._quantizer_buffers()
        own = [t for name, t in self.state_dict(keep_vars=True).items() if name.split(".", 1)[0] not in _BMM_QUANTIZERS]
        device = own[0].device if own else getattr(self, "_kv_quantizer_device", None) or get_current_device()
        for name in _BMM_QUANTIZERS:
            getattr(self, name).to(device)


@contextmanager
def _quantize_after_rotation(core_attention: torch.nn.Module) -> Iterator[None]:
    """The inference contexts' ``rotate_at_positions`` followed by the query and key quantizers, inside."""

    def rotate_and_quantize(query: torch.Tensor, key: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        query, key = rotate_at_positions(query, key, *args)
        return core_attention.q_bmm_quantizer(query), core_attention.k_bmm_quantizer(key)

    for module in _CONTEXT_MODULES:
        module.rotate_at_positions = rotate_and_quantize
    try:
        yield
    finally:
        for module in _CONTEXT_MODULES:
            module.rotate_at_positions = rotate_at_positions


class _KVQuantizingContext:
    """An inference context whose ``attention`` caches and attends over fake-quantized keys and values."""

    def __init__(self, context: Any, core_attention: torch.nn.Module) -> None:
        self._context = context
        self._core_attention = core_attention

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def attention(self, attention: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  rotary_pos_emb: Any) -> torch.Tensor:
        """The context's attention with the value quantized first and the query and key after their rotation."""
        with _quantize_after_rotation(self._core_attention):
            return self._context.attention(attention, query, key, self._core_attention.v_bmm_quantizer(value),
                                           rotary_pos_emb)


def _inference_context(args: tuple, kwargs: dict) -> tuple[Any, str | int | None]:
    """``(context, where)`` of an attention forward's call: a keyword's name, argument 3, or ``(None, None)``."""
    for key in ("inference_context", "inference_params"):
        if kwargs.get(key) is not None:
            return kwargs[key], key
    return (args[3], 3) if len(args) > 3 and args[3] is not None else (None, None)


class _AttentionOfQuantCore(_mo.dynamic.DynamicModule):
    """An attention layer around a quantized core attention: no quantizer of its own."""

    def _setup(self) -> None:
        """Tell the core attention (converted after its parent) the device of the layer's weights, where its
        quantizer states go when Model Optimizer restores them (the core attention usually has no weight)."""
        param = next(self.parameters(), None)
        if param is not None:
            self.core_attention._kv_quantizer_device = param.device


@_mo.nn.QuantModuleRegistry.register({SelfAttention: "megatron_core_SelfAttention"})
class QuantSelfAttention(_AttentionOfQuantCore):
    """:class:`SelfAttention` that keeps its core attention's KV-cache quantization in the inference engine."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``SelfAttention.forward``; with an inference context and enabled bmm quantizers, see the module docstring."""
        context, where = _inference_context(args, kwargs)
        if context is None or not _enabled(self.core_attention):
            return super().forward(*args, **kwargs)
        wrapped = _KVQuantizingContext(context, self.core_attention)
        if where == 3:
            args = (*args[:3], wrapped, *args[4:])
        else:
            kwargs = {**kwargs, where: wrapped}
        return super().forward(*args, **kwargs)


@_mo.nn.QuantModuleRegistry.register({MLASelfAttention: "megatron_core_MLASelfAttention"})
class QuantMLASelfAttention(_AttentionOfQuantCore):
    """:class:`MLASelfAttention` that refuses the inference engine when its core attention quantizes the cache."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``MLASelfAttention.forward``; ``NotImplementedError`` with an inference context and enabled bmm quantizers."""
        context, _ = _inference_context(args, kwargs)
        if context is not None and _enabled(self.core_attention):
            raise NotImplementedError(
                "KV-cache quantization of multi-latent attention in the inference engine: the engine caches the "
                "compressed latents, not the keys and values the core attention's k/v_bmm_quantizer were calibrated "
                "on; disable them ({'quantizer_name': '*bmm_quantizer', 'enable': False}) for inference")
        return super().forward(*args, **kwargs)


def kv_cache_quant_config(config: dict, kv_cache_quant: str) -> dict:
    """``config`` (a Model Optimizer quantization config) with the KV-cache config ``kv_cache_quant`` merged in.

    ``kv_cache_quant`` is one of Megatron-LM's ``--export-kv-cache-quant`` choices
    (:data:`KV_CACHE_QUANT_CFG_CHOICES`); its entries are appended after ``config``'s, as Megatron-LM does with
    Model Optimizer's ``update_quant_cfg_with_kv_cache_quant``. ``config`` is not changed.
    """
    if kv_cache_quant not in KV_CACHE_QUANT_CFG_CHOICES:
        raise ValueError(f"kv_cache_quant ({kv_cache_quant!r}) must be one of {sorted(KV_CACHE_QUANT_CFG_CHOICES)}")
    mtq = _mo.mtq
    kv_cfg = getattr(mtq, KV_CACHE_QUANT_CFG_CHOICES[kv_cache_quant])["quant_cfg"]
    config = copy.deepcopy(config)
    if isinstance(config.get("quant_cfg"), dict):
        config["quant_cfg"] = mtq.normalize_quant_cfg_list(config["quant_cfg"])
    return mtq.utils.update_quant_cfg_with_kv_cache_quant(config, kv_cfg)


def _requested(entries: list[dict], name: str) -> bool:
    """Whether the ordered config ``entries`` leave the quantizer ``name`` enabled (later entries win)."""
    enabled = False
    for entry in entries:
        if entry.get("parent_class") is None and fnmatch.fnmatch(name, entry["quantizer_name"]):
            enabled = bool(entry["enable"])
    return enabled


def _core_attentions(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    for name, module in model.named_modules():
        core = getattr(module, "core_attention", None)
        if isinstance(core, torch.nn.Module):
            yield (f"{name}.core_attention" if name else "core_attention"), core


def check_kv_cache_quantized(model: torch.nn.Module) -> None:
    """``ValueError`` when ``model``'s quantization config asks for K/V quantizers that its attention lacks or left
    uncalibrated.

    The config is the one recorded by ``mtq.quantize``. A core attention whose class is not registered with
    Model Optimizer (registered here: ``DotProductAttention``) has no ``k_bmm_quantizer``; a KV-cache config
    then matches nothing, which Model Optimizer does not report.
    """
    mo = _mo
    if not mo.mto.ModeloptStateManager.is_converted(model):
        raise ValueError(f"{type(model).__name__} is not quantized by Model Optimizer: nothing to check")
    state = dict(mo.mto.modelopt_state(model)["modelopt_state_dict"])
    quant_cfg = (state.get("quantize", {}).get("config") or {}).get("quant_cfg") or []
    entries = mo.mtq.normalize_quant_cfg_list(quant_cfg)
    unregistered, uncalibrated = [], []
    for name, core in _core_attentions(model):
        for quantizer in _KV_QUANTIZERS:
            if not _requested(entries, f"{name}.{quantizer}"):
                continue
            found = getattr(core, quantizer, None)
            if found is None:
                unregistered.append(f"{name} ({type(core).__name__})")
                break
            if found.is_enabled and found.amax is None:
                uncalibrated.append(f"{name}.{quantizer}")
    if unregistered:
        raise ValueError(
            f"the quantization config enables KV-cache quantizers (*[kv]_bmm_quantizer), but {len(unregistered)} core "
            f"attention modules have none: {', '.join(sorted(set(unregistered)))}; their class is not registered with "
            "Model Optimizer (registered: DotProductAttention, via register_quant_modules()); build the model with "
            "get_gpt_modelopt_spec(config, local_core_attention=True) or the local spec")
    if uncalibrated:
        raise ValueError(f"{len(uncalibrated)} KV-cache quantizers hold no calibrated amax (did the forward_loop "
                         f"run any batch?): {', '.join(uncalibrated[:8])}" + (" ..." if len(uncalibrated) > 8 else ""))


def kv_cache_quant_algo(model: torch.nn.Module) -> str | None:
    """The cache format for ``hf_quant_config.json``'s ``kv_cache_quant_algo``: ``"FP8"``, or ``None`` (unquantized).

    ``ValueError`` for other formats (NVFP4, INT8 or affine caches are not exported here) or for layers that
    disagree.
    """
    formats = set()
    for name, core in _core_attentions(model):
        for quantizer in _enabled(core, _KV_QUANTIZERS):
            if quantizer.num_bits != (4, 3) or hasattr(quantizer, "_bias_value") or quantizer.block_sizes:
                raise ValueError(f"{name}: KV-cache quantizer with num_bits={quantizer.num_bits}, "
                                 f"block_sizes={quantizer.block_sizes}; only per-tensor FP8 (E4M3) caches are exported")
            formats.add("FP8")
    return formats.pop() if formats else None


def kv_cache_scales(model: torch.nn.Module, clamp_fp8_scales: bool = True
                    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{core attention name: (k_scale, v_scale)}`` of this rank's layers with an FP8 KV cache (float32 scalars).

    The scale is ``amax / 448``, raised to at least 1.0 with ``clamp_fp8_scales`` (Model Optimizer's Megatron
    export default ``clamp_kv_cache_scales=True``). Equal on every TP and DP rank after calibration.
    """
    kv_cache_quant_algo(model)  # refuses formats other than FP8
    out = {}
    for name, core in _core_attentions(model):
        quantizers = _enabled(core, _KV_QUANTIZERS)
        if len(quantizers) != len(_KV_QUANTIZERS):
            continue
        scales = []
        for quantizer in quantizers:
            if quantizer.amax is None:
                raise ValueError(f"{name}: its KV-cache quantizers are not calibrated")
            scale = quantizer.amax.detach().float().reshape(()) / _FP8_MAX
            scales.append(scale.clamp(min=1.0) if clamp_fp8_scales else scale)
        out[name] = (scales[0], scales[1])
    return out


def hf_kv_cache_tensors(bridge: Any, model: torch.nn.Module, pg_collection: Any = None,
                        clamp_fp8_scales: bool = True) -> dict[str, torch.Tensor]:
    """The KV-cache tensors of this rank's layers under their Hugging Face names, as Model Optimizer exports them.

    ``<HF attention>.k_scale`` and ``.v_scale`` (for Llama ``model.layers.<i>.self_attn.k_scale``), where the
    HF attention is the module holding the bridge's name of the layer's ``linear_proj`` (``o_proj``).
    """
    out = {}
    for name, (k_scale, v_scale) in kv_cache_scales(model, clamp_fp8_scales).items():
        proj = name.removesuffix("core_attention") + "linear_proj.weight"
        rule, layer = bridge.rule_for(model, proj, pg_collection)
        hf_attention = rule.hf_names(layer)[0].rsplit(".", 2)[0]
        out[f"{hf_attention}.k_scale"], out[f"{hf_attention}.v_scale"] = k_scale, v_scale
    return out
