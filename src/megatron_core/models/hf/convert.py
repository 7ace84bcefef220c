"""Hugging Face directory <-> distributed checkpoint on disk, from one process, one tensor at a time.

:func:`import_hf_to_mcore` writes ``<out>/iter_0000000/`` (plus the ``latest_checkpointed_iteration.txt``
tracker) in the layout of ``training.save_checkpoint``: each model tensor is
stored in its global (TP- and PP-independent) form, one chunk per layer, under the sharded keys
GPTModel's ``sharded_state_dict`` uses: stacked layers, per-layer keys where dense and MoE layers mix,
``mtp.layers.<k>.`` for multi-token-prediction depths (:mod:`.checkpoint_layout`). ``dist_checkpointing``
reshards on load, so a run with any TP/PP/EP that divides the model loads it with ``--load <out>
--no-load-optim --no-load-rng``; no process per rank is spawned. ``--tp`` only sets the vocabulary
padding and checks divisibility. The HF ``config.json`` and tokenizer files are copied to ``<out>/hf/``
so the export back needs nothing else.

:func:`export_mcore_to_hf` reads such a checkpoint (or one saved by a training run) tensor by
tensor and streams the HF shards (see :mod:`.export`).
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from megatron_core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron_core.dist_checkpointing.serialization import load_common_state_dict, load_tensors_metadata, save
from megatron_core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron_core.dist_checkpointing.strategies.torch_dist import (
    BACKEND,
    VERSION,
    TorchDistLoadShardedStrategy,
)
from megatron_core.dist_checkpointing.tracker import get_checkpoint_name, read_tracker, write_tracker
from megatron_core.models.hf.bridge import TOKENIZER_FILES, AutoBridge, mcore_shape
from megatron_core.models.hf.checkpoint_layout import CheckpointLayout, model_layout
from megatron_core.models.hf.export import HFDirectoryWriter
from megatron_core.models.hf.families import family_from_config
from megatron_core.models.hf.progress import progress as progress_iter
from megatron_core.models.hf.rules import Copy, Index, SharedCopy, WeightRule, expected_hf_shape, fmt
from megatron_core.models.hf.safetensors_io import HFConversionError
from megatron_core.models.hf.stacked_rules import hf_row

HF_SUBDIR = "hf"
CHECKPOINT_VERSION = 3.0


class _LazySavePlanner(DefaultSavePlanner):
    """DCP save planner whose tensors are produced by a loader only when the writer asks for them."""

    def __init__(self, shards: list[ShardedTensor | ShardedObject], loaders: dict[tuple[str, tuple[int, ...]], Callable]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=False)
        self._loaders = loaders
        self._items = []
        self._objects: dict[str, io.BytesIO] = {}
        for sh in shards:
            if isinstance(sh, ShardedObject):
                self._items.append(WriteItem(index=MetadataIndex(sh.unique_key), type=WriteItemType.BYTE_IO))
                buffer = io.BytesIO()
                torch.save(sh.data, buffer)
                self._objects[sh.unique_key] = buffer
                continue
            offsets = torch.Size(sh.global_offset)
            self._items.append(WriteItem(
                index=MetadataIndex(sh.key, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(sh.chunk_sizes())),
                                            properties=TensorProperties(dtype=sh.dtype),
                                            size=torch.Size(sh.global_shape)),
            ))

    def set_up_planner(self, state_dict: Any = None, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._objects[write_item.index.fqn].getbuffer())
        return self._loaders[(write_item.index.fqn, tuple(write_item.index.offset))]()


class _LazyTorchDistSave(SaveShardedStrategy):
    """A one-process ``torch_dist`` save that reads each tensor from the HF files just before writing it."""

    def __init__(self, loaders: dict[tuple[str, tuple[int, ...]], Callable]) -> None:
        super().__init__(BACKEND, VERSION)
        self.loaders = loaders

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | os.PathLike) -> None:
        from megatron_core.dist_checkpointing.dict_utils import nested_values

        shards = [v for v in nested_values(sharded_state_dict) if isinstance(v, (ShardedTensor, ShardedObject))]
        planner = _LazySavePlanner(shards, self.loaders)
        writer = FileSystemWriter(checkpoint_dir, thread_count=1, sync_files=True, overwrite=True)
        planner.set_up_planner(is_coordinator=True)
        writer.set_up_storage_writer(True, rank=0, use_collectives=True)
        local = writer.prepare_local_plan(planner.create_local_plan())
        global_plans, metadata = planner.create_global_plan([local])
        final = planner.finish_plan(writer.prepare_global_plan(global_plans)[0])
        results = writer.write_data(final, planner).wait()
        writer.finish(metadata, [results])


class _SharedRead:
    """Reads a rule's full tensor once for all the sections it is stored as, and forgets it after the last one."""

    def __init__(self, load: Callable[[], torch.Tensor], uses: int) -> None:
        self._load, self._uses, self._value = load, uses, None

    def __call__(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._load()
        value = self._value
        self._uses -= 1
        if self._uses == 0:
            self._value = None
        return value


def _sections(layout: CheckpointLayout, rule: WeightRule, full: tuple[int, ...]) -> list[tuple[str, int]]:
    """``(key suffix, rows)`` of each piece a parameter is stored as: ``[("", rows)]`` for one tensor, the named
    row sections (``.z``, ``.x``, ...) of a Mamba mixer's ``in_proj`` / ``conv1d`` tensors."""
    names = layout.splits.get(rule.mcore)
    if not names:
        return [("", full[0] if full else 0)]
    sizes = tuple(getattr(rule, "sections", ()))
    if len(sizes) != len(names) or sum(sizes) != full[0]:
        raise HFConversionError(f"parameter {rule.mcore!r}: the checkpoint stores it as sections {list(names)} but "
                                f"the conversion rule has row sections {list(sizes)} of {full[0]} rows")
    return [(f".{name}", size) for name, size in zip(names, sizes)]


def _copy_hf_files(source: str, target: str) -> None:
    os.makedirs(target, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(target, name))


def _import_shards(bridge: AutoBridge, layout: CheckpointLayout, vocab: int, tick: Callable[[], None]
                   ) -> tuple[dict[str, ShardedTensor | ShardedObject], dict[tuple[str, tuple[int, ...]], Callable]]:
    """The model's sharded state dict (tensors on the meta device, and the ``_extra_state`` objects), and the loader
    of each tensor's value from the HF files by ``(key, offset)``."""
    reader = bridge.reader
    assert reader is not None
    model: dict[str, ShardedTensor | ShardedObject] = {}
    loaders: dict[tuple[str, tuple[int, ...]], Callable] = {}
    for rule, layer in bridge.rules():
        if isinstance(rule, SharedCopy):  # an MTP depth's copy of the embedding / output layer: stored once
            continue
        full = mcore_shape(rule.mcore, bridge.family, vocab)
        dtype = reader.dtype(rule.hf_names(layer)[0])
        key = layout.key(rule.mcore, layer)

        def load(rule: Any = rule, layer: Any = layer) -> torch.Tensor:
            extra = {"padded_rows": vocab} if isinstance(rule, Copy) and rule.vocab else {}
            value = rule.from_hf(reader.read, layer, 0, 1, reader.shape, **extra)
            tick()
            return value

        parts = _sections(layout, rule, full)
        read = _SharedRead(load, len(parts))
        start = 0
        for suffix, size in parts:
            part_full = (size, *full[1:]) if suffix else full
            global_shape, offset, prepended = layout.placement(rule.mcore, part_full, layer)
            model[fmt(rule.mcore, layer) + suffix] = ShardedTensor(
                key + suffix, torch.empty(part_full, dtype=dtype, device="meta"), dtype, part_full, global_shape,
                offset, (1,) * len(global_shape), prepend_axis_num=prepended)

            def load_part(read: _SharedRead = read, start: int = start, size: int = size, split: bool = bool(suffix),
                          prepended: int = prepended) -> torch.Tensor:
                value = read().narrow(0, start, size).contiguous() if split else read()
                return value.reshape(*(1,) * prepended, *value.shape)

            loaders[(key + suffix, offset)] = load_part
            start += size
    model.update(layout.extra_state_objects())
    return model, loaders


def _recorded_rotary(bridge: AutoBridge, config: Any) -> dict[str, Any] | None:
    """The ``rotary`` entry of a converted RoPE model's record: the exact frequencies the bridge gives the model
    (``rotary_base``, Llama 3.1 scaling), which the rebuilt model takes from the record."""
    from megatron_core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron_core.models.hf.families import llama3_inv_freq

    kwargs = bridge.family.model_kwargs
    if kwargs.get("position_embedding_type") != "rope":
        return None
    base = kwargs.get("rotary_base", 10000)
    scaling = bridge.family.rope_llama3
    if scaling is not None:
        inv_freq = llama3_inv_freq(config.kv_channels, 1.0, base, scaling)
    else:
        inv_freq = RotaryEmbedding(config.kv_channels, rotary_percent=1.0, rotary_base=base,
                                   use_cpu_initialization=True).inv_freq
    return {"class": "RotaryEmbedding", "inv_freq": inv_freq.float().cpu().tolist(), "seq_len_interpolation_factor": None}


def _inference_records(bridge: AutoBridge, vocab: int, hf_dir: str, out_dir: str) -> tuple[dict, dict]:
    """The ``model_config`` record of the converted model (as ``save_checkpoint`` writes it), from which
    ``megatron-generate`` / ``megatron-serve`` rebuild it, and, in ``extra_state["args"]``, its tokenizer: the copied
    HF tokenizer when the directory has a ``tokenizer.json``, else ``NullTokenizer`` (prompts are token ids) whose
    end-of-document id is the last vocabulary id. ``({}, {})`` for a model the record cannot describe (YaRN RoPE,
    multi-latent attention, gated delta net layers): its conversion is for training, not for the inference
    commands."""
    from megatron_core.models.common.model_config_record import MODEL_CONFIG_KEY, model_config_record_for
    from megatron_core.models.gpt import GPTModel
    from megatron_core.models.hybrid import HybridModel

    config = bridge.transformer_config(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    settings = {**bridge.family.model_kwargs, "vocab_size": vocab, "parallel_output": True,
                "fp16_lm_cross_entropy": False}
    if bridge.family.hybrid_pattern is not None:
        model_class = HybridModel
        settings["mamba_mixer"] = dict(bridge.family.mixer_params)
    elif settings.get("position_embedding_type") in ("rope", "learned_absolute", "none") and not getattr(
            config, "multi_latent_attention", False) and config.experimental_attention_variant is None:
        model_class = GPTModel
        rotary = _recorded_rotary(bridge, config)
        if rotary is not None:
            settings["rotary"] = rotary
    else:
        return {}, {}
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        args = {"tokenizer_type": "HuggingFaceTokenizer",
                "tokenizer_model": os.path.abspath(os.path.join(out_dir, HF_SUBDIR))}
    else:
        args = {"tokenizer_type": "NullTokenizer", "vocab_size": bridge.family.vocab_size - 1}
    return {MODEL_CONFIG_KEY: model_config_record_for(config, model_class, settings)}, args


def import_hf_to_mcore(hf_dir: str, out_dir: str, *, tp: int = 1, pp: int = 1,
                       make_vocab_size_divisible_by: int | None = None, progress: bool = True) -> str:
    """Write the HF model in ``hf_dir`` as a distributed checkpoint under ``out_dir``; returns the iteration dir.

    Models mixing dense and MoE layers get per-layer keys and multi-token-prediction depths ``mtp.layers.<k>.``
    keys, as GPTModel's ``sharded_state_dict`` has them (see :mod:`.checkpoint_layout`)."""
    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    bridge.transformer_config(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)  # checks divisibility
    layers = bridge.family.num_layers
    if layers % pp:
        raise HFConversionError(f"{hf_dir}/config.json: num_hidden_layers {layers} is not divisible by --pp {pp}")
    vocab = bridge.padded_vocab_size(tp, make_vocab_size_divisible_by)
    if read_tracker(out_dir) is not None:
        raise HFConversionError(f"{out_dir} already holds a checkpoint; choose an empty --out directory")
    if os.path.lexists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        what = f"holds {sorted(os.listdir(out_dir))[:10]}" if os.path.isdir(out_dir) else "is not a directory"
        raise HFConversionError(f"--out {out_dir} {what}; choose a new or empty directory (nothing was changed)")
    if bridge.family.mtp_num_layers:
        bridge._check_shared_mtp_tensors()  # each depth's embed_tokens / shared_head.head must repeat the model's
    count = sum(not isinstance(rule, SharedCopy) for rule, _ in bridge.rules())
    ticks = iter(progress_iter(range(count), count, f"hf-to-mcore {os.path.basename(out_dir)}", progress))
    model, loaders = _import_shards(bridge, model_layout(bridge), vocab, lambda: next(ticks, None))
    extra_state = {"hf_config": json.dumps(bridge.hf_config), "hf_source": os.path.abspath(hf_dir),
                   "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "padded_vocab_size": vocab}
    state = {"model": model, "opt_param_scheduler": None, "iteration": 0, "consumed_train_samples": 0,
             "extra_state": extra_state, "checkpoint_version": CHECKPOINT_VERSION}
    records, args = _inference_records(bridge, vocab, hf_dir, out_dir)  # what megatron-generate rebuilds it from
    if records:
        extra_state["args"] = args
        state.update(records)
    checkpoint_dir = get_checkpoint_name(out_dir, 0)
    created = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    try:
        save(state, checkpoint_dir, sharded_strategy=_LazyTorchDistSave(loaders))
        for _ in ticks:  # finish the progress display
            pass
        _copy_hf_files(hf_dir, os.path.join(out_dir, HF_SUBDIR))
        write_tracker(out_dir, 0)  # last: the checkpoint counts only once the tracker names it
    except Exception as e:  # out_dir was new or empty: everything in it is ours
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        else:
            for name in os.listdir(out_dir):
                path = os.path.join(out_dir, name)
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
        raise HFConversionError(f"converting {hf_dir} to {out_dir} failed (nothing left there): {e}") from e
    return os.fspath(checkpoint_dir)


def _checkpoint_dir(path: str, iteration: int | None) -> str:
    if iteration is None:
        iteration = read_tracker(path)
    return os.fspath(get_checkpoint_name(path, iteration)) if iteration is not None else path


def _template(ckpt_root: str, checkpoint_dir: str, hf_template: str | None) -> AutoBridge:
    """The bridge (config, tokenizer files) the export follows."""
    if hf_template is not None:
        return AutoBridge.from_hf_pretrained(hf_template, load_weights=False)
    if os.path.isfile(os.path.join(ckpt_root, HF_SUBDIR, "config.json")):
        return AutoBridge.from_hf_pretrained(os.path.join(ckpt_root, HF_SUBDIR), load_weights=False)
    extra = load_common_state_dict(checkpoint_dir).get("extra_state") or {}
    source = (extra.get("args") or {}).get("hf_model") if isinstance(extra, dict) else None
    if source and os.path.isfile(os.path.join(source, "config.json")):
        return AutoBridge.from_hf_pretrained(source, load_weights=False)
    if isinstance(extra, dict) and extra.get("hf_config"):
        cfg = json.loads(extra["hf_config"])
        return AutoBridge(extra.get("hf_source", ""), cfg, family_from_config(cfg, f"{checkpoint_dir} (hf_config)"), None)
    raise HFConversionError(f"{checkpoint_dir}: no Hugging Face config found; pass --hf-template DIR (the model's "
                            "original HF directory, for config.json and the tokenizer)")


class _Stored(NamedTuple):
    """One HF rule's parameter in the checkpoint: ``source`` / ``index`` name the parameter (the embedding or output
    layer for an MTP depth's shared copy), ``full`` its shape without the prepended axes, ``parts`` the key suffix
    and rows of each piece it is stored as (see :func:`_sections`)."""

    rule: WeightRule
    layer: Index
    source: str
    index: Index
    key: str
    full: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[tuple[str, int], ...]


def _stored_parameters(bridge: AutoBridge, layout: CheckpointLayout, stored: dict[str, Any],
                       checkpoint_dir: str) -> list[_Stored]:
    """Every rule's parameter as the checkpoint holds it, its keys and global shapes checked against the HF config."""
    todo = []
    for rule, layer in bridge.rules():
        source, index = (rule.source, None) if isinstance(rule, SharedCopy) else (rule.mcore, layer)
        key = layout.key(source, index)
        names = layout.splits.get(source)
        first = f"{key}.{names[0]}" if names else key
        if first not in stored:
            raise HFConversionError(f"{checkpoint_dir}: tensor {first!r} is missing (a {bridge.architecture} needs it)")
        stored_rows = stored[first].global_shape[len(layout.axes(source, index))]  # the padded vocabulary, if any
        want = tuple(mcore_shape(source, bridge.family, stored_rows if isinstance(rule, Copy) and rule.vocab else 0))
        parts = tuple(_sections(layout, rule, want))
        for suffix, size in parts:
            part_want = (size, *want[1:]) if suffix else want
            expected = layout.placement(source, part_want, index)[0]
            got = tuple(stored[key + suffix].global_shape) if key + suffix in stored else None
            if got != expected:
                what = "is missing" if got is None else f"has shape {got}"
                raise HFConversionError(f"{checkpoint_dir}: tensor {key + suffix!r} {what}, the HF config implies "
                                        f"{expected}")
        todo.append(_Stored(rule, layer, source, index, key, want, stored[first].dtype, parts))
    return todo


def export_mcore_to_hf(ckpt: str, out_dir: str, *, hf_template: str | None = None, iteration: int | None = None,
                       max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None, overwrite: bool = False,
                       progress: bool = True) -> None:
    """Write the model of distributed checkpoint ``ckpt`` (root with a tracker, or an iteration dir) as HF files.

    Multi-token-prediction depths are written (with the embedding / output layer copies DeepSeek-V3's files hold)
    when the checkpoint has them; a checkpoint without them exports without them, ``config.json`` unchanged."""
    checkpoint_dir = _checkpoint_dir(ckpt, iteration)
    bridge = _template(ckpt, checkpoint_dir, hf_template)
    stored = load_tensors_metadata(checkpoint_dir)
    if bridge.family.mtp_num_layers and not any(key.startswith("mtp.layers.") for key in stored):
        bridge.family = bridge.family.without_mtp()  # e.g. converted from transformers' files, which hold no MTP
    layout = model_layout(bridge)
    todo = _stored_parameters(bridge, layout, stored, checkpoint_dir)
    strategy = TorchDistLoadShardedStrategy()
    vocab = bridge.family.vocab_size
    writer = HFDirectoryWriter(bridge, out_dir, overwrite, max_shard_size)
    entries = []
    for item in todo:
        for name, shape in expected_hf_shape(item.rule, mcore_shape(item.rule.mcore, bridge.family, vocab)).items():
            entries.append((fmt(name, item.layer), shape, dtype or item.dtype))
    writer.plan(list({entry[0]: entry for entry in entries}.values()))  # a stacked tensor once, for all its rows
    error = None
    try:
        for item in progress_iter(todo, len(todo), "mcore-to-hf", progress):
            pieces = []
            for suffix, size in item.parts:
                part_full = (size, *item.full[1:]) if suffix else item.full
                global_shape, offset, prepended = layout.placement(item.source, part_full, item.index)
                request = ShardedTensor(item.key + suffix, None, item.dtype, part_full, global_shape, offset,
                                        (1,) * len(global_shape), prepend_axis_num=prepended)
                pieces.append(strategy.load({"t": request}, checkpoint_dir)["t"])
            tensor = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
            extra = {"hf_rows": vocab} if isinstance(item.rule, Copy) and item.rule.vocab else {}
            for name, value in item.rule.to_hf([tensor], item.layer, **extra).items():
                writer.write(name, value.to(dtype) if dtype is not None else value, row=hf_row(item.rule, item.layer))
    except Exception as e:  # noqa: BLE001 - reported by finish(), which removes the temporary directory
        error = e
    writer.finish(error)
