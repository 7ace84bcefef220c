"""CUDA-graph option helpers (``transformer.cuda_graph_config``) and their enums, as Megatron-Core 0.19."""

from __future__ import annotations

import pytest

from megatron_core.transformer.cuda_graph_config import (
    ALLOWED_INFERENCE_SCOPES,
    CUDA_GRAPH_MODULES_DEPRECATIONS,
    CudaGraphConfigError,
    get_deprecated_cuda_graph_modules_migration,
    normalize_cuda_graph_modules,
    normalize_inference_cuda_graph_scope,
    validate_deprecated_cuda_graph_modules_migration_inputs,
)
from megatron_core.transformer.enums import CudaGraphModule, InferenceCudaGraphScope

M = CudaGraphModule
S = InferenceCudaGraphScope


def test_enum_members_and_values():
    assert [(m.name, m.value) for m in M] == [
        ("attn", 1), ("mlp", 2), ("moe", 3), ("moe_router", 4), ("moe_preprocess", 5), ("mamba", 6)]
    assert [(s.name, s.value) for s in S] == [("none", 1), ("layer", 2), ("block", 3)]


def test_allowed_inference_scopes_per_impl():
    assert ALLOWED_INFERENCE_SCOPES == {
        "none": {S.none},
        "local": {S.layer, S.block},
        "transformer_engine": {S.none},
        "full_iteration": {S.none},
    }
    assert CUDA_GRAPH_MODULES_DEPRECATIONS == {
        "full_iteration": ("cuda_graph_impl", "full_iteration"),
        "full_iteration_inference": ("inference_cuda_graph_scope", S.block),
    }


@pytest.mark.parametrize("value", [None, "", []])
def test_empty_inputs(value):
    assert normalize_cuda_graph_modules(value) == ([], [], False)


def test_comma_separated_string():
    assert normalize_cuda_graph_modules("attn,moe_router,moe_preprocess") == (
        [M.attn, M.moe_router, M.moe_preprocess], [], False)


def test_single_member_and_mixed_list():
    assert normalize_cuda_graph_modules(M.mlp) == ([M.mlp], [], False)
    assert normalize_cuda_graph_modules(["attn", M.mamba, "mlp"]) == ([M.attn, M.mamba, M.mlp], [], False)


def test_list_input_is_not_mutated():
    value = ["attn", "full_iteration"]
    normalize_cuda_graph_modules(value)
    assert value == ["attn", "full_iteration"]


def test_full_alone():
    assert normalize_cuda_graph_modules("full") == ([], [], True)
    assert normalize_cuda_graph_modules(["full"]) == ([], [], True)


@pytest.mark.parametrize("value", ["full,attn", ["attn", "full"], ["full", "full"]])
def test_full_with_anything_else_is_refused(value):
    with pytest.raises(CudaGraphConfigError, match="'full'"):
        normalize_cuda_graph_modules(value)


def test_deprecated_names_are_set_aside():
    modules, deprecated, full = normalize_cuda_graph_modules("attn,full_iteration_inference")
    assert modules == [M.attn] and not full
    assert deprecated == [("full_iteration_inference", "inference_cuda_graph_scope", S.block)]
    assert normalize_cuda_graph_modules(["full_iteration"]) == (
        [], [("full_iteration", "cuda_graph_impl", "full_iteration")], False)


def test_unknown_name_lists_valid_names():
    with pytest.raises(CudaGraphConfigError, match=r"unknown value 'attention'.*'attn'.*'mamba'") as info:
        normalize_cuda_graph_modules("attn,attention")
    assert isinstance(info.value, ValueError) and isinstance(info.value, AssertionError)


def test_non_string_entry_is_refused():
    with pytest.raises(CudaGraphConfigError, match=r"got 3 \(int\)"):
        normalize_cuda_graph_modules(["attn", 3])
    with pytest.raises(CudaGraphConfigError, match=r"got <InferenceCudaGraphScope.layer: 2>"):
        normalize_cuda_graph_modules(S.layer)


@pytest.mark.parametrize("impl, expected", [("local", S.layer), ("none", S.none),
                                            ("transformer_engine", S.none), ("full_iteration", S.none)])
