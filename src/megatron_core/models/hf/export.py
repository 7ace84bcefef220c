"""Export a (possibly TP/PP-sharded) GPTModel to a Hugging Face directory, streaming one tensor at a time.

Every rank computes nothing it does not hold: for each parameter, the TP shards are gathered to
TP rank 0 of the (data-parallel rank 0) pipeline stage that holds it, converted to the HF
tensors and written straight to their offsets in a pre-planned safetensors shard (the shard
plan, from shapes and dtypes only, is agreed by all ranks first; a shard holds tensors of one
stage). Files go into ``<path>.tmp-<id>``; only when every rank succeeded does rank 0 write the
index, ``config.json`` and the tokenizer files and rename the directory to ``path``, so a failure
leaves nothing at ``path``. With ``overwrite`` an earlier export at ``path`` is replaced, but a
directory holding anything an export does not write is refused, naming those entries
(:func:`target_refusal`). The parameters' dtype (bf16 / fp16 / fp32) is kept; the parameters Megatron keeps in
fp32 in any model (the Mamba mixer's ``A_log`` and ``D``) are written in the model's ``params_dtype``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_core.dist_checkpointing import collectives
from megatron_core.models.hf.model_view import (
    TOKENIZER_FILES,
    expert_tp_rank_size,
    group_rank_size,
    hf_mappable_parameters,
    is_expert_rule,
    mcore_shape,
    tp_rank_size,
    unwrap,
)
from megatron_core.models.hf.progress import progress as progress_iter
from megatron_core.models.hf.rules import Copy, Index, ModelDtypeCopy, SharedCopy, expected_hf_shape, fmt
from megatron_core.models.hf.safetensors_io import (
    INDEX_FILE,
    SINGLE_FILE,
    HFConversionError,
    SafetensorsShardWriter,
    plan_shards,
    shard_file_names,
)
from megatron_core.models.hf.stacked_rules import StackedExpertRule, hf_row

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(size: int | str) -> int:
    """``"500MB"`` / ``"5GB"`` / an int -> bytes."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    try:
        for unit in sorted(_UNITS, key=len, reverse=True):
            if text.endswith(unit):
                return int(float(text[: -len(unit)]) * _UNITS[unit])
        return int(text)
    except ValueError:
        raise ValueError(f"shard size {size!r} is not a size such as 500MB, 5GB or a number of bytes") from None


