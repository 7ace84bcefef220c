"""``benchmarks/scaling.py``, ``nccl_layout_parity.py`` and ``nccl_bandwidth.py`` keep working: CPU (gloo) dry runs.

The GPU sweep runs only on a lent multi-GPU machine; these tests run the same launcher, flags and
summaries on 2 CPU ranks with tiny models, so the scripts do not rot between GPU sessions.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_monitor  # noqa: E402
import nccl_bandwidth  # noqa: E402
import nccl_layout_parity  # noqa: E402
import scaling  # noqa: E402

from tests import ports  # noqa: E402
from tests.dist_harness import run_on_ranks  # noqa: E402


@pytest.fixture(autouse=True)
def _race_free_master_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks' torchrun jobs (``scaling.start_torchrun``, also behind ``nccl_layout_parity``) take their
    ``--master-port`` from this worker's slice below the ephemeral range, not from a closed port-0 socket."""
    monkeypatch.setattr(scaling, "free_port", ports.free_port)


def test_theoretical_bubble_of_both_schedules() -> None:
    assert scaling.theoretical_bubble(scaling.LAYOUTS["pp2_1f1b"], 8) == pytest.approx(1 / 9)
    assert scaling.theoretical_bubble(scaling.LAYOUTS["pp2_interleaved"], 8) == pytest.approx(1 / 17)
    assert scaling.theoretical_bubble(scaling.LAYOUTS["pp4_interleaved"], 8) == pytest.approx(3 / 19)
    assert scaling.theoretical_bubble(scaling.LAYOUTS["dp2_ddp"], 8) is None


def test_layout_flags_and_sizes() -> None:
    pp4 = scaling.LAYOUTS["pp4_interleaved"]
    assert pp4.dp == 1
    assert pp4.parallel_flags(22) == ["--pipeline-model-parallel-size", "4", "--account-for-embedding-in-pipeline-split",
                                      "--account-for-loss-in-pipeline-split",
                                      "--num-layers-per-virtual-pipeline-stage", "3"]
    ep2 = scaling.LAYOUTS["ep2"]
    assert ep2.dp == 2 and ep2.parallel_flags(8) == ["--expert-model-parallel-size", "2"]
    for name in scaling.DEFAULT_2GPU + scaling.DEFAULT_4GPU:
        layout = scaling.LAYOUTS[name]
        for configs in (scaling.GPU_CONFIGS, scaling.CPU_CONFIGS):
            cfg = configs[layout.config]
            accounted = cfg.layers + (2 if layout.pp > 1 else 0)  # embedding and loss count as layers
            assert accounted % (layout.pp * (layout.vp or 1)) == 0, (name, cfg.layers)
            assert accounted // (layout.pp * (layout.vp or 1)) >= 2, (name, cfg.layers)  # no empty chunk


def test_llama8b_estimate_fits_two_h200s_without_recompute() -> None:
    est = scaling.llama8b_memory_gb([], tp=2, dp=1, mbs=1, seq=4096)
    assert est["params per GPU (B)"] == pytest.approx(8.03 / 2, rel=0.01)  # Llama-3-8B: 8.03 B parameters
    assert est["weights+grads+optimizer GB"] == pytest.approx(est["params per GPU (B)"] * 18, rel=1e-6)
    assert 80 < est["total GB"] < 0.85 * 139


def test_nccl_transports_are_read_from_the_log() -> None:
    log = ("rank0 NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
           "rank1 NCCL INFO Channel 01/0 : 1[1] -> 0[0] via SHM/direct/direct\n"
           "rank0 NCCL INFO Channel 02/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n")
    assert scaling.nccl_transports(log) == ["P2P/CUMEM/read", "SHM/direct/direct"]
    assert scaling.nccl_transports("no NCCL here") == []
    assert scaling.child_env(cpu=False).get("NCCL_DEBUG") is not None
    assert "NCCL_DEBUG" not in scaling.child_env(cpu=True) or scaling.child_env(cpu=True)["NCCL_DEBUG"] == \
        scaling.os.environ.get("NCCL_DEBUG")