def test_inference_scope_default_follows_impl(impl, expected):
    assert normalize_inference_cuda_graph_scope(None, impl) is expected


def test_inference_scope_given_explicitly():
    assert normalize_inference_cuda_graph_scope(S.block, "none") is S.block
    assert normalize_inference_cuda_graph_scope("block", "local") is S.block
    assert normalize_inference_cuda_graph_scope("none", "local") is S.none


def test_inference_scope_errors():
    with pytest.raises(CudaGraphConfigError, match="inference_cuda_graph_scope: unknown value 'model'"):
        normalize_inference_cuda_graph_scope("model", "local")
    with pytest.raises(CudaGraphConfigError, match=r"got 2 \(int\)"):
        normalize_inference_cuda_graph_scope(2, "local")


def _deprecated(value):
    return normalize_cuda_graph_modules(value)[1]


def test_validation_passes_without_deprecated_names():
    assert validate_deprecated_cuda_graph_modules_migration_inputs([], "transformer_engine", "block") is None


def test_two_different_deprecated_names_are_refused():
    with pytest.raises(CudaGraphConfigError, match="only one deprecated value"):
        validate_deprecated_cuda_graph_modules_migration_inputs(
            _deprecated("full_iteration,full_iteration_inference"), "local", None)


def test_the_same_deprecated_name_twice_is_accepted():
    validate_deprecated_cuda_graph_modules_migration_inputs(_deprecated("full_iteration,full_iteration"), "local", None)


@pytest.mark.parametrize("impl", ["none", "local", "full_iteration"])
@pytest.mark.parametrize("scope", [None, S.none, "none"])
def test_full_iteration_compatible_inputs(impl, scope):
    validate_deprecated_cuda_graph_modules_migration_inputs(_deprecated("full_iteration"), impl, scope)


def test_full_iteration_conflicts():
    deprecated = _deprecated("full_iteration")
    with pytest.raises(CudaGraphConfigError, match="cuda_graph_impl='transformer_engine'"):
        validate_deprecated_cuda_graph_modules_migration_inputs(deprecated, "transformer_engine", None)
    with pytest.raises(CudaGraphConfigError, match="inference_cuda_graph_scope='layer'"):
        validate_deprecated_cuda_graph_modules_migration_inputs(deprecated, "local", "layer")
    with pytest.raises(CudaGraphConfigError, match="inference_cuda_graph_scope='block'"):
        validate_deprecated_cuda_graph_modules_migration_inputs(deprecated, "none", S.block)


@pytest.mark.parametrize("impl", ["none", "local"])
@pytest.mark.parametrize("scope", [None, S.block, "block"])
def test_full_iteration_inference_compatible_inputs(impl, scope):
    validate_deprecated_cuda_graph_modules_migration_inputs(_deprecated("full_iteration_inference"), impl, scope)


def test_full_iteration_inference_conflicts():
    deprecated = _deprecated("full_iteration_inference")
    for impl in ("full_iteration", "transformer_engine"):
        with pytest.raises(CudaGraphConfigError, match=f"cuda_graph_impl='{impl}'"):
            validate_deprecated_cuda_graph_modules_migration_inputs(deprecated, impl, None)
    for scope in ("none", S.layer):
        with pytest.raises(CudaGraphConfigError, match="inference_cuda_graph_scope='(none|layer)'"):
            validate_deprecated_cuda_graph_modules_migration_inputs(deprecated, "local", scope)


def test_validation_refuses_an_unknown_inference_scope_name():
    with pytest.raises(CudaGraphConfigError, match="unknown value 'layers'"):
        validate_deprecated_cuda_graph_modules_migration_inputs(_deprecated("full_iteration"), "local", "layers")


def test_migration_result():
    assert get_deprecated_cuda_graph_modules_migration(
        "full_iteration", "cuda_graph_impl", "full_iteration", "none") == ("cuda_graph_impl", "full_iteration")
    assert get_deprecated_cuda_graph_modules_migration(
        "full_iteration_inference", "inference_cuda_graph_scope", S.block, "local") == (
        "inference_cuda_graph_scope", S.block)
    assert get_deprecated_cuda_graph_modules_migration(
        "full_iteration_inference", "inference_cuda_graph_scope", S.block, "none") is None
