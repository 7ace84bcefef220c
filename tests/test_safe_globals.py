"""megatron_core.safe_globals: torch's weights-only allow-list, SafeUnpickler, safe_numpy_load."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
import threading
from argparse import Namespace
from collections import OrderedDict

import numpy as np
import pytest
import torch

from megatron_core import safe_globals


class _Unsafe:
    def __init__(self, value):
        self.value = value


def test_import_registers_namespace_for_weights_only_loads():
    code = ("import io, argparse, torch, megatron_core\n"
            "b = io.BytesIO(); torch.save(argparse.Namespace(lr=0.1), b); b.seek(0)\n"
            "print(torch.load(b, weights_only=True).lr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.strip() == "0.1"


def test_register_safe_globals_adds_config_classes():
    from megatron_core.optimizer.optimizer_config import OptimizerConfig

    safe_globals.register_safe_globals()
    buffer = io.BytesIO()
    torch.save({"args": Namespace(x=1), "config": OptimizerConfig(lr=0.5)}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["config"].lr == 0.5 and loaded["args"].x == 1


def test_safe_unpickler_allows_plain_data_and_refuses_classes():
    data = {"key": [1, 2.0, True, b"b", "s"], "od": OrderedDict(a=1), "t": torch.arange(3)}
    loaded = safe_globals.SafeUnpickler(io.BytesIO(pickle.dumps(data))).load()
    assert loaded["key"] == data["key"] and loaded["od"] == data["od"] and torch.equal(loaded["t"], data["t"])
    with pytest.raises(pickle.UnpicklingError, match="Refusing to unpickle disallowed class"):
        safe_globals.SafeUnpickler(io.BytesIO(pickle.dumps(_Unsafe(1)))).load()


def test_safe_numpy_load_arrays_and_object_arrays(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(4, dtype=np.uint32))
    np.savez(tmp_path / "b.npz", a=np.ones(2), b=np.array([3, 4], dtype=np.int32))
    np.testing.assert_array_equal(safe_globals.safe_numpy_load(tmp_path / "a.npy"), np.arange(4))
    assert safe_globals.safe_numpy_load(tmp_path / "b.npz")["b"].tolist() == [3, 4]
    np.save(tmp_path / "bad.npy", np.array([_Unsafe(1)], dtype=object), allow_pickle=True)
    with pytest.raises(pickle.UnpicklingError):
        safe_globals.safe_numpy_load(tmp_path / "bad.npy", allow_pickle=True)
    assert pickle.load is not safe_globals._safe_pickle_load
    results = {}

    def load(i):
        results[i] = safe_globals.safe_numpy_load(tmp_path / "a.npy")

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert len(results) == 4 and all(r.tolist() == [0, 1, 2, 3] for r in results.values())
