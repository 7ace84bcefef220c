"""Section 7, check 15: a single-process run of the training example listens on 127.0.0.1 only.

``examples/gpt_training/distributed_init.init_distributed`` without torchrun's environment uses an
in-memory store (no rendezvous port) and binds gloo to the loopback interface; every listening TCP
socket of the process (read from ``/proc``) is on 127.0.0.1 or ::1. Multi-rank tests rendezvous
through a FileStore (``tests/dist_harness.py``) and launch torchrun on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = r'''
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "examples"))
from gpt_training.distributed_init import init_distributed
import torch.distributed as dist
print(json.dumps(init_distributed(1)))
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if target.startswith("socket:["):
        inodes.add(target[8:-1])
listening = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        lines = open(table).read().splitlines()[1:]
    except OSError:
        continue
    for line in lines:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:
            listening.append(fields[1])
print(json.dumps(listening))
dist.destroy_process_group()
'''


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs Linux /proc")
def test_single_process_run_listens_on_loopback_only() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    proc = subprocess.run([sys.executable, "-c", PROBE, str(REPO)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rank_world, listening = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    assert rank_world == [0, 1]
    loopback = ("0100007F", "00000000000000000000000001000000")
    assert all(address.split(":")[0] in loopback for address in listening), \
        f"listening sockets beyond loopback (hex address:port): {listening}"
