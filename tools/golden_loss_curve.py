"""Check, or (with ``--write``) regenerate, the golden loss curve of this torch version and device kind.

    python tools/golden_loss_curve.py           # run the 50-step reference and compare exactly
    python tools/golden_loss_curve.py --write   # the explicit, reviewed step that (re)writes the golden file
    python tools/golden_loss_curve.py --device cuda [--write]   # the same on this GPU (one rank, NCCL, fp32)

The reference run and the file layout are described in ``tests/reliability/golden_run.py``; the
test ``tests/reliability/test_golden_loss_curve.py`` performs the comparison in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO)]

import torch.distributed as dist  # noqa: E402

from tests.reliability.golden_run import golden_path, run_curve, write_golden  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Run the reference; write the golden file with ``--write``, else compare and report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="(re)write the golden file of this torch and device")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: run on the current GPU (one rank under NCCL) against that GPU kind's golden")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; before CUDA starts
    with tempfile.TemporaryDirectory() as tmp:
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1,
                                timeout=timedelta(seconds=60))
        try:
            curve = run_curve()
            path = golden_path()  # depends on the process group's backend
        finally:
            dist.destroy_process_group()
    if args.write:
        print(f"wrote {write_golden(curve, path)}")
        return 0
    if not path.is_file():
        print(f"no golden file {path}; create it with --write")
        return 1
    golden = json.loads(path.read_text())
    same = golden["lm_loss"] == curve["lm_loss"] and golden["grad_norm"] == curve["grad_norm"]
    print(f"{path.name}: {'identical' if same else 'DIFFERENT'} over {curve['steps']} steps")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