class HFDirectoryWriter:
    """Streams safetensors shards into a temporary directory and publishes it atomically; collective."""

    def __init__(self, bridge: Any, path: str, overwrite: bool, max_shard_size: int | str,
                 finalize: Callable[[str], None] | None = None) -> None:
        self.bridge, self.path, self.overwrite = bridge, os.path.abspath(path), overwrite
        self.finalize = finalize
        self.max_shard_bytes = parse_size(max_shard_size)
        self.rank = collectives.get_rank()
        refusal = collectives.broadcast_object(target_refusal(self.path, overwrite) if self.rank == 0 else None, 0)
        if refusal is not None:
            raise HFConversionError(refusal)
        name = f"{os.path.basename(self.path)}.tmp-{uuid.uuid4().hex[:12]}" if self.rank == 0 else None
        self.tmp = os.path.join(os.path.dirname(self.path), collectives.broadcast_object(name, 0))
        error = None
        if self.rank == 0:
            try:
                os.makedirs(self.tmp)
            except OSError as e:
                error = f"{type(e).__name__}: {e}"
        error = collectives.broadcast_object(error, 0)
        if error:
            raise HFConversionError(f"cannot create {self.tmp}: {error}")
        self.file_of: dict[str, str] = {}
        self._writers: dict[str, SafetensorsShardWriter] = {}
        self._plan: dict[str, list] = {}
        self.dtype: torch.dtype | None = None

    def plan(self, local_entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        """Agree on the shard layout from every rank's ``(hf_name, shape, dtype)`` list (collective)."""
        gathered = collectives.all_gather_object(local_entries)
        entries = [(n, s, d, r) for r, items in enumerate(gathered) for n, s, d in items]
        shards = plan_shards(entries, self.max_shard_bytes)
        names = shard_file_names(len(shards))
        self.total_size = 0
        for file_name, shard in zip(names, shards):
            self._plan[file_name] = shard
            for name, shape, dtype in shard:
                self.file_of[name] = file_name
                self.total_size += int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        dtypes = {d for _, _, d, _ in entries}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else None

    def write(self, name: str, tensor: torch.Tensor, row: int | None = None) -> None:
        """Write one planned tensor, or its row ``row`` (its shard file is created on first use)."""
        file_name = self.file_of[name]
        if file_name not in self._writers:
            self._writers[file_name] = SafetensorsShardWriter(os.path.join(self.tmp, file_name), self._plan[file_name])
        if row is None:
            self._writers[file_name].write(name, tensor)
        else:
            self._writers[file_name].write_row(name, tensor, row)

    def finish(self, error: BaseException | None) -> None:
        """Close this rank's shards; if every rank succeeded, rank 0 publishes the directory (collective)."""
        for writer in self._writers.values():
            try:
                writer.close()
            except Exception as e:  # noqa: BLE001 - reported below
                error = error or e
        failed = collectives.any_rank_true(error is not None)
        publish_error = None
        if self.rank == 0:
            try:
                if failed:
                    raise HFConversionError("a rank failed")
                self._publish()
            except Exception as e:  # noqa: BLE001 - sent to every rank below
                publish_error = f"{type(e).__name__}: {e}"
                shutil.rmtree(self.tmp, ignore_errors=True)
        publish_error = collectives.broadcast_object(publish_error, 0)
        if error is not None:
            raise HFConversionError(f"exporting to {self.path} failed (nothing written there): "
                                    f"{type(error).__name__}: {error}") from error
        if publish_error is not None:
            raise HFConversionError(f"exporting to {self.path} failed (nothing written there): {publish_error}")

    def _publish(self) -> None:
        files = sorted(self._plan)
        for file_name in files:
            if not os.path.isfile(os.path.join(self.tmp, file_name)):
                raise HFConversionError(f"{file_name} was never written")
        if len(files) > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(self.file_of.items()))}
            _write_json(os.path.join(self.tmp, INDEX_FILE), index)
        _write_json(os.path.join(self.tmp, "config.json"), self.bridge.hf_config_for_export(self.dtype))
        for name in TOKENIZER_FILES:
            source = os.path.join(self.bridge.directory, name)
            if os.path.isfile(source):
                shutil.copyfile(source, os.path.join(self.tmp, name))
        if self.finalize is not None:  # e.g. the quantized export's rewrite, done before anything is published
            self.finalize(self.tmp)
        refusal = target_refusal(self.path, self.overwrite)  # again: something may have appeared meanwhile
        if refusal is not None:
            raise HFConversionError(refusal)
        old = None
        if os.path.exists(self.path):
            old = f"{self.path}.old-{uuid.uuid4().hex[:8]}"
            os.rename(self.path, old)
        try:
            os.rename(self.tmp, self.path)
        except BaseException:
            if old is not None:  # put the earlier export back where it was
                os.rename(old, self.path)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


QUANT_CONFIG_FILE = "hf_quant_config.json"  # Model Optimizer's unified format (post_training.modelopt.hf_export)
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def written_by_export(directory: str, name: str) -> bool:
    """Whether ``directory/name`` is a file an export writes (weights, their index, config, tokenizer files)."""
    path = os.path.join(directory, name)
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    return (name in (SINGLE_FILE, INDEX_FILE, "config.json", QUANT_CONFIG_FILE, *TOKENIZER_FILES)
            or bool(_SHARD_NAME.fullmatch(name)))


def target_refusal(path: str, overwrite: bool) -> str | None:
    """Why ``path`` may not receive an export (``None``: it may); nothing it holds is ever removed unasked.

    An absent or empty directory may; a non-empty one only with ``overwrite``, and then only when it
    holds nothing but the files of an earlier export, which are replaced.
    """
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path) or os.path.islink(path):
        return f"{path} exists and is not a directory; nothing was changed"
    entries = sorted(os.listdir(path))
    if entries and not overwrite:
        return (f"{path} exists and is not empty ({len(entries)} entries: {entries[:5]}); pass overwrite=True "
                "(--overwrite) to replace an earlier export there, or choose another output directory")
    foreign = [name for name in entries if not written_by_export(path, name)]
    if foreign:
        return (f"{path} holds {len(foreign)} entries an export does not write: {foreign[:10]}; overwriting replaces "
                "only an earlier export's files (config.json, *.safetensors, the index, tokenizer files). Move "
                "them away or choose another output directory; nothing was changed")
    return None


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _gather(param: torch.Tensor, tp_rank: int, tp_size: int, group: Any) -> list[torch.Tensor] | None:
    data = param.detach().contiguous()
    if tp_size == 1:
        return [data]
    pieces = [torch.empty_like(data) for _ in range(tp_size)] if tp_rank == 0 else None
    dist.gather(data, pieces, dst=dist.get_global_rank(group, 0), group=group)
    return pieces


