"""Shared helpers of the tools' adversarial tests: directory fingerprints and a clean single-process env."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = str(REPO / "examples")


def fingerprint(root: str | os.PathLike) -> dict[str, str]:
    """Every entry under ``root`` (relative path -> SHA-256 of a file, ``dir`` or ``link``); {} when absent."""
    root = Path(root)
    if not root.exists():
        return {}
    if root.is_file():
        return {".": hashlib.sha256(root.read_bytes()).hexdigest()}
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "link"
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch) -> None:
    """The single-process launchers set RANK, WORLD_SIZE, ...; each test starts (and ends) without them."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME",
                 "MEGATRON_CLI_TRACEBACK"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def examples_path(monkeypatch):
    """``examples/`` importable (``pretrain_gpt``, ``main_job``, ``gpt_training``)."""
    monkeypatch.syspath_prepend(EXAMPLES)
    return EXAMPLES


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """A tiny Llama: ``(HF dir, checkpoint converted from it, an HF export of that checkpoint)``."""
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from megatron_core.models.hf.cli import main as convert
    from tests.models.hf.hf_models import make_hf_model

    root = tmp_path_factory.mktemp("convert")
    make_hf_model("llama", root / "hf")
    assert convert(["hf-to-mcore", "--hf", str(root / "hf"), "--out", str(root / "ckpt"), "--no-progress"]) == 0
    assert convert(["mcore-to-hf", "--mcore", str(root / "ckpt"), "--out", str(root / "export"),
                    "--no-progress"]) == 0
    return root / "hf", root / "ckpt", root / "export"
