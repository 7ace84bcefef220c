"""set_ideal_affinity_for_current_gpu with a fake NVML: the mask it decodes, the set it applies, its errors."""

from __future__ import annotations

import os

import pytest

from megatron_core._nvml import BITS_PER_MASK_WORD, cpu_set_from_mask
from megatron_core.pipeline_parallel import cpu_affinity
from megatron_core.pipeline_parallel.utils import set_ideal_affinity_for_current_gpu
from tests.fake_nvml import FakeNVML, install


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")  # the log line goes to rank 0; no process group in these tests


def _record_setaffinity(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, set[int]]]:
    calls: list[tuple[int, set[int]]] = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append((pid, set(cpus))))
    return calls


def test_mask_words_decode_to_cpu_ids() -> None:
    assert cpu_set_from_mask([0b1010_0000_0000_0101, 0b1000], 64) == {0, 2, 13, 15, 67}
    assert cpu_set_from_mask([0x3, 0x3], 32) == {0, 1, 32, 33}  # the example in NVML's documentation
    assert cpu_set_from_mask([0, 0]) == set()


def test_sets_the_gpus_cpus_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNVML(cpu_mask_words=(0b1111_0000, 1 << (BITS_PER_MASK_WORD - 1)))
    install(monkeypatch, fake)
    calls = _record_setaffinity(monkeypatch)
    expected = {4, 5, 6, 7, 2 * BITS_PER_MASK_WORD - 1}
    assert set_ideal_affinity_for_current_gpu() == expected
    assert calls == [(0, expected)]
    n_cpus = max([os.cpu_count() or 1, *(c + 1 for c in os.sched_getaffinity(0))])
    assert fake.calls == [("by_uuid", f"GPU-{FakeNVML.DEVICE_UUID}"),
                          ("cpu_affinity", -(-n_cpus // BITS_PER_MASK_WORD))]
    assert fake.live_inits == 0


def test_applies_for_real_when_the_mask_is_the_current_set(monkeypatch: pytest.MonkeyPatch) -> None:
    current = os.sched_getaffinity(0)
    words = [0] * (max(current) // BITS_PER_MASK_WORD + 1)
    for cpu in current:
        words[cpu // BITS_PER_MASK_WORD] |= 1 << (cpu % BITS_PER_MASK_WORD)
    install(monkeypatch, FakeNVML(cpu_mask_words=tuple(words)))
    assert set_ideal_affinity_for_current_gpu() == current
    assert os.sched_getaffinity(0) == current


def test_logs_on_rank_zero(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    install(monkeypatch, FakeNVML(cpu_mask_words=(1,)))
    _record_setaffinity(monkeypatch)
    with caplog.at_level("WARNING", logger=cpu_affinity.logger.name):
        set_ideal_affinity_for_current_gpu()
    assert "nearest CPUs" in caplog.text


def test_empty_mask_raises_and_sets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNVML(cpu_mask_words=())
    install(monkeypatch, fake)
    calls = _record_setaffinity(monkeypatch)
    with pytest.raises(RuntimeError, match="NVML reports no CPU affinity"):
        set_ideal_affinity_for_current_gpu()
    assert calls == [] and fake.live_inits == 0


def test_without_pynvml_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, None)
    calls = _record_setaffinity(monkeypatch)
    with pytest.raises(ImportError, match="set_ideal_affinity_for_current_gpu needs .*pip install nvidia-ml-py"):
        set_ideal_affinity_for_current_gpu()
    assert calls == []


def test_without_cuda_device_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeNVML(cpu_mask_words=(1,)), cuda=False)
    calls = _record_setaffinity(monkeypatch)
    with pytest.raises(RuntimeError, match="set_ideal_affinity_for_current_gpu needs a CUDA device"):
        set_ideal_affinity_for_current_gpu()
    assert calls == []


def test_without_driver_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeNVML(init_fails=True))
    with pytest.raises(RuntimeError, match="could not start NVML"):
        set_ideal_affinity_for_current_gpu()
