"""A scripted stand-in for the ``pynvml`` module, and a pretend current CUDA device, for CPU tests.

``install(mp, fake)`` puts ``fake`` in ``sys.modules["pynvml"]`` and makes the library believe a CUDA
device with UUID ``FakeNVML.DEVICE_UUID`` is current; ``mp`` is a ``pytest.MonkeyPatch``, so all of it
is undone afterwards. The energy counter is a value the test sets (``fake.energy_mj``), read by every
``nvmlDeviceGetTotalEnergyConsumption`` call; ``fake.fail_reads`` makes reads raise ``NVMLError``.
"""

from __future__ import annotations

import sys
import types
import uuid

import pytest
import torch


class FakeNVMLError(Exception):
    """The fake module's ``NVMLError``."""


class FakeNVML(types.ModuleType):
    """Implements the pynvml calls the library makes, with state the test controls and inspects."""

    DEVICE_UUID = uuid.UUID("12345678-9abc-def0-1234-56789abcdef0")
    NVMLError = FakeNVMLError

    def __init__(self, energy_mj: int = 0, cpu_mask_words: tuple[int, ...] = (), init_fails: bool = False) -> None:
        super().__init__("pynvml")
        self.energy_mj = energy_mj
        self.cpu_mask_words = cpu_mask_words
        self.init_fails = init_fails
        self.fail_reads = False
        self.live_inits = 0
        self.calls: list[tuple] = []

    def nvmlInit(self) -> None:
        if self.init_fails:
            raise FakeNVMLError("NVML Shared Library Not Found")
        self.live_inits += 1

    def nvmlShutdown(self) -> None:
        self.live_inits -= 1

    def nvmlDeviceGetHandleByUUID(self, device_uuid: str) -> str:
        self.calls.append(("by_uuid", device_uuid))
        if device_uuid != f"GPU-{self.DEVICE_UUID}":
            raise FakeNVMLError("Not Found")
        return "handle-0"

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.calls.append(("by_index", index))
        return "handle-0"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:
        assert handle == "handle-0"
        if self.fail_reads:
            raise FakeNVMLError("Unknown Error")
        return self.energy_mj

    def nvmlDeviceGetCpuAffinity(self, handle: str, cpu_set_size: int) -> list[int]:
        assert handle == "handle-0"
        self.calls.append(("cpu_affinity", cpu_set_size))
        return list(self.cpu_mask_words) + [0] * (cpu_set_size - len(self.cpu_mask_words))


def install(mp: pytest.MonkeyPatch, fake: FakeNVML | None, cuda: bool = True) -> None:
    """``fake`` as ``pynvml`` (``None``: pynvml not installed); with ``cuda``, a current CUDA device 0."""
    from megatron_core import _nvml

    mp.setitem(sys.modules, "pynvml", fake)
    mp.setattr(_nvml, "cuda_available", lambda: cuda)
    if cuda:
        props = types.SimpleNamespace(uuid=types.SimpleNamespace(bytes=FakeNVML.DEVICE_UUID.bytes))
        mp.setattr(torch.cuda, "current_device", lambda: 0)
        mp.setattr(torch.cuda, "get_device_properties", lambda index: props)
