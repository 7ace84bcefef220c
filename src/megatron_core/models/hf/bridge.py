"""``AutoBridge``: a Hugging Face model directory <-> this rank's GPTModel (or HybridModel) shard.

::

    bridge = AutoBridge.from_hf_pretrained("/models/llama-3.2-1b")   # config.json + safetensors
    model = bridge.to_megatron_model()        # list of chunks for this rank's TP/PP(/VPP) shard, weights loaded
    ...                                       # train
    bridge.save_hf_pretrained(model, "/out")  # collective; transformers.AutoModelForCausalLM.from_pretrained("/out")

Parallel sizes and ranks come from the groups of a passed ``pg_collection`` (a role it leaves unset
is one rank), else from ``parallel_state``; without initialised model parallelism everything is one
rank. Each rank reads only the rows/columns of the tensors it holds (safetensors slices,
memory-mapped), never the whole model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

from megatron_core import parallel_state
from megatron_core.models.hf.families import (
    NOT_SUPPORTED,
    SUPPORTED,
    Family,
    family_from_config,
    llama3_inv_freq,
)
from megatron_core.models.hf.model_view import (
    _EXPERT,
    _LAYER,
    _MTP,
    expert_ep_rank,
    expert_tp_rank_size,
    group_rank_size,
    hf_mappable_parameters,
    is_expert_rule,
    mcore_shape,
    tp_rank_size,
    unwrap,
)
from megatron_core.models.hf.model_view import TOKENIZER_FILES as TOKENIZER_FILES
from megatron_core.models.hf.rules import Copy, Index, SharedCopy, WeightRule, expected_hf_shape, fmt
from megatron_core.models.hf.safetensors_io import HFCheckpointReader, HFConversionError
from megatron_core.pipeline_parallel.utils import (
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron_core.process_groups_config import resolve_process_group


class AutoBridge:
    """Converts between one Hugging Face causal-LM directory and GPTModel shards (HybridModel for the hybrid
    Mamba architectures; see the module docstring)."""

    def __init__(self, directory: str, hf_config: dict, family: Family, reader: HFCheckpointReader | None) -> None:
        self.directory = directory
        self.hf_config = hf_config
        self.family = family
        self.reader = reader

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_hf_pretrained(cls, path: str | os.PathLike, *, load_weights: bool = True) -> AutoBridge:
        """Read ``config.json`` (and, with ``load_weights``, check every safetensors tensor's name and shape)."""
        directory = os.fspath(path)
        cfg = read_hf_config(directory)
        family = family_from_config(cfg, os.path.join(directory, "config.json"))
        reader = HFCheckpointReader(directory) if load_weights else None
        if reader is not None and family.architecture == "NemotronHForCausalLM" and any(
                name.startswith("model.") for name in reader.names()):  # in-memory names, not NVIDIA's backbone.
            family = family_from_config(cfg, os.path.join(directory, "config.json"), hf_prefix="model.")
        if reader is not None and family.mtp_num_layers:
            # transformers' save_pretrained keeps the MTP depth count in config.json but writes no MTP layer:
            # convert without
            stored = set(reader.names())
            mtp = {name for k in range(family.mtp_num_layers) for r in family.mtp_rules if "{e}" not in r.mcore
                   for name in r.hf_names(family.num_layers + k)}
            if stored.isdisjoint(mtp):
                family = family.without_mtp()
        bridge = cls(directory, cfg, family, reader)
        if reader is not None:
            bridge._check_tensors()
        return bridge

    @staticmethod
    def list_supported_models() -> list[str]:
        """The HF ``architectures`` this bridge converts."""
        return list(SUPPORTED)

    @staticmethod
    def supports(config: dict | str | os.PathLike) -> bool:
        """Whether an HF config (dict, ``config.json`` path or model directory) names a supported architecture."""
        cfg = config if isinstance(config, dict) else read_hf_config(os.fspath(config))
        archs = cfg.get("architectures") or []
        return len(archs) == 1 and archs[0] in SUPPORTED

    @property
    def architecture(self) -> str:
        """The HF architecture name, e.g. ``LlamaForCausalLM``."""
        return self.family.architecture

    def rules(self, include_mtp: bool = True) -> list[tuple[WeightRule, Index]]:
        """Every (rule, global layer index) of the full model, in HF file order; the multi-token-prediction
        depths (``include_mtp``) as HF layers ``num_layers + k``, with the tensors they share last."""
        out: list[tuple[WeightRule, int | None]] = [(r, None) for r in self.family.global_rules
                                                    if r.mcore.startswith("embedding.")]
        experts = self.family.config_kwargs.get("num_moe_experts") or 0
        for i in range(self.family.num_layers):
            for r in self.family.layer_rules_of(i):
                out += [(r, (i, e)) for e in range(experts)] if "{e}" in r.mcore else [(r, i)]
        if include_mtp:
            for k in range(self.family.mtp_num_layers):
                i = self.family.num_layers + k
                for r in self.family.mtp_rules:
                    out += [(r, (i, e)) for e in range(experts)] if "{e}" in r.mcore else [(r, i)]
                out += [(r, i) for r in self.family.mtp_shared]
        out += [(r, None) for r in self.family.global_rules if not r.mcore.startswith("embedding.")]
        if self.family.model_kwargs["share_embeddings_and_output_weights"]:
            out = [(r, i) for r, i in out if r.mcore != "output_layer.weight"]
        return out

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every HF tensor the config implies."""
        shapes: dict[str, tuple[int, ...]] = {}
        for rule, layer in self.rules():
            full = mcore_shape(rule.mcore, self.family, self.family.vocab_size)
            for name, shape in expected_hf_shape(rule, full).items():
                shapes[fmt(name, layer)] = shape
        return shapes

    def _check_tensors(self) -> None:
        assert self.reader is not None
        expected = self.expected_hf_shapes()
        stored = set(self.reader.names())
        optional = {fmt(r.hf, i) for r, i in self.rules() if isinstance(r, SharedCopy)}
        for name, shape in expected.items():
            if name not in stored and name in optional:
                continue
            if name not in stored:
                raise HFConversionError(
                    f"{self.directory}: tensor {name!r} is missing from the safetensors files "
                    f"({self.architecture} with this config.json needs it)"
                )
            if self.reader.shape(name) != shape:
                raise HFConversionError(
                    f"{self.reader.path_of(name)}: tensor {name!r} has shape {self.reader.shape(name)}, "
                    f"but config.json implies {shape}"
                )
        ignorable = self.family.ignored_suffixes
        if self.family.model_kwargs["share_embeddings_and_output_weights"]:
            ignorable = (*ignorable, "lm_head.weight")
        for prefix, why in self.family.refused_prefixes.items():
            refused = sorted(n for n in stored if n.startswith(prefix))
            if refused:
                raise HFConversionError(f"{self.reader.path_of(refused[0])}: tensor {refused[0]!r} (and "
                                        f"{len(refused) - 1} more under {prefix!r}): {why}")
        skipped = self.family.ignored_prefixes
        extra = sorted(n for n in stored - set(expected) if not n.endswith(ignorable) and not n.startswith(skipped))
        if extra:
            raise HFConversionError(
                f"{self.reader.path_of(extra[0])}: tensor {extra[0]!r} (and {len(extra) - 1} more) has no place in a "
                f"{self.architecture} with this config.json; unconverted weights would be lost"
            )

    # ---- Megatron side ------------------------------------------------------------------------------------
    def padded_vocab_size(self, tp_size: int, make_vocab_size_divisible_by: int | None = None) -> int:
        """The model's vocabulary: the HF one, padded to a multiple of ``make_vocab_size_divisible_by * TP``."""
        vocab = self.family.vocab_size
        if make_vocab_size_divisible_by:
            from megatron_core.tensor_parallel import pad_vocab_size

            return pad_vocab_size(vocab, make_vocab_size_divisible_by, tp_size)
        if vocab % tp_size:
            raise HFConversionError(
                f"{os.path.join(self.directory, 'config.json')}: vocab_size {vocab} is not divisible by "
                f"tensor_model_parallel_size {tp_size}; pass make_vocab_size_divisible_by (e.g. 128) to pad it "
                f"(padded rows are zero and dropped again on export)"
            )
        return vocab

    def transformer_config(self, *, pg_collection: Any = None, **overrides: Any):
        """The TransformerConfig (``MLATransformerConfig`` for multi-latent attention) for this model under the
        parallel layout of ``pg_collection`` (else ``parallel_state``'s); ``overrides`` win."""
        from megatron_core.transformer import MLATransformerConfig, TransformerConfig

        kwargs = dict(self.family.config_kwargs)
        kwargs.update(_parallel_sizes(pg_collection, moe=bool(kwargs.get("num_moe_experts"))))
        dtype = overrides.pop("params_dtype", None) or self.family.dtype or torch.float32
        kwargs.update(params_dtype=dtype)
        kwargs.update(overrides)
        if kwargs.get("pipeline_model_parallel_size", 1) > 1:
            kwargs.setdefault("pipeline_dtype", dtype)
        return (MLATransformerConfig if kwargs.get("multi_latent_attention") else TransformerConfig)(**kwargs)

    def gpt_model_kwargs(self) -> dict[str, Any]:
        """GPTModel keyword arguments for this model (position embeddings, RoPE, tying, maximum length)."""
        return dict(self.family.model_kwargs)

    def to_megatron_model(self, load_weights: bool = True, *, config: Any = None,
                          make_vocab_size_divisible_by: int | None = None, pg_collection: Any = None,
                          mtp: bool = True, **model_kwargs: Any) -> list[torch.nn.Module]:
        """This rank's GPTModel chunks (one per virtual pipeline stage), with the HF weights unless not ``load_weights``;
        for a hybrid Mamba architecture one HybridModel (this pipeline stage's layers).

        A checkpoint with multi-token-prediction layers builds them (``config.mtp_num_layers``) unless ``mtp`` is
        False (or ``config`` has no ``mtp_num_layers``); their HF tensors are then not read."""
        from megatron_core.models.gpt import GPTModel, get_gpt_decoder_block_spec, get_gpt_layer_local_spec
        from megatron_core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
            get_transformer_layer_with_experimental_attention_variant_spec,
        )
        from megatron_core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        if config is None:
            overrides = {} if mtp or not self.family.mtp_num_layers else {"mtp_num_layers": None}
            config = self.transformer_config(perform_initialization=not load_weights, pg_collection=pg_collection,
                                             **overrides)
        depths = getattr(config, "mtp_num_layers", None) or 0
        if depths and not mtp:
            raise ValueError("to_megatron_model(mtp=False) with a config that has mtp_num_layers "
                             f"({depths}); build the config with transformer_config(mtp_num_layers=None)")
        if depths and depths != self.family.mtp_num_layers:
            raise HFConversionError(
                f"{os.path.join(self.directory, 'config.json')}: the config asks for {depths} multi-token-prediction "
                f"layers, the checkpoint has {self.family.mtp_num_layers}")
        _, tp_size, _ = tp_rank_size(pg_collection)
        vocab = self.padded_vocab_size(tp_size, make_vocab_size_divisible_by)
        kwargs = {**self.family.model_kwargs, **model_kwargs}
        max_seq = kwargs.pop("max_sequence_length")
        if self.family.hybrid_pattern is not None:
            chunks = [self._hybrid_model(config, vocab, max_seq, kwargs, pg_collection)]
            if load_weights:
                self.load_hf_weights(chunks, pg_collection=pg_collection)
            return chunks
        spec = get_gpt_layer_local_spec(config.num_moe_experts, moe_grouped_gemm=bool(config.moe_grouped_gemm),
                                        qk_layernorm=config.qk_layernorm,
                                        multi_latent_attention=config.multi_latent_attention)
        mixed = config.num_moe_experts is not None and isinstance(config.moe_layer_freq, list)  # dense + MoE layers
        # The virtual pipeline: the config's with a pg_collection (which holds no virtual stages), else parallel_state's
        vpp = config.virtual_pipeline_model_parallel_size if pg_collection is not None else _parallel_state_vpp()
        pp_group = resolve_process_group("pp", pg_collection)
        chunks = []
        for vp in range(vpp or 1):
            stage = vp if vpp else None
            pre = is_pp_first_stage(pp_group) and is_vp_first_stage(stage, vpp)
            post = is_pp_last_stage(pp_group) and is_vp_last_stage(stage, vpp)
            if config.experimental_attention_variant is not None:  # gated delta net and attention layers mixed
                chunk_spec = get_transformer_block_with_experimental_attention_variant_spec(
                    config, vp_stage=stage, pp_rank=group_rank_size("pp", pg_collection)[0])
            else:
                chunk_spec = get_gpt_decoder_block_spec(config, False, vp_stage=stage) if mixed else spec
            chunk_kwargs = dict(kwargs)
            if depths:  # the MTP layer is built from the model's last layer spec
                if config.experimental_attention_variant is not None:
                    last = get_transformer_layer_with_experimental_attention_variant_spec(config)[-1]
                else:
                    last = get_gpt_decoder_block_spec(config, False) if mixed else spec
                chunk_kwargs.setdefault("mtp_block_spec", get_gpt_mtp_block_spec(config, last, False, vp_stage=stage))
            chunks.append(GPTModel(config, chunk_spec, vocab, max_seq, pre_process=pre, post_process=post,
                                   vp_stage=stage, pg_collection=pg_collection, **chunk_kwargs))
        if load_weights:
            self.load_hf_weights(chunks, pg_collection=pg_collection)
        else:
            for chunk in chunks:
                self.set_rotary_frequencies(chunk)
        return chunks

    def _hybrid_model(self, config: Any, vocab: int, max_seq: int, kwargs: dict[str, Any], pg_collection: Any
                      ) -> torch.nn.Module:
        """This pipeline stage's HybridModel (the stack's mixers take the checkpoint's conv width and chunk size)."""
        from megatron_core.models.hf.hybrid import hybrid_stack_spec_for
        from megatron_core.models.hybrid import HybridModel

        vpp = config.virtual_pipeline_model_parallel_size if pg_collection is not None else _parallel_state_vpp()
        if vpp:
            raise HFConversionError(
                f"{self.architecture}: virtual pipeline stages (virtual_pipeline_model_parallel_size={vpp}) are not "
                "supported for hybrid models by the bridge (they need '|' stage separators in the layer pattern)")
        pp_group = resolve_process_group("pp", pg_collection)
        return HybridModel(config, hybrid_stack_spec_for(self.family.mixer_params), vocab, max_seq,
                           pre_process=is_pp_first_stage(pp_group), post_process=is_pp_last_stage(pp_group),
                           pg_collection=pg_collection, **kwargs)

    def set_rotary_frequencies(self, model: torch.nn.Module) -> None:
        """Give the model the exact Llama 3.1 RoPE frequencies of config.json (they are not in state dicts)."""
        scaling = self.family.rope_llama3
        inner = unwrap(model)
        rotary = getattr(inner, "rotary_pos_emb", None)
        if scaling is None or rotary is None:
            return
        kv = inner.config.kv_channels
        percent = 2 * rotary.inv_freq.numel() / kv
        rotary.inv_freq = llama3_inv_freq(kv, percent, self.family.model_kwargs["rotary_base"], scaling).to(
            rotary.inv_freq.device)
        getattr(rotary, "_cache", {}).clear()

    def load_hf_weights(self, model: torch.nn.Module | list[torch.nn.Module], pg_collection: Any = None) -> None:
        """Fill every parameter of this rank's chunk(s) with its slice of the HF tensors."""
        if self.reader is None:
            raise HFConversionError(f"{self.directory}: the bridge was opened with load_weights=False")
        dense_tp = tp_rank_size(pg_collection)[:2]
        expert_tp = expert_tp_rank_size(pg_collection)[:2]
        by_name = self.rules_by_name()
        chunks = model if isinstance(model, (list, tuple)) else [model]
        if any(getattr(unwrap(chunk), "mtp_process", False) for chunk in chunks):
            self._check_shared_mtp_tensors()
        for chunk in chunks:
            inner = unwrap(chunk)
            self.set_rotary_frequencies(inner)
            with torch.no_grad():
                for name, param in hf_mappable_parameters(inner, self.family.buffers):
                    rule, layer = self._rule_for(inner, name, by_name, pg_collection)
                    tp_rank, tp_size = expert_tp if is_expert_rule(rule) else dense_tp
                    if isinstance(rule, Copy) and rule.vocab:
                        padded = param.shape[0] * (tp_size if rule.tp_axis == 0 else 1)
                        if padded < self.family.vocab_size:
                            raise HFConversionError(
                                f"{name}: the model's vocabulary ({padded}) is smaller than config.json's "
                                f"vocab_size ({self.family.vocab_size})")
                        value = rule.from_hf(self.reader.read, layer, tp_rank, tp_size, self.reader.shape,
                                             padded_rows=padded)
                    else:
                        value = rule.from_hf(self.reader.read, layer, tp_rank, tp_size, self.reader.shape)
                    if tuple(value.shape) != tuple(param.shape):
                        files = sorted({self.reader.path_of(n) for n in rule.hf_names(layer)})
                        raise HFConversionError(
                            f"{name}: built {tuple(value.shape)} from {rule.hf_names(layer)} in {files}, but this "
                            f"rank's parameter is {tuple(param.shape)} (TP {tp_rank}/{tp_size})")
                    param.copy_(value)

    def rules_by_name(self) -> dict[str, WeightRule]:
        """Every rule of a GPTModel parameter by its ``mcore`` key."""
        return {r.mcore: r for r in self.family.layer_rules + self.family.global_rules + self.family.mtp_rules}

    def rule_for(self, model: torch.nn.Module, name: str, pg_collection: Any = None) -> tuple[WeightRule, Index]:
        """``(rule, global layer index)`` converting parameter ``name`` of ``model`` (this rank's chunk) to HF tensors."""
        return self._rule_for(model, name, self.rules_by_name(), pg_collection)

    def _check_shared_mtp_tensors(self) -> None:
        """The MTP layers' stored ``embed_tokens`` / ``shared_head.head`` must equal what the model shares."""
        assert self.reader is not None
        stored = set(self.reader.names())
        sources = {r.mcore: r for r in self.family.global_rules}
        for rule, layer in self.rules():
            if not isinstance(rule, SharedCopy) or (name := fmt(rule.hf, layer)) not in stored:
                continue
            main = sources[rule.source].hf_names(None)[0]
            rows = self.reader.shape(main)[0]
            if self.reader.shape(name) != self.reader.shape(main):
                raise HFConversionError(f"{self.reader.path_of(name)}: {name!r} has shape {self.reader.shape(name)}, "
                                        f"but the {main!r} it repeats has {self.reader.shape(main)}")
            for start in range(0, rows, 8192):
                span = [slice(start, min(start + 8192, rows))]
                if not torch.equal(self.reader.read(name, span), self.reader.read(main, span)):
                    raise HFConversionError(
                        f"{self.reader.path_of(name)}: {name!r} differs from {main!r}; the multi-token-prediction "
                        "layer must share the model's embedding and output layer")

    def _rule_for(self, inner: torch.nn.Module, name: str, by_name: dict[str, WeightRule], pg_collection: Any = None
                  ) -> tuple[WeightRule, Index]:
        match = _LAYER.match(name)
        layer_index: Index = None
        key = name
        mtp = _MTP.match(name)
        if mtp:  # depth k is HF layer num_layers + k; its transformer layer converts like a decoder layer
            layer = inner.mtp.layers[int(mtp.group(1))]
            hf_layer = self.family.num_layers + layer.layer_number - 1
            rest = mtp.group(2)
            key, layer_index = f"mtp.layers.{{i}}.{rest}", hf_layer
            expert = _EXPERT.match(rest.removeprefix("mtp_model_layer."))
            if rest.startswith("mtp_model_layer.") and expert:
                local = layer.mtp_model_layer.mlp.experts.num_local_experts
                key = f"mtp.layers.{{i}}.mtp_model_layer.mlp.experts.local_experts.{{e}}.{expert.group(2)}"
                layer_index = (hf_layer, expert_ep_rank(pg_collection) * local + int(expert.group(1)))
        elif match:
            layer = inner.decoder.layers[int(match.group(1))]
            rest = match.group(2)
            key, layer_index = f"decoder.layers.{{i}}.{rest}", layer.layer_number - 1
            expert = _EXPERT.match(rest)
            if expert:
                local = layer.mlp.experts.num_local_experts
                global_expert = expert_ep_rank(pg_collection) * local + int(expert.group(1))
                key = f"decoder.layers.{{i}}.mlp.experts.local_experts.{{e}}.{expert.group(2)}"
                layer_index = (layer.layer_number - 1, global_expert)
        if key not in by_name:
            raise HFConversionError(f"parameter {name!r} of the GPTModel has no Hugging Face counterpart")
        return by_name[key], layer_index

    # ---- Hugging Face side --------------------------------------------------------------------------------
    def save_hf_pretrained(self, model: torch.nn.Module | list[torch.nn.Module], path: str | os.PathLike, *,
                           max_shard_size: int | str = "5GB", overwrite: bool = False, progress: bool = False,
                           pg_collection: Any = None, finalize: Callable[[str], None] | None = None) -> None:
        """Write the (possibly TP/PP-sharded) model as an HF directory; collective over every rank.

        ``finalize(directory)`` runs on rank 0 over the finished temporary directory before it is published."""
        from megatron_core.models.hf.export import export_model

        export_model(self, model, os.fspath(path), max_shard_size=max_shard_size, overwrite=overwrite,
                     progress=progress, pg_collection=pg_collection, finalize=finalize)

    def hf_config_for_export(self, dtype: torch.dtype | None) -> dict:
        """config.json for an export in ``dtype``."""
        cfg = dict(self.hf_config)
        if dtype is not None:
            name = str(dtype).replace("torch.", "")
            cfg["dtype" if "dtype" in cfg or "torch_dtype" not in cfg else "torch_dtype"] = name
        return cfg

    def tokenizer(self, **kwargs: Any):
        """The directory's tokenizer (``tokenizer.json``, special tokens and chat template) as a Megatron tokenizer."""
        from megatron_core.models.hf.tokenizer import HFDirectoryTokenizer

        return HFDirectoryTokenizer(self.directory, **kwargs)