def export_model(bridge: Any, model: torch.nn.Module | list[torch.nn.Module], path: str, *,
                 max_shard_size: int | str, overwrite: bool, progress: bool, pg_collection: Any = None,
                 finalize: Callable[[str], None] | None = None) -> None:
    """Write ``model`` (this rank's chunks) as an HF directory at ``path``; every rank must call it.

    ``finalize(directory)``, if given, runs on rank 0 over the complete temporary directory just before it is
    published: a failure there publishes nothing."""
    chunks = [unwrap(c) for c in (model if isinstance(model, (list, tuple)) else [model])]
    # Dense weights are written from data-parallel rank 0, routed experts from expert-data-parallel rank 0
    # (each expert-parallel rank writes its own experts); TP shards are gathered to (expert-)TP rank 0.
    dense = tp_rank_size(pg_collection)
    expert = expert_tp_rank_size(pg_collection)
    dp_rank = group_rank_size("dp_cp", pg_collection)[0]
    edp_rank = group_rank_size("expt_dp", pg_collection)[0]
    by_name = bridge.rules_by_name()
    held: dict[tuple[str, Index], torch.Tensor] = {}
    for chunk in chunks:
        for name, param in hf_mappable_parameters(chunk, bridge.family.buffers):
            rule, layer = bridge._rule_for(chunk, name, by_name, pg_collection)
            held[(rule.mcore, layer)] = param

    def key(rule: Any, layer: Index) -> tuple[str, Index]:  # an MTP layer's embedding / head copy: the shared one
        return (rule.source, None) if isinstance(rule, SharedCopy) else (rule.mcore, layer)

    model_dtype = chunks[0].config.params_dtype

    def dtype_of(rule: Any, layer: Index) -> torch.dtype:  # the exported tensor's dtype
        return model_dtype if isinstance(rule, ModelDtypeCopy) else held[key(rule, layer)].dtype

    def mine(rule: Any, layer: Index) -> bool:
        return key(rule, layer) in held and (edp_rank if is_expert_rule(rule) else dp_rank) == 0

    # MTP tensors only from a model with MTP layers (every rank's config says so); config.json is kept either way,
    # as transformers' save_pretrained keeps num_nextn_predict_layers without writing MTP layers
    with_mtp = bool(bridge.family.mtp_num_layers and getattr(chunks[0].config, "mtp_num_layers", None))
    todo = [(rule, layer) for rule, layer in bridge.rules(include_mtp=with_mtp) if mine(rule, layer)]
    _check_stacked_experts(bridge, pg_collection)
    vocab = bridge.family.vocab_size
    local: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for rule, layer in todo:
        if (expert if is_expert_rule(rule) else dense)[0] == 0:
            for name, shape in expected_hf_shape(rule, mcore_shape(rule.mcore, bridge.family, vocab)).items():
                local.append((fmt(name, layer), shape, dtype_of(rule, layer)))
    local = list({entry[0]: entry for entry in local}.values())  # a stacked tensor once, for all its rows
    writer = HFDirectoryWriter(bridge, path, overwrite, max_shard_size, finalize)
    writer.plan(local)
    error: BaseException | None = None
    show = progress and dense[0] == 0 and dp_rank == 0
    for rule, layer in progress_iter(todo, len(todo), f"export {os.path.basename(path)}", show):
        tp_rank, tp_size, tp_group = expert if is_expert_rule(rule) else dense
        shards = _gather_for(rule, held[key(rule, layer)], tp_rank, tp_size, tp_group)
        if tp_rank != 0 or error is not None:
            continue
        try:
            extra = {"hf_rows": vocab} if isinstance(rule, Copy) and rule.vocab else {}
            for name, tensor in rule.to_hf(shards, layer, **extra).items():
                writer.write(name, tensor.to(dtype_of(rule, layer)), row=hf_row(rule, layer))
        except Exception as e:  # noqa: BLE001 - keep taking part in the gathers; reported in finish()
            error = e
    writer.finish(error)


def _check_stacked_experts(bridge: Any, pg_collection: Any = None) -> None:
    """Refuse (on every rank alike) an export whose stacked expert tensors would be spread over EP ranks."""
    ep = group_rank_size("ep", pg_collection)[1]
    stacked = [r.hf for r in bridge.family.layer_rules if isinstance(r, StackedExpertRule)]
    if ep > 1 and stacked:
        raise HFConversionError(
            f"exporting {bridge.architecture} with expert_model_parallel_size {ep} is not supported: its expert "
            f"tensors ({stacked[0]!r}, ...) hold every expert of a layer; export from expert parallelism 1, or save "
            "a distributed checkpoint and convert it with megatron-convert mcore-to-hf"
        )


def _gather_for(rule: Any, param: torch.Tensor, tp_rank: int, tp_size: int, group: Any) -> list[torch.Tensor] | None:
    """TP shards of ``param`` on TP rank 0; a replicated parameter needs only the local copy."""
    if isinstance(rule, Copy) and rule.tp_axis is None:
        return [param.detach()]
    return _gather(param, tp_rank, tp_size, group)
