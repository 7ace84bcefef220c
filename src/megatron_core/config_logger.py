"""Dump the arguments a module was built with to disk (Megatron-Core's ``config_logger``).

When a config's ``config_logger_dir`` is set, :func:`log_config_to_disk` writes a dict (typically a
constructor's ``locals()``) to ``<dir>/<prefix>.rank_<ranks>.iter<n>.json``, or ``.pth`` (``torch.save``) for
an ``OrderedDict`` such as a state dict. ``<ranks>`` is this process's ``tp_gtp_dp_cp_pp_ep`` ranks joined by
``_`` (``gtp`` is always 0 here) and ``<n>`` counts the dumps of that name in this process, from 0.
:class:`JSONEncoderWithMcoreTypes` writes what JSON cannot hold: modules as their children (a leaf as its
``repr``), dataclasses as dicts, dtypes, functions, classes, enums and process groups as strings.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import OrderedDict
from typing import Any

import torch

from megatron_core import parallel_state

__all__ = [
    "JSONEncoderWithMcoreTypes",
    "get_config_logger_path",
    "get_path_count",
    "get_path_with_count",
    "has_config_logger_enabled",
    "log_config_to_disk",
]

_PATH_COUNTS: dict[str, int] = {}


def get_config_logger_path(config: Any) -> str:
    """``config.config_logger_dir``, or ``''`` when the config has none."""
    return getattr(config, "config_logger_dir", "")


def has_config_logger_enabled(config: Any) -> bool:
    """Whether ``config`` asks for its modules' arguments to be dumped (a non-empty ``config_logger_dir``)."""
    return get_config_logger_path(config) != ""


def get_path_count(path: str) -> int:
    """How many times ``path`` was asked for before in this process (0 the first time)."""
    count = _PATH_COUNTS.get(path, 0)
    _PATH_COUNTS[path] = count + 1
    return count


def get_path_with_count(path: str) -> str:
    """``path`` with ``.iter<n>`` appended, ``n`` from :func:`get_path_count`."""
    return f"{path}.iter{get_path_count(path)}"


class JSONEncoderWithMcoreTypes(json.JSONEncoder):
    """A JSON encoder for the objects a model's constructor sees (see the module docstring)."""

    def default(self, o: Any) -> Any:
        """A JSON-serialisable stand-in for ``o``."""
        if isinstance(o, dict):
            return {k: self.default(v) for k, v in o.items()}
        if isinstance(o, (list, torch.nn.ModuleList)):
            return [self.default(v) for v in o]
        if isinstance(o, torch.dtype):
            return str(o)
        if type(o).__name__ == "Float16Module":  # keep the wrapper visible around the wrapped model
            return {"Float16Module": {"module": self.default(o.module)}}
        if isinstance(o, torch.nn.Module):
            children = dict(o.named_children())
            return {name: self.default(child) for name, child in children.items()} if children else str(o)
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            # Field by field, not dataclasses.asdict: that deep-copies every value (process groups cannot be).
            return {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
        if isinstance(o, (str, int, float, bool)) or o is None:
            return o
        return str(o)  # functions, classes, enums, process groups, anything else


def log_config_to_disk(config: Any, dict_data: dict, prefix: str = "", rank_str: str = "") -> None:
    """Write ``dict_data`` under ``config.config_logger_dir`` (see the module docstring).

    A ``self`` entry is dropped; an empty ``prefix`` becomes its class name. An empty ``rank_str`` becomes this
    process's parallel ranks.
    """
    directory = get_config_logger_path(config)
    if not directory:
        raise ValueError("log_config_to_disk needs config.config_logger_dir to be set (it is empty)")
    os.makedirs(directory, exist_ok=True)
    if "self" in dict_data:
        if prefix == "":
            prefix = type(dict_data["self"]).__name__
        del dict_data["self"]
    rank_str = rank_str or parallel_state.get_all_ranks()
    path = get_path_with_count(os.path.join(directory, f"{prefix}.rank_{rank_str}"))
    if isinstance(dict_data, OrderedDict):
        torch.save(dict_data, f"{path}.pth")
        return
    with open(f"{path}.json", "w") as f:
        json.dump(dict_data, f, cls=JSONEncoderWithMcoreTypes)
