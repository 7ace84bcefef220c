"""A CPU/gloo stand-in for Megatron-LM's ``tests/unit_tests/test_utilities.py`` (written for megatron_core).

``tools/megatron_unit_tests/run.py`` copies this file over the original in a temporary copy of
Megatron-LM's unit tests. ``Utils`` keeps the original's interface: ``world_size``/``rank`` from the
environment (one process by default), ``initialize_distributed`` (gloo on a file store),
``initialize_model_parallel`` (skips the test when the requested layout does not fit the world),
``fake_initialize_model_parallel`` (sizes set through the public setters), ``destroy_model_parallel`` and
``set_world_size``.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import pytest
import torch

import megatron_core.parallel_state as ps


class MissingTE:
    """Stands for a Transformer Engine name the tests import at module level; using it raises ImportError."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{self.name}: Transformer Engine is not installed (CPU harness)")

    def __getattr__(self, attr: str):
        raise ImportError(f"{self.name}.{attr}: Transformer Engine is not installed (CPU harness)")


class TestModel(torch.nn.Module):
    """A stack of ``num_layers`` linear layers (the last optionally flagged as a shared embedding)."""

    def __init__(self, input_dim: int, output_dim: int, num_layers: int, bias: bool,
                 shared_embedding: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(input_dim, output_dim, bias) for _ in range(num_layers))
        if shared_embedding:
            self.layers[-1].weight.shared_embedding = True


def clear_nvte_env_vars() -> None:
    """Drop the Transformer Engine attention-backend variables."""
    for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(var, None)


class Utils:
    """Process-group set-up for the tests, on CPU with gloo."""

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    inited = False
    store = None

    @staticmethod
    def initialize_distributed() -> None:
        """Initialise the default gloo group of ``world_size`` ranks (once)."""
        clear_nvte_env_vars()
        if not torch.distributed.is_initialized() and Utils.rank >= 0:
            path = os.environ.get("MCORE_TEST_STORE") or os.path.join(tempfile.gettempdir(),
                                                                       f"mcore_unit_store_{os.getppid()}")
            Utils.store = torch.distributed.FileStore(path, Utils.world_size)
            torch.distributed.init_process_group("gloo", store=Utils.store, rank=Utils.rank,
                                                 world_size=Utils.world_size, timeout=timedelta(minutes=1))
        Utils.inited = True

    @staticmethod
    def set_world_size(world_size: int | None = None, rank: int | None = None) -> None:
        """Pretend to run on ``world_size`` ranks: skip when that is not the real world size."""
        wanted = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        if wanted != int(os.environ.get("WORLD_SIZE", "1")):
            pytest.skip(f"needs world size {wanted}; this CPU run has {os.environ.get('WORLD_SIZE', '1')}")
        Utils.world_size = wanted
        if rank is not None:
            Utils.rank = rank

    @staticmethod
    def destroy_model_parallel() -> None:
        """Free the model-parallel groups."""
        clear_nvte_env_vars()
        if not Utils.inited:
            return
        ps.destroy_model_parallel()
        Utils.inited = False

    @staticmethod
    def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                                  virtual_pipeline_model_parallel_size: int | None = None, **kwargs) -> None:
        """``parallel_state.initialize_model_parallel``; the test is skipped when the layout needs more ranks."""
        clear_nvte_env_vars()
        ps.destroy_model_parallel()
        Utils.initialize_distributed()
        model = (tensor_model_parallel_size * pipeline_model_parallel_size
                 * kwargs.get("context_parallel_size", 1))
        expert = (kwargs.get("expert_model_parallel_size", 1)
                  * (kwargs.get("expert_tensor_parallel_size") or tensor_model_parallel_size)
                  * pipeline_model_parallel_size)
        world = torch.distributed.get_world_size()
        if world % model or world % expert:
            pytest.skip(f"layout tp={tensor_model_parallel_size} pp={pipeline_model_parallel_size} {kwargs} "
                        f"needs more than {world} rank(s)")
        ps.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size,
                                     virtual_pipeline_model_parallel_size, **kwargs)
        Utils.inited = True

    @staticmethod
    def fake_initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                                       virtual_pipeline_model_parallel_size: int | None = None,
                                       expert_model_parallel_size: int = 1) -> None:
        """Set the sizes (ranks 0) through ``parallel_state``'s public setters, without creating groups."""
        ps.set_tensor_model_parallel_world_size(tensor_model_parallel_size)
        ps.set_tensor_model_parallel_rank(0)
        ps.set_expert_model_parallel_world_size(expert_model_parallel_size)
        ps.set_expert_model_parallel_rank(0)
        if virtual_pipeline_model_parallel_size is not None:
            ps.set_virtual_pipeline_model_parallel_world_size(virtual_pipeline_model_parallel_size)
        ps.set_virtual_pipeline_model_parallel_rank(0)
        ps.set_pipeline_model_parallel_world_size(pipeline_model_parallel_size)