def _parallel_state_vpp() -> int | None:
    """``parallel_state``'s virtual pipeline size (``None`` without one or before model parallelism is set up)."""
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_virtual_pipeline_model_parallel_world_size()


def _parallel_sizes(pg_collection: Any, moe: bool) -> dict[str, Any]:
    """Parallel sizes for a TransformerConfig from ``pg_collection``'s groups, else from ``parallel_state``'s
    (nothing before it is set up); the expert sizes only for an MoE model (``moe``)."""
    if pg_collection is None and not parallel_state.model_parallel_is_initialized():
        return {}
    roles = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp"}
    if moe:  # the expert layout the groups were built with
        roles.update(expert_model_parallel_size="ep", expert_tensor_parallel_size="expt_tp")
    sizes: dict[str, Any] = {name: group_rank_size(role, pg_collection)[1] for name, role in roles.items()}
    if pg_collection is None:
        sizes["virtual_pipeline_model_parallel_size"] = _parallel_state_vpp()
    return sizes


def read_hf_config(path: str) -> dict:
    """``config.json`` of a model directory (or the file itself) as a dict, with a clear error."""
    file = path if path.endswith(".json") else os.path.join(path, "config.json")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError as e:
        raise HFConversionError(f"{file} does not exist: not a Hugging Face model directory") from e
    except (OSError, ValueError) as e:
        raise HFConversionError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise HFConversionError(f"{file}: expected a JSON object")
    return cfg


__all__ = ["NOT_SUPPORTED", "SUPPORTED", "AutoBridge", "read_hf_config"]
