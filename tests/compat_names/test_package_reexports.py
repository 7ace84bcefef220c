"""Names Megatron-Core 0.19 re-exports from its packages and alias modules resolve here to the same objects.

``tools/megatron_name_gaps.py`` counts these since session 49 (package ``__init__`` imports, ``__all__`` entries and
import-only modules); each is checked here to be the object it stands for, not a copy or a stub.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import megatron_core
from megatron_core import package_info, safe_globals, tensor_parallel
from megatron_core.tensor_parallel import random as tp_random


@pytest.mark.parametrize(("alias_module", "alias", "target_module", "target"), [
    ("megatron_core.inference_params", "InferenceParams", "megatron_core.inference.contexts", "StaticInferenceContext"),
    ("megatron_core", "InferenceParams", "megatron_core.inference.contexts", "StaticInferenceContext"),
    ("megatron_core.inference.engines.mcore_engine", "MCoreEngine", "megatron_core.inference.engines.static_engine",
     "StaticInferenceEngine"),
    ("megatron_core.datasets.utils_s3", "S3Client", "megatron_core.datasets.object_storage_utils", "S3Client"),
    ("megatron_core.datasets.utils_s3", "S3_PREFIX", "megatron_core.datasets.object_storage_utils", "S3_PREFIX"),
    ("megatron_core", "is_torch_min_version", "megatron_core.utils", "is_torch_min_version"),
    ("megatron_core", "register_safe_globals", "megatron_core.safe_globals", "register_safe_globals"),
    ("megatron_core", "safe_load_from_bytes", "megatron_core.safe_globals", "safe_load_from_bytes"),
    ("megatron_core.tensor_parallel", "convert_cuda_rng_state", "megatron_core.tensor_parallel.random",
     "convert_cuda_rng_state"),
    ("megatron_core.optimizer", "param_group_identifier_keys", "megatron_core.optimizer.optimizer",
     "param_group_identifier_keys"),
    ("megatron_core.optimizer", "param_group_override_to_tuple", "megatron_core.optimizer_param_scheduler",
     "param_group_override_to_tuple"),
    ("megatron_core.optimizer", "get_global_unique_param_name", "megatron_core.transformer.fsdp_dtensor_checkpoint",
     "get_global_unique_param_name"),
])
def test_reexport_is_the_object_it_names(alias_module, alias, target_module, target):
    got = getattr(importlib.import_module(alias_module), alias)
    assert got is getattr(importlib.import_module(target_module), target)


def test_graph_safe_tracker_is_the_one_holding_generators():
    plain = tp_random.CudaRNGStatesTracker()
    graphable = tp_random.CudaRNGStatesTracker(use_cudagraphable_rng=True)
    assert not tensor_parallel.is_graph_safe_cuda_rng_tracker(plain)
    assert tensor_parallel.is_graph_safe_cuda_rng_tracker(graphable)
    assert not tensor_parallel.is_graph_safe_cuda_rng_tracker(object())
    # What Megatron-LM's checkpointing does with the answer: states converted to the tracker's form round-trip.
    graphable.add("model-parallel-rng", 1234)
    state = graphable.get_states()["model-parallel-rng"]
    assert isinstance(state, torch.Generator)
    as_tensor = tensor_parallel.convert_cuda_rng_state(state, to_graphable=False)
    back = tensor_parallel.convert_cuda_rng_state(as_tensor, to_graphable=True)
    assert torch.equal(back.get_state(), state.get_state())


def test_package_metadata_names_are_ours():
    for name in ("__shortversion__", "__contact_names__", "__contact_emails__", "__homepage__", "__repository_url__",
                 "__download_url__", "__keywords__", "__description__", "__license__", "__package_name__"):
        assert isinstance(getattr(megatron_core, name), str)
        assert getattr(megatron_core, name) == getattr(package_info, name)
    assert megatron_core.__version__.startswith(megatron_core.__shortversion__)
    assert package_info.__package_name__ in megatron_core.__download_url__
    assert "nvidia" not in (megatron_core.__contact_emails__ + megatron_core.__homepage__).lower()


def test_importing_the_package_leaves_torchs_unpickling_alone():
    """Megatron-Core replaces ``torch.storage._load_from_bytes`` at import; we export the safe version only
    (``docs/compat.md``)."""
    assert torch.storage._load_from_bytes is not safe_globals.safe_load_from_bytes
