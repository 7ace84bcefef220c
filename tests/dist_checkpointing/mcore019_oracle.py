"""megatron-core 0.19 as a live checkpoint oracle, run in its own processes (never by the library).

The 0.19 wheel is for CPython 3.12, but its ``dist_checkpointing`` is pure Python: unpack the
wheel (``unzip megatron_core-0.19.2-*.whl -d DIR``) and point ``MCORE019_PATH`` at ``DIR``, or
``pip install megatron_core-0.19.2-*.whl --no-deps`` into an environment with torch (then leave
``MCORE019_PATH`` unset). Inside these processes only, the few things 0.19 needs
that a CPU machine lacks are replaced: the Triton kernels module of its MoE paged stash (imported
at package import, unused here), ``torch.cuda.synchronize`` (called while staging a save) and
``torch.cuda.current_device`` (where its save places a failure flag for an all-reduce).

The checkpoint content is a plain sharded state dict built identically by either library
(:func:`build`): tensors split over the TP ranks on either axis, a replicated tensor, a tensor
with a prepended (layer-stacking) axis, one ShardedObject per rank, and common non-tensor data.

Usage (2 gloo ranks on 127.0.0.1 through a FileStore)::

    python tests/dist_checkpointing/mcore019_oracle.py save   DIR --tp 2   # 0.19 writes DIR
    python tests/dist_checkpointing/mcore019_oracle.py verify DIR --tp 1   # 0.19 loads DIR, compares
    python tests/dist_checkpointing/mcore019_oracle.py gpt-save DIR --tp 2     # GPT variants + logits
    python tests/dist_checkpointing/mcore019_oracle.py gpt-verify DIR --tp 1   # DIR/manifest.json's GPTs

The GPT modes reuse tools/make_mcore_reference_checkpoints.py's model variants and fixed input.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import types
from datetime import timedelta
from typing import Any

import torch

WORLD = 2
TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "make_mcore_reference_checkpoints.py")
SCALE_OURS, SCALE_THEIRS = 2.0, 1.0
RANDN_KERNEL_ATOL = 1e-5  # randn's kernel sets differ by up to 2.2e-6 (see ``differences``); times the scale 2
"""``build(..., scale)``: the values each writer saves differ, so neither check is vacuous."""


def import_mcore019(path: str | None) -> Any:
    """``megatron.core.dist_checkpointing`` of 0.19 (from ``path`` when given), CPU-only stand-ins set."""
    if path:
        sys.path.insert(0, path)
    stash = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
    stash.GLOBAL_BLOCK_SIZE, stash.paged_stash_copy_kernel, stash.paged_stash_pop_kernel = 1024, None, None
    sys.modules.setdefault(stash.__name__, stash)
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"  # a gloo all_reduce of a failure flag is placed there
    import megatron.core
    from megatron.core import dist_checkpointing

    version = getattr(megatron.core, "__version__", "")
    if not str(version).startswith("0.19"):
        raise RuntimeError(f"megatron.core {version} found at {megatron.core.__file__}; need 0.19")
    return dist_checkpointing


def _global(name: str, shape: tuple[int, ...], scale: float) -> torch.Tensor:
    seed = sum(ord(c) for c in name)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def build(dc: Any, tp: int, rank: int, scale: float) -> dict:
    """The sharded state dict of ``rank`` (of 2) at TP size ``tp``, in library ``dc``'s classes."""
    tp_rank, dp_rank = rank % tp, rank // tp
    col = _global("col", (8, 6), scale)
    row = _global("row", (4, 10), scale)
    rep = _global("rep", (5,), scale)
    stacked = _global("stacked", (3, 4, 6), scale)  # 3 layers, each split on its first axis
    st = dc.ShardedTensor
    state = {
        "layer": {
            "col.weight": st.from_rank_offsets("model.col.weight", col.chunk(tp, 0)[tp_rank].clone(),
                                               (0, tp_rank, tp), replica_id=dp_rank),
            "row.weight": st.from_rank_offsets("model.row.weight", row.chunk(tp, 1)[tp_rank].clone(),
                                               (1, tp_rank, tp), replica_id=dp_rank),
            "norm.weight": st.from_rank_offsets("model.norm.weight", rep.clone(), replica_id=rank),
        },
        "layers": [
            st.from_rank_offsets("model.layers.weight", stacked[i].chunk(tp, 0)[tp_rank].clone(),
                                 (0, i, 3), (1, tp_rank, tp), replica_id=dp_rank, prepend_axis_num=1)
            for i in range(3)
        ],
        "rng": dc.ShardedObject("rng_state", {"rank": rank, "seed": 1234 + rank, "scale": scale}, (WORLD,), (rank,),
                                replica_id=0),
        "iteration": 7,
        "args": {"lr": 3e-4 * scale, "name": "gpt", "sizes": [1, 2, 3]},
        "common_tensor": torch.arange(4) * int(scale),
    }
    return state


