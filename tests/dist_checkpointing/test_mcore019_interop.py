"""``torch_dist`` checkpoints interoperate with megatron-core 0.19 (live oracle, both directions).

megatron-core 0.19 keeps the common (non-tensor) state inside the DCP checkpoint as the byte
entry ``common_state/shard_0_1`` instead of a ``common.pt`` file. These tests run 0.19 itself
(tests/dist_checkpointing/mcore019_oracle.py, in its own processes) on 2 gloo ranks: it saves at
TP=1 and TP=2 and ours loads at both sizes (resharding), and ours saves and it loads, each
compared value by value. They are skipped unless 0.19 is available: ``MCORE019_PATH`` names an
unpacked 0.19 wheel, or megatron-core 0.19 is pip-installed. The committed checkpoint written by
0.19 (tests/data/mcore019_reference, test_mcore019_reference.py) covers 0.19 -> ours in CI.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_core import dist_checkpointing
from tests.dist_checkpointing import mcore019_oracle as oracle
from tests.dist_checkpointing import test_mcore_interop as interop
from tests.dist_harness import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
ORACLE = Path(oracle.__file__)


def _mcore019_source() -> str | None:
    """``MCORE019_PATH`` when it holds 0.19, ``""`` when 0.19 is pip-installed, else ``None``."""
    path = os.environ.get("MCORE019_PATH")
    if path and (Path(path) / "megatron" / "core" / "dist_checkpointing").is_dir():
        return path
    try:
        if importlib.metadata.version("megatron-core").startswith("0.19"):
            return ""
    except importlib.metadata.PackageNotFoundError:
        pass
    return None


SOURCE = _mcore019_source()
pytestmark = [
    pytest.mark.skipif(SOURCE is None, reason="megatron-core 0.19 not available (set MCORE019_PATH)"),
    pytest.mark.timeout(1200),  # each oracle run imports megatron-core in 2 fresh processes (~15 s on an idle machine)
]


def _run_oracle(mode: str, directory: Path, tp: int) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    command = [sys.executable, str(ORACLE), mode, str(directory), "--tp", str(tp)]
    if SOURCE:
        command += ["--mcore-path", SOURCE]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=str(ROOT), env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]


def _ours_save(directory: str, tp: int) -> None:
    rank = torch.distributed.get_rank()
    dist_checkpointing.save(oracle.build(dist_checkpointing, tp, rank, oracle.SCALE_OURS), directory)


def _ours_load(directory: str, tp: int, scale: float) -> list[str]:
    rank = torch.distributed.get_rank()
    sharded = oracle.build(dist_checkpointing, tp, rank, 0.0)
    loaded = dist_checkpointing.load(sharded, directory, strict="raise_all")
    return oracle.differences(loaded, oracle.expected_local(tp, rank, scale))


def _layout(directory: Path) -> dict:
    """Key -> (global shape, dtype, sorted chunks) for tensors, key -> "bytes" for byte entries."""
    metadata = FileSystemReader(str(directory)).read_metadata()
    out = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in item.chunks)
            out[key] = (tuple(item.size), str(item.properties.dtype), chunks)
        else:
            out[key] = "bytes"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("save_tp", [1, 2])
def test_megatron_core_019_checkpoint_loads_into_ours_at_tp1_and_tp2(tmp_path, save_tp):
    _run_oracle("save", tmp_path / "theirs", save_tp)
    assert not (tmp_path / "theirs" / "common.pt").exists()
    for load_tp in (1, 2):
        for problems in run_on_ranks(2, _ours_load, str(tmp_path / "theirs"), load_tp, oracle.SCALE_THEIRS):
            assert problems == [], (save_tp, load_tp, problems)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_our_checkpoint_loads_into_megatron_core_019_with_the_same_layout(tmp_path, tp):
    run_on_ranks(2, _ours_save, str(tmp_path / "ours"), tp)
    _run_oracle("verify", tmp_path / "ours", tp)
    other = 3 - tp
    _run_oracle("verify", tmp_path / "ours", other)  # resharded by 0.19 itself
    _run_oracle("save", tmp_path / "theirs", tp)
    assert _layout(tmp_path / "ours") == _layout(tmp_path / "theirs")
    assert sorted(p.name for p in (tmp_path / "theirs").iterdir()) == sorted(
        p.name for p in (tmp_path / "ours").iterdir() if p.name != "sha256_manifest.json"
    )


@pytest.mark.slow
def test_megatron_core_019_loads_our_gpt_checkpoints_at_tp2_and_tp1(tmp_path):
    """Our GPT-2-like and Llama-like models saved at TP=2 (0.19 layout) load into 0.19's GPTModel
    at TP=2 and TP=1 with the logits ours computed (1e-5)."""
    tp2 = [name for name in interop.NAMES if interop.MANIFEST["checkpoints"][name]["tp"] == 2]
    run_on_ranks(2, interop._save_ours, str(tmp_path), tp2, None)
    assert not any(tmp_path.glob("*/common.pt"))
    for tp in (2, 1):
        _run_oracle("gpt-verify", tmp_path, tp)
