"""EnergyMonitor against a scripted NVML counter: laps, pauses, totals over 2 gloo ranks, error paths.

The 2-rank test runs the same script through Megatron-Core's own ``EnergyMonitor`` (the installed
megatron-core, given the same fake ``pynvml`` and a CPU stand-in for its CUDA tensors) as an oracle.
"""

from __future__ import annotations

import importlib.util
import types
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_core.energy_monitor import EnergyMonitor
from tests.dist_harness import run_on_ranks
from tests.fake_nvml import FakeNVML, install


def _script(monitor, fake: FakeNVML, scale: int = 1) -> dict[str, object]:
    """A training run's calls (setup, laps, an excluded evaluation) with the counter (mJ) set before each."""

    def at(counter_mj: int, call):
        fake.energy_mj = counter_mj * scale
        return call()

    at(1_000, monitor.setup)
    at(1_500, monitor.resume)                # measured from here
    lap1 = at(4_000, monitor.lap)            # 2_500 mJ
    at(5_000, monitor.pause)                 # +1_000 mJ, then evaluation (not measured)
    at(9_000, monitor.resume)
    lap2 = at(9_500, monitor.lap)            # 1_000 + 500 mJ
    total = monitor.get_total()
    monitor.shutdown()
    return {"laps": [lap1, lap2], "total": total, "live_inits": fake.live_inits}


def test_laps_and_total_in_joules_on_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNVML()
    install(monkeypatch, fake)
    assert _script(EnergyMonitor(), fake) == {"laps": [2.5, 1.5], "total": 4.0, "live_inits": 0}


def test_device_is_found_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNVML()
    install(monkeypatch, fake)
    monitor = EnergyMonitor()
    monitor.setup()
    monitor.setup()  # a second setup neither re-initialises NVML nor resets the baseline
    assert fake.calls == [("by_uuid", f"GPU-{FakeNVML.DEVICE_UUID}")]
    assert fake.live_inits == 1
    monitor.shutdown()
    assert fake.live_inits == 0


def _megatron_monitor(mp: pytest.MonkeyPatch):
    """Megatron-Core's EnergyMonitor bound to the fake ``pynvml`` now in sys.modules, its CUDA calls on CPU.

    Its file is loaded on its own (it imports only torch and pynvml), without megatron.core's heavy package.
    """
    package_dir = importlib.util.find_spec("megatron").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("megatron_energy_monitor_oracle",
                                                  Path(package_dir) / "core" / "energy_monitor.py")
    theirs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(theirs)
    assert theirs.has_nvml
    cpu_torch = types.SimpleNamespace(
        int64=torch.int64,
        tensor=lambda data, dtype, device: torch.tensor(data, dtype=dtype),
        cuda=types.SimpleNamespace(current_device=lambda: 0),
    )
    mp.setattr(theirs, "torch", cpu_torch)
    return theirs.EnergyMonitor()


def _both_monitors_on_rank() -> dict[str, dict[str, object]]:
    scale = dist.get_rank() + 1
    results = {}
    with pytest.MonkeyPatch.context() as mp:
        for name in ("ours", "megatron"):
            fake = FakeNVML()
            install(mp, fake)
            monitor = EnergyMonitor() if name == "ours" else _megatron_monitor(mp)
            results[name] = _script(monitor, fake, scale)
    return results


def test_laps_and_total_are_summed_over_ranks_like_megatron() -> None:
    # rank r's counter runs (r + 1) times as fast: laps 2.5 + 5.0 and 1.5 + 3.0 J, total 12 J on both ranks
    expected = {"laps": [7.5, 4.5], "total": 12.0, "live_inits": 0}
    for per_rank in run_on_ranks(2, _both_monitors_on_rank):
        assert per_rank == {"ours": expected, "megatron": expected}


def test_pause_twice_counts_the_interval_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNVML(energy_mj=100)
    install(monkeypatch, fake)
    monitor = EnergyMonitor()
    monitor.setup()
    monitor.resume()
    fake.energy_mj = 600
    monitor.pause()
    fake.energy_mj = 2_000
    monitor.pause()  # already paused: no second count
    assert monitor.lap() == 0.5  # a lap while paused closes what was measured, nothing of the pause
    fake.energy_mj = 3_000
    assert monitor.lap() == 0.0
    assert monitor.get_total() == 0.5


def test_failed_read_counts_zero_and_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNVML(energy_mj=0)
    install(monkeypatch, fake)
    monitor = EnergyMonitor()
    monitor.setup()
    monitor.resume()
    fake.energy_mj, fake.fail_reads = 1_000, True
    with pytest.warns(RuntimeWarning, match="reading the energy counter failed"):
        assert monitor.lap() == 0.0
    fake.fail_reads = False
    fake.energy_mj = 1_250  # measured from the last good reading (0): the failed interval is not lost
    assert monitor.lap() == 1.25


def test_without_setup_nothing_is_measured_even_without_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, None, cuda=False)
    monitor = EnergyMonitor()
    monitor.pause()  # Megatron's checkpoint save calls pause/resume whether or not energy is logged
    monitor.resume()
    assert (monitor.lap(), monitor.get_total()) == (0.0, 0.0)
    monitor.shutdown()


def test_setup_without_pynvml_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, None)
    with pytest.raises(ImportError, match=r"EnergyMonitor needs .*pynvml.*pip install nvidia-ml-py"):
        EnergyMonitor().setup()


def test_setup_without_cuda_device_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNVML()
    install(monkeypatch, fake, cuda=False)
    with pytest.raises(RuntimeError, match=r"EnergyMonitor needs a CUDA device"):
        EnergyMonitor().setup()
    assert fake.live_inits == 0


def test_setup_without_driver_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeNVML(init_fails=True))
    with pytest.raises(RuntimeError, match=r"could not start NVML \(NVML Shared Library Not Found\).*driver"):
        EnergyMonitor().setup()


def test_setup_with_unknown_device_releases_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNVML()
    install(monkeypatch, fake)
    other = types.SimpleNamespace(uuid=types.SimpleNamespace(bytes=uuid.UUID(int=7).bytes))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: other)
    with pytest.raises(RuntimeError, match=r"no device with UUID GPU-00000000-0000-0000-0000-000000000007"):
        EnergyMonitor().setup()
    assert fake.live_inits == 0

