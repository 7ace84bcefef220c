"""Safe reading of NeMo ``.nemo`` archives: one member at a time, no path escapes, no arbitrary unpickling.

A ``.nemo`` file is an uncompressed tar holding ``model_config.yaml`` and ``model_weights.ckpt`` (usually as
``./<name>``). Members are found by base name while streaming (``tar.next()``, so a malformed tail after the wanted
members does not matter) and written by hand: only regular files whose path stays inside the output directory
(no absolute paths, no ``..``, no links or devices). Weights load with ``torch.load(weights_only=True)``; the YAML
with OmegaConf (interpolations resolved) or, without it, PyYAML's ``safe_load``.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any

import torch


def validate_archive(nemo_path: Path) -> None:
    """``FileNotFoundError`` / ``ValueError`` unless ``nemo_path`` is a tar file."""
    if not nemo_path.is_file():
        raise FileNotFoundError(f"No such file: {nemo_path}")
    if not tarfile.is_tarfile(nemo_path):
        raise ValueError(f"Expected a .nemo (tar) archive, got {nemo_path}; .pt/.bin/.ckpt files are not supported")


def _safe_destination(member: tarfile.TarInfo, out_dir: Path, archive: str) -> Path:
    if not member.isreg():
        raise ValueError(f"refusing archive member {member.name!r} of {archive}: not a regular file (a link, "
                         "directory or device)")
    parts = PurePosixPath(member.name.replace("\\", "/")).parts
    if not parts or member.name.startswith(("/", "\\")) or ".." in parts or os.path.isabs(member.name):
        raise ValueError(f"refusing archive member {member.name!r} of {archive}: its path leaves the extraction "
                         "directory")
    root = out_dir.resolve()
    destination = root.joinpath(*[part for part in parts if part != "."]).resolve()
    if root not in destination.parents:
        raise ValueError(f"refusing archive member {member.name!r} of {archive}: its path leaves the extraction "
                         "directory")
    return destination


def extract_member(tar: tarfile.TarFile, member_name: str, out_dir: str | Path) -> str:
    """Write the next member whose base name is ``member_name`` under ``out_dir``; its path.

    ``ValueError`` when the archive ends first (naming the members seen), is truncated, or the member is unsafe.
    """
    seen: list[str] = []
    try:
        while (member := tar.next()) is not None:
            seen.append(member.name)
            if PurePosixPath(member.name.replace("\\", "/")).name != member_name:
                continue
            destination = _safe_destination(member, Path(out_dir), str(tar.name))
            destination.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            with source, open(destination, "wb") as sink:
                shutil.copyfileobj(source, sink)
            if destination.stat().st_size != member.size:
                raise ValueError(f"archive member {member.name} of {tar.name} is truncated "
                                 f"({destination.stat().st_size} of {member.size} bytes)")
            return str(destination)
    except tarfile.ReadError as err:
        raise ValueError(f"archive {tar.name} ended unexpectedly while looking for {member_name}; members seen: "
                         f"{seen[:8]}") from err
    raise ValueError(f"archive {tar.name} has no {member_name}; members: {seen[:8]}")


def _has_interpolation(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(_has_interpolation(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_interpolation(v) for v in value)
    return False


def load_model_config(path: str | Path) -> dict[str, Any]:
    """The YAML at ``path`` as a plain dict, its ``model`` block when it has one, interpolations resolved."""
    try:
        from omegaconf import OmegaConf
    except ImportError:
        OmegaConf = None
    if OmegaConf is not None:
        cfg = OmegaConf.load(path)
        if "model" in cfg:
            cfg = cfg.model
        return OmegaConf.to_container(cfg, resolve=True)
    try:
        import yaml
    except ImportError as err:
        raise ImportError("reading a .nemo config needs omegaconf (or PyYAML): pip install omegaconf") from err
    with open(path, encoding="utf-8") as handle:
        cfg = yaml.safe_load(handle) or {}
    if isinstance(cfg, dict) and "model" in cfg:
        cfg = cfg["model"]
    if _has_interpolation(cfg):
        raise ImportError(f"{path} uses ${{...}} interpolations, which need omegaconf: pip install omegaconf")
    return cfg


def load_weights(path: str | Path) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU; ``ValueError`` when the file holds more than weights."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"{path} holds objects other than tensors and plain containers; refusing to unpickle it "
                         f"(weights_only=True): {err}") from err