def test_parity_layouts_of_two_and_four_ranks() -> None:
    assert nccl_layout_parity.DEFAULT_2GPU == ["tp2_sp", "pp2", "pp2_vp2", "dp2", "cp2", "ep2"]
    assert set(nccl_layout_parity.DEFAULT_4GPU) == {"dp4", "tp4_sp", "tp2_pp2", "pp4", "pp4_vp2", "cp4", "ep4"}


def test_relative_error() -> None:
    assert nccl_layout_parity.relative_error([3.0, 4.0], [3.0, 4.0]) == 0.0
    assert nccl_layout_parity.relative_error([3.0, 4.0 + 0.5], [3.0, 4.0]) == pytest.approx(0.1)
    assert math.isinf(nccl_layout_parity.relative_error([3.0], [3.0, 4.0]))
    assert math.isinf(nccl_layout_parity.relative_error([float("nan"), 4.0], [3.0, 4.0]))


@pytest.mark.slow
def test_scaling_dry_run_tp2_sp_and_loaded_baseline_on_cpu(tmp_path: Path, capsys) -> None:
    # One sweep of a layout of the dense config with its one-rank baseline and its loaded copy (four jobs).
    code = scaling.main(["--device", "cpu", "--layouts", "tp2_sp", "--loaded-baseline", "--out",
                         str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed[-3000:]
    rows = json.loads((tmp_path / "scaling.json").read_text())["rows"]
    assert [r["layout"] for r in rows] == ["dense_1gpu", "dense_1gpu_x2", "tp2_sp"]
    base, loaded, tp = rows
    assert base["gpus"] == 1 and tp["gpus"] == 2 and tp["tp"] == 2
    for row in (base, tp):
        assert row["ms/step"] > 0 and row["compute ms"] > 0 and row["fwd-bwd ms"] >= row["compute ms"] * 0.5
        assert len(row["losses"]) == 2 and all(math.isfinite(x) for x in row["losses"])
    assert tp["efficiency %"] == pytest.approx(100 * tp["tokens/s/GPU"] / base["tokens/s/GPU"])
    # Weights initialised on the device (per-rank RNG streams), same data: a close first loss.
    assert tp["losses"][0] == pytest.approx(base["losses"][0], rel=5e-2)
    assert "| tp2_sp | 2 |" in printed and "| dense_1gpu | 1 |" in printed

    # The loaded baseline: the one-rank job on both ranks at once, as two independent jobs.
    assert loaded["loaded baseline"] and loaded["gpus"] == 2
    low, high = loaded["ms/step range"]
    assert 0 < low <= loaded["ms/step"] <= high
    for gpu in range(2):  # two independent jobs, each logged on its own
        assert len(scaling.train_records(tmp_path / f"dense_1gpu_x2.gpu{gpu}.jsonl")) == 2
    assert tp["efficiency vs loaded %"] == pytest.approx(100 * tp["tokens/s/GPU"] / loaded["tokens/s/GPU"])
    assert "| dense_1gpu_x2 | 2 |" in printed and "eff. vs loaded GPU" in printed


def test_sweep_without_loaded_baseline_runs_the_baseline_then_the_layout(tmp_path: Path, monkeypatch,
                                                                         capsys) -> None:
    # Which jobs a sweep starts (the jobs themselves are the dry run above): no loaded copy unless asked.
    started = []

    def fake_run_one(args, name, layout, cfg, extra, out):
        started.append((name, layout.gpus))
        return {"layout": name, "gpus": layout.gpus, "config": layout.config, "pp": layout.pp, "error": "not run"}

    def no_loaded_baseline(*args, **kwargs):
        raise AssertionError("the loaded baseline ran without --loaded-baseline")

    monkeypatch.setattr(scaling, "run_one", fake_run_one)
    monkeypatch.setattr(scaling, "run_loaded_baseline", no_loaded_baseline)
    assert scaling.main(["--device", "cpu", "--layouts", "tp2_sp", "--out", str(tmp_path)]) == 1
    capsys.readouterr()
    assert started == [("dense_1gpu", 1), ("tp2_sp", 2)]
    rows = json.loads((tmp_path / "scaling.json").read_text())["rows"]
    assert [r["layout"] for r in rows] == ["dense_1gpu", "tp2_sp"]


@pytest.mark.slow
def test_parity_dry_run_interleaved_pp2_on_cpu(tmp_path: Path, capsys) -> None:
    # Interleaved PP: each model chunk must read every micro-batch (it once shared one iterator: 1e-3 off).
    code = nccl_layout_parity.main(["--device", "cpu", "--layouts", "pp2_vp2", "--steps", "2", "--out",
                                    str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed[-3000:]
    (row,) = json.loads((tmp_path / "parity.json").read_text())["rows"]
    assert row["passed"] and row["loss_rel_err"] <= 1e-5  # fp32 on CPU: far inside the bf16 tolerance
    assert len(row["losses"]) == 2
    assert "| pp2_vp2 |" in printed


def test_gpu_samples_are_summarized_over_busy_samples_per_gpu() -> None:
    fields = (*gpu_monitor.FIELDS, gpu_monitor.REASONS_FIELD)
    lines = ["0, 0, 345, 80.5, 30, 0x0000000000000001",     # idle before the run: left out
             "0, 100, 1980, 650.0, 55, 0x0000000000000000",
             "0, 98, 1755, 700.0, 61, 0x0000000000000004",  # software power cap
             "0, 99, 1900, 690.0, 60, 0x0000000000000000",
             "1, 100, 1980, 600.0, 50, 0x0000000000000000",
             "1, [N/A], 1980, 600.0, 50, 0x0000000000000000",  # unreadable utilization: left out
             "garbage line"]
    samples = [dict(zip(fields, (v.strip() for v in line.split(",")))) for line in lines
               if len(line.split(",")) == len(fields)]
    summary = gpu_monitor.summarize_samples(samples)
    assert summary["0"] == {"busy samples": 3, "SM MHz": 1900.0, "W": 690.0, "max C": 61.0,
                            "reasons": ["software power cap"]}
    assert summary["1"]["busy samples"] == 1 and summary["1"]["reasons"] == []
    assert gpu_monitor.describe(summary) == "gpu0 1900 MHz 690 W 61 C [software power cap]; gpu1 1980 MHz 600 W 50 C"
    assert gpu_monitor.reason_names(0x1 | 0x40 | 0x80) == ["hardware thermal", "power brake"]


def test_gpu_monitor_is_a_no_op_without_nvidia_smi(tmp_path: Path) -> None:
    with gpu_monitor.GpuMonitor(tmp_path / "gpus.csv", enabled=False) as monitor:
        pass
    assert monitor.summarize() == {} and not (tmp_path / "gpus.csv").exists()


def _bandwidth_rows() -> list[dict]:
    import torch

    return nccl_bandwidth.measure([0.25, 1.0], torch.device("cpu"), warmup=1, iters=2)


def test_collective_bandwidth_on_two_gloo_ranks() -> None:
    assert nccl_bandwidth.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert nccl_bandwidth.bus_factor("all_gather", 4) == pytest.approx(0.75)
    rows = run_on_ranks(2, _bandwidth_rows)[0]
    # gloo has no single-tensor reduce-scatter: all-reduce and all-gather, two sizes each.
    assert [(r["collective"], r["MB"]) for r in rows] == [("all_reduce", 0.25), ("all_reduce", 1.0),
                                                          ("all_gather", 0.25), ("all_gather", 1.0)]
    for row in rows:
        assert row["ms"] > 0
        assert row["algbw GB/s"] == pytest.approx(row["MB"] * 2**20 / (row["ms"] / 1e3) / 1e9)
        assert row["busbw GB/s"] == pytest.approx(row["algbw GB/s"] * nccl_bandwidth.bus_factor(row["collective"], 2))
