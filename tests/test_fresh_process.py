"""``tests.cuda_process_group.in_fresh_process`` (the GPU tests' fresh-process runner) on the CPU, without its NCCL
group: the result comes back, an exception comes back as text, a hung child is killed at its timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.cuda_process_group import in_fresh_process


def _double(t: torch.Tensor) -> dict:
    return {"twice": t * 2, "pid": os.getpid()}


def _fail() -> None:
    raise ValueError("raised in the child")


def _hang() -> None:
    time.sleep(600)


def test_the_result_comes_back_from_another_process():
    got = in_fresh_process(_double, torch.arange(3.0), nccl_group=False, timeout=120)
    assert torch.equal(got["twice"], torch.tensor([0.0, 2.0, 4.0])) and got["pid"] != os.getpid()


def test_an_exception_comes_back_with_the_childs_traceback():
    with pytest.raises(RuntimeError, match="(?s)in the fresh process.*ValueError: raised in the child"):
        in_fresh_process(_fail, nccl_group=False, timeout=120)


def test_a_hung_child_is_killed_at_its_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="_hang did not finish within 5 s"):
        in_fresh_process(_hang, nccl_group=False, timeout=5)
    assert time.monotonic() - start < 60  # killed at the timeout