def expected_local(tp: int, rank: int, scale: float) -> dict:
    """What loading at TP ``tp`` on ``rank`` must return: ``build``'s values as plain data."""
    tp_rank = rank % tp
    col, row = _global("col", (8, 6), scale), _global("row", (4, 10), scale)
    stacked = _global("stacked", (3, 4, 6), scale)
    return {
        "layer": {"col.weight": col.chunk(tp, 0)[tp_rank], "row.weight": row.chunk(tp, 1)[tp_rank],
                  "norm.weight": _global("rep", (5,), scale)},
        "layers": [stacked[i].chunk(tp, 0)[tp_rank] for i in range(3)],
        "rng": {"rank": rank, "seed": 1234 + rank, "scale": scale},
        "iteration": 7,
        "args": {"lr": 3e-4 * scale, "name": "gpt", "sizes": [1, 2, 3]},
        "common_tensor": torch.arange(4) * int(scale),
    }


def differences(got: Any, want: Any, where: str = "") -> list[str]:
    """Human-readable differences between a loaded state dict and the expected one."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{where}: keys {sorted(got) if isinstance(got, dict) else type(got)} != {sorted(want)}"]
        return [d for k in want for d in differences(got[k], want[k], f"{where}.{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{where}: {type(got).__name__} of {len(got) if isinstance(got, list) else '?'} != list of {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{where}[{i}]")]
    if isinstance(want, torch.Tensor):
        # The expected values are regenerated with torch.randn, whose scalar kernel (ATEN_CPU_CAPABILITY=default)
        # rounds Box-Muller's log/cos differently from the vectorized ones that wrote the stored files: measured
        # up to 2.2e-6 apart over 10^6 samples (|x| <= 5.1), most entries bit-equal. A wrong shard, slice or
        # transpose moves entries by O(1) (values are N(0, 1) times a scale of 1 or 2), far above this bound.
        if (not isinstance(got, torch.Tensor) or got.shape != want.shape
                or not torch.allclose(got.cpu(), want, rtol=0.0, atol=RANDN_KERNEL_ATOL)):
            return [f"{where}: {got!r} != {want!r}"]
        return []
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


def _reference_tool() -> Any:
    """tools/make_mcore_reference_checkpoints.py (model variants, fixed input, CPU stand-ins)."""
    spec = importlib.util.spec_from_file_location("make_mcore_reference_checkpoints", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_manifest(tool: Any, directory: str, tp: int) -> None:
    """``manifest.json`` in tests/data/mcore_reference's format, adding this TP size's entries."""
    import megatron.core

    path = os.path.join(directory, "manifest.json")
    manifest = {
        "writer": f"megatron-core {megatron.core.__version__}", "torch": torch.__version__, "seed": tool.SEED,
        "vocab_size": tool.VOCAB, "max_sequence_length": tool.MAX_SEQ,
        "input": {"batch": tool.BATCH, "sequence_length": tool.SEQ, "token_seed": 7},
        "variants": tool.VARIANTS, "checkpoints": {},
    }
    if os.path.exists(path):
        with open(path, encoding="utf-8") as stream:
            manifest["checkpoints"] = json.load(stream)["checkpoints"]
    for variant in tool.VARIANTS:
        manifest["checkpoints"][f"{variant}_tp{tp}"] = {"variant": variant, "tp": tp,
                                                        "logits": f"{variant}_tp{tp}_logits.pt"}
    with open(path, "w", encoding="utf-8") as stream:
        json.dump(manifest, stream, indent=2)


def _gpt(rank: int, mode: str, directory: str, tp: int) -> None:
    """Save (``gpt-save``) or load and check (``gpt-verify``) each GPT variant at TP ``tp`` with 0.19."""
    from megatron.core import dist_checkpointing, parallel_state

    tool = _reference_tool()
    tool._neutralise_cuda_only_calls()
    parallel_state.initialize_model_parallel(tp, 1)
    try:
        if mode == "gpt-save":
            for variant in tool.VARIANTS:
                name = f"{variant}_tp{tp}"
                model = tool._build_mcore_model(tool.VARIANTS[variant], tp)
                logits = tool._full_logits(model)
                os.makedirs(os.path.join(directory, name), exist_ok=True)
                dist_checkpointing.save(model.sharded_state_dict(), os.path.join(directory, name))
                if rank == 0:
                    torch.save(logits, os.path.join(directory, f"{name}_logits.pt"))
            if rank == 0:
                _write_manifest(tool, directory, tp)
            return
        with open(os.path.join(directory, "manifest.json"), encoding="utf-8") as stream:
            entries = json.load(stream)["checkpoints"]
        for name, entry in sorted(entries.items()):
            model = tool._build_mcore_model(tool.VARIANTS[entry["variant"]], tp)
            state = dist_checkpointing.load(model.sharded_state_dict(), os.path.join(directory, name),
                                            strict="raise_all")
            model.load_state_dict(state)
            expected = torch.load(os.path.join(directory, entry["logits"]), weights_only=True)
            error = (tool._full_logits(model) - expected).abs().max().item()
            if not error < 1e-5:
                raise AssertionError(f"{name}: megatron-core 0.19 logits differ by {error:.2e}")
            if rank == 0:
                print(f"{name}: megatron-core 0.19 loaded it at TP={tp}; max |logit diff| = {error:.2e}")
    finally:
        parallel_state.destroy_model_parallel()


def _rank_main(rank: int, mode: str, directory: str, tp: int, store: str, path: str | None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world = tp if mode.startswith("gpt") else WORLD
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.FileStore(store, world), rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        dc = import_mcore019(path)
        if mode.startswith("gpt"):
            _gpt(rank, mode, directory, tp)
        elif mode == "save":
            dc.save(build(dc, tp, rank, SCALE_THEIRS), directory)
        else:
            sharded = build(dc, tp, rank, 0.0)
            loaded = dc.load(sharded, directory, strict="raise_all")
            problems = differences(loaded, expected_local(tp, rank, SCALE_OURS))
            if problems:
                raise AssertionError(f"rank {rank}: megatron-core 0.19 loaded different values: {problems}")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Command line: ``save`` or ``verify`` a checkpoint directory with megatron-core 0.19 on 2 ranks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("save", "verify", "gpt-save", "gpt-verify"))
    parser.add_argument("directory")
    parser.add_argument("--tp", type=int, choices=(1, 2), default=2)
    parser.add_argument("--mcore-path", default=os.environ.get("MCORE019_PATH"),
                        help="unpacked 0.19 wheel (default $MCORE019_PATH); omit when it is pip-installed")
    args = parser.parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU tensors and gloo, also on a GPU machine
    if args.mode.endswith("save"):
        os.makedirs(args.directory, exist_ok=True)  # megatron-core saves into an existing directory
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(
            _rank_main, args=(args.mode, args.directory, args.tp, os.path.join(tmp, "store"), args.mcore_path),
            nprocs=args.tp if args.mode.startswith("gpt") else WORLD, join=True,
        )
    print(f"megatron-core 0.19 {args.mode} {args.directory} at TP={args.tp}: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
