"""The reference run behind the golden loss curve (section 7, check 8).

A 4-layer SwiGLU/RMSNorm GPT (hidden 32, vocab 64) trains 50 steps on one rank in deterministic
mode (``torch.use_deterministic_algorithms``, fixed seeds, data depending only on the step) with
the Megatron optimizer, scheduler and pipeline schedule. The per-step losses and grad norms are
stored as exact float hex strings per torch version and device kind, in
``tests/reliability/golden/loss_curve-torch<major.minor>-<device>.json`` (the device kind is the
CPU's vector capability, since CPU kernels differ between AVX2 and AVX-512, with ``_amd`` on AMD
CPUs (other kernels again), or ``cuda_<GPU name>`` when
the run is on a GPU: one rank under NCCL, fp32, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``); only
``python tools/golden_loss_curve.py [--device cuda] --write`` (re)writes them. On a device kind without its own
golden file the curve is compared with another device's golden of the same torch version within
5 % relative (section 7's tolerance for runs that are not bit-reproducible).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from megatron_core import parallel_state

STEPS = 50
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"


def device_kind() -> str:
    """Where the reference runs: ``cuda_<GPU name>`` when the process group is NCCL, else the CPU's
    vector capability (its kernels differ), e.g. ``cpu_avx512`` or ``cuda_nvidia_h100_80gb_hbm3``."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        kind = f"cuda_{torch.cuda.get_device_name()}"
    else:
        capability = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "default"
        # The math libraries pick other kernels on AMD CPUs of the same vector width: their own golden.
        kind = f"cpu_{capability}" + ("_amd" if _cpu_vendor() == "AuthenticAMD" else "")
    return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_")


def _cpu_vendor() -> str:
    """The CPU vendor string of ``/proc/cpuinfo`` (``GenuineIntel``, ``AuthenticAMD``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def torch_version() -> str:
    """``major.minor`` of the running torch."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def golden_path() -> Path:
    """The golden file of this torch version and device kind."""
    return GOLDEN_DIR / f"loss_curve-torch{torch_version()}-{device_kind()}.json"


def sibling_goldens() -> list[Path]:
    """Golden files of this torch version on other CPU kinds (compared within 5 % relative), those of this
    machine's vector capability first (another vendor's kernels of the same width are the nearest kin)."""
    own = device_kind().removesuffix("_amd")
    others = (p for p in GOLDEN_DIR.glob(f"loss_curve-torch{torch_version()}-cpu_*.json") if p != golden_path())
    return sorted(others, key=lambda p: (own not in p.name, p.name))


def run_curve(steps: int = STEPS) -> dict:
    """Train the reference config ``steps`` steps (needs torch.distributed on one rank); losses and grad norms."""
    from tests.dist_checkpointing.gpt_training import build, train_step

    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        chunks, optimizer, scheduler = build(1, 1, seed=2024)
        losses, norms = [], []
        optimizer_step = optimizer.step

        def step_and_record():  # the grad norm the step itself computed (before clipping)
            result = optimizer_step()
            norms.append(float(result[1]))
            return result

        optimizer.step = step_and_record
        for step in range(1, steps + 1):
            step_losses = train_step(chunks, optimizer, scheduler, step)
            losses.append(float(torch.stack(step_losses).mean()))
        return {"steps": steps, "lm_loss": [x.hex() for x in losses], "grad_norm": [x.hex() for x in norms]}
    finally:
        torch.use_deterministic_algorithms(previous)
        parallel_state.destroy_model_parallel()


def write_golden(curve: dict, path: Path | None = None) -> Path:
    """Write ``curve`` as this torch version's and device's golden file (``path``: that file, named while the
    run's process group still existed)."""
    path = path or golden_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"torch": torch.__version__, "device": path.stem.split("-", 2)[-1], **curve}
    path.write_text(json.dumps(body, indent=1) + "\n")
    return path
