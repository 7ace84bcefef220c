"""``--seed`` decides the example's initial weights on a GPU too.

``--use-cpu-initialization`` (the default) builds the weights with the CPU generator. On a CPU,
``model_parallel_cuda_manual_seed`` seeds that generator (it is the device's); on a GPU it seeds only the device
generator, so ``setup`` must seed the CPU one itself, as Megatron-LM's training setup does (found on an H100: two
plain runs of ``pretrain_gpt.py --bf16`` started from different weights). Here the GPU branch of the seeding is taken
on the CPU (the device seeding a no-op), with the CPU generator scrambled between two setups.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_core import device, parallel_state
from megatron_core.tensor_parallel import random as tp_random
from tests.examples.test_full_iteration_flag import _args, _examples_on_path


def _initial_weights(seed: int) -> dict[str, torch.Tensor]:
    _examples_on_path()
    import pretrain_gpt

    torch.manual_seed(torch.seed() % 2**31)  # whatever state the process happens to be in
    run = pretrain_gpt.setup(_args("--seed", str(seed)))
    try:
        return {name: p.detach().clone() for name, p in run.model[0].named_parameters()}
    finally:
        parallel_state.destroy_model_parallel()


def test_seed_fixes_cpu_initialised_weights_on_the_device_path(monkeypatch):
    if dist.is_initialized():
        pytest.skip("needs a process group of its own")
    monkeypatch.setattr(tp_random, "_uses_accelerator", lambda: True)
    monkeypatch.setattr(device, "manual_seed_device", lambda seed: None)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        first, again, other = _initial_weights(7), _initial_weights(7), _initial_weights(8)
    finally:
        dist.destroy_process_group()
    assert first.keys() == again.keys() and first
    for name in first:
        assert torch.equal(first[name], again[name]), name
    assert any(not torch.equal(first[n], other[n]) for n in first if first[n].numel() > 1 and first[n].std() > 0)
