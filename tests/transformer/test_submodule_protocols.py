"""The slots' typing protocols (Megatron-Core 0.19's ``*Builder`` / ``*Interface``) and this library's modules.

The protocols are not ``runtime_checkable`` (as in Megatron-Core), so each check is structural: a builder's call
(every argument the protocol names, positional-only ones by position) binds to the module's constructor (with the
``submodules`` a spec supplies), and an interface's methods exist with a ``forward`` that takes the protocol's
arguments. Each module is checked against the protocols its Megatron-Core counterpart fills.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import pytest

from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_core.transformer import attention, mlp, transformer_layer
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.mlp import MLPSubmodules
from megatron_core.transformer.moe import experts, moe_layer
from megatron_core.transformer.moe.grouped_linear import ColumnParallelGroupedLinear, RowParallelGroupedLinear
from megatron_core.transformer.moe.router import InferenceTopKRouter, TopKRouter
from megatron_core.transformer.moe.shared_experts import SharedExpertMLP

GROUPED = experts.GroupedMLPSubmodules(linear_fc1=ColumnParallelGroupedLinear, linear_fc2=RowParallelGroupedLinear)
MOE = moe_layer.MoESubmodules(experts=GROUPED)

# (protocol, module, what the spec binds besides the protocol's arguments)
BUILDERS = [
    (transformer_layer.MlpBuilder, moe_layer.MoELayer, dict(submodules=MOE)),
    (attention.LinearQkvBuilder, ColumnParallelLinear, {}),
    (attention.LinearLayerBuilder, ColumnParallelLinear, {}),
    (attention.CoreAttentionBuilder, DotProductAttention, {}),
    (attention.LinearProjBuilder, RowParallelLinear, {}),
    (mlp.LinearFc1Builder, ColumnParallelLinear, {}),
    (mlp.LinearFc2Builder, RowParallelLinear, {}),
    (moe_layer.ExpertsBuilder, experts.SequentialMLP, dict(submodules=MLPSubmodules())),
    (moe_layer.ExpertsBuilder, experts.TEGroupedMLP, dict(submodules=GROUPED)),
    (moe_layer.ExpertsBuilder, experts.InferenceGroupedMLP, dict(submodules=GROUPED)),
    (moe_layer.SharedExpertsBuilder, SharedExpertMLP, dict(submodules=MLPSubmodules())),
    (moe_layer.RouterBuilder, TopKRouter, {}),
    (moe_layer.RouterBuilder, InferenceTopKRouter, {}),
    (experts.GroupedLinearFc1Builder, ColumnParallelGroupedLinear, {}),
    (experts.GroupedLinearFc2Builder, RowParallelGroupedLinear, {}),
]

INTERFACES = [
    (transformer_layer.MlpInterface, moe_layer.MoELayer),
    (attention.LinearQkvInterface, ColumnParallelLinear),
    (attention.LinearInterface, ColumnParallelLinear),
    (attention.CoreAttentionInterface, DotProductAttention),
    (attention.LinearProjInterface, RowParallelLinear),
    (mlp.LinearFc1Interface, ColumnParallelLinear),
    (mlp.LinearFc2Interface, RowParallelLinear),
    (moe_layer.ExpertsInterface, experts.SequentialMLP),
    (moe_layer.ExpertsInterface, experts.TEGroupedMLP),
    (moe_layer.ExpertsInterface, experts.InferenceGroupedMLP),
    (moe_layer.SharedExpertsInterface, SharedExpertMLP),
    (moe_layer.RouterInterface, TopKRouter),
    (moe_layer.RouterInterface, InferenceTopKRouter),
    (experts.GroupedLinearFc1Interface, ColumnParallelGroupedLinear),
    (experts.GroupedLinearFc2Interface, RowParallelGroupedLinear),
]

PROTOCOL_NAMES = {
    attention: ["CoreAttentionBuilder", "CoreAttentionInterface", "LinearInterface", "LinearLayerBuilder",
                "LinearProjBuilder", "LinearProjInterface", "LinearQkvBuilder", "LinearQkvInterface"],
    mlp: ["LinearFc1Builder", "LinearFc1Interface", "LinearFc2Builder", "LinearFc2Interface",
          "TEActivationFunctionBuilder", "TEActivationFunctionInterface"],
    moe_layer: ["ExpertsBuilder", "ExpertsInterface", "RouterBuilder", "RouterInterface", "SharedExpertsBuilder",
                "SharedExpertsInterface"],
    experts: ["GroupedLinearFc1Builder", "GroupedLinearFc1Interface", "GroupedLinearFc2Builder",
              "GroupedLinearFc2Interface"],
    transformer_layer: ["MlpBuilder", "MlpInterface"],
}


def _call_of(signature: inspect.Signature) -> tuple[list[Any], dict[str, Any]]:
    """Placeholder arguments for every parameter of a protocol method (``self`` dropped)."""
    args, kwargs = [], {}
    for param in list(signature.parameters.values())[1:]:
        if param.kind is inspect.Parameter.POSITIONAL_ONLY:
            args.append(object())
        else:
            kwargs[param.name] = object()
    return args, kwargs


@pytest.mark.parametrize("module", sorted(PROTOCOL_NAMES, key=lambda m: m.__name__), ids=lambda m: m.__name__)
def test_protocols_live_at_megatron_paths_and_are_not_runtime_checkable(module):
    for name in PROTOCOL_NAMES[module]:
        protocol = getattr(module, name)
        assert Protocol in protocol.__mro__, name
        assert not getattr(protocol, "_is_runtime_protocol", False), name
        assert protocol.__doc__, name


@pytest.mark.parametrize("protocol,module,bound", BUILDERS, ids=lambda x: getattr(x, "__name__", ""))
def test_builders_bind_to_the_module_constructors(protocol: type, module: type, bound: dict):
    args, kwargs = _call_of(inspect.signature(protocol.__call__))
    inspect.signature(module).bind(*args, **kwargs, **bound)


@pytest.mark.parametrize("protocol,module", INTERFACES, ids=lambda x: getattr(x, "__name__", ""))
def test_modules_provide_the_interfaces(protocol: type, module: type):
    methods = [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]
    assert "forward" in methods
    for name in methods:
        assert callable(getattr(module, name, None)), f"{module.__name__} has no {name}"
        args, kwargs = _call_of(inspect.signature(getattr(protocol, name)))
        inspect.signature(getattr(module, name)).bind(object(), *args, **kwargs)
