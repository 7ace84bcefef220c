"""ModuleSpec / build_module semantics: params, submodules, lazy imports, functions, errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from megatron_core.transformer import IdentityFuncOp, IdentityOp, ModuleSpec, build_module, get_submodules
from megatron_core.transformer.spec_utils import get_module, import_module


class _Leaf(torch.nn.Module):
    def __init__(self, size, scale=1.0, submodules=None):
        super().__init__()
        self.size, self.scale, self.submodules = size, scale, submodules


@dataclass
class _Subs:
    child: object = None


def _factory(x):
    return x + 1


class _Broken:
    def __init__(self, **kw):
        raise ValueError("bad size")


def test_params_and_call_kwargs_are_merged():
    spec = ModuleSpec(module=_Leaf, params={"scale": 2.0})
    leaf = build_module(spec, 8)
    assert (leaf.size, leaf.scale, leaf.submodules) == (8, 2.0, None)
    assert isinstance(spec(3), _Leaf)


def test_submodules_are_injected():
    subs = _Subs(child=_Leaf)
    leaf = build_module(ModuleSpec(module=_Leaf, submodules=subs), 4)
    assert leaf.submodules is subs
    assert get_submodules(ModuleSpec(module=_Leaf, submodules=subs)) is subs


def test_lazy_import_tuple():
    spec = ModuleSpec(module=("torch.nn", "Linear"), params={"bias": False})
    layer = build_module(spec, 3, 5)
    assert isinstance(layer, torch.nn.Linear) and layer.bias is None
    assert import_module(("torch.nn", "ReLU")) is torch.nn.ReLU
    assert get_module(spec) is torch.nn.Linear
    with pytest.raises(ImportError, match="no attribute 'Nope'"):
        build_module(ModuleSpec(module=("torch.nn", "Nope")))


def test_functions_are_returned_uncalled():
    assert build_module(_factory) is _factory
    assert build_module(ModuleSpec(module=_factory, params={"x": 1})) is _factory


def test_class_without_spec_and_identity_ops():
    assert isinstance(build_module(_Leaf, size=2), _Leaf)
    ident = build_module(IdentityOp, config=None, hidden_size=4)
    x = torch.ones(2)
    assert ident(x) is x
    fn = build_module(IdentityFuncOp)()
    assert fn(x, x, 0.1) is x


def test_errors_name_the_class_being_built():
    with pytest.raises(ValueError, match="bad size when instantiating _Broken"):
        build_module(ModuleSpec(module=_Broken))
    with pytest.raises(TypeError, match="when instantiating _Leaf"):
        build_module(ModuleSpec(module=_Leaf), 1, unknown=3)
