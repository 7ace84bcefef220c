"""``MultimodalProjector`` (fp32, CPU): keys, shapes and numbers against plain torch and Megatron-Core.

- "mlp" is ``fc2(act(fc1(x)))`` with both biases, "affine" is ``x @ W.T + b``, written out here.
- The installed Megatron-Core's projector has the same keys and, on the same weights, the same output.
- A projector type or submodules it cannot build raise ``ValueError`` naming them.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_core.models.vision import MultimodalProjector
from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.mlp import MLPSubmodules
from tests.dist_harness import run_on_ranks
from tests.megatron_oracle import megatron_on_cpu

VISION, HIDDEN, FFN = 24, 32, 48
FIELDS = dict(num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=4, add_bias_linear=True,
              activation_func=F.gelu, bias_activation_fusion=False, use_cpu_initialization=True)
KEYS = {"mlp": {"encoder.linear_fc1.weight", "encoder.linear_fc1.bias", "encoder.linear_fc2.weight",
                "encoder.linear_fc2.bias"},
        "affine": {"encoder.weight", "encoder.bias"}}


def _submodules() -> MLPSubmodules:
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def _projector(projector_type: str, seed: int = 0, **overrides) -> MultimodalProjector:
    torch.manual_seed(seed)
    projector = MultimodalProjector(TransformerConfig(**{**FIELDS, **overrides}), _submodules(), projector_type,
                                    VISION)
    with torch.no_grad():  # biases start at zero; make them count
        for name, param in projector.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    return projector


def _reference(projector: MultimodalProjector, x: torch.Tensor) -> torch.Tensor:
    state = {k: v.detach() for k, v in projector.state_dict().items() if not k.endswith("_extra_state")}
    if projector.projector_type == "affine":
        return x @ state["encoder.weight"].T + state["encoder.bias"]
    hidden = F.gelu(x @ state["encoder.linear_fc1.weight"].T + state["encoder.linear_fc1.bias"])
    return hidden @ state["encoder.linear_fc2.weight"].T + state["encoder.linear_fc2.bias"]


@pytest.mark.parametrize("projector_type", ["mlp", "affine"])
def test_output_matches_plain_torch(projector_type: str):
    projector = _projector(projector_type)
    expected_shapes = {"encoder.linear_fc1.weight": (FFN, VISION), "encoder.linear_fc2.weight": (HIDDEN, FFN),
                       "encoder.weight": (HIDDEN, VISION)}
    state = {k: v for k, v in projector.state_dict().items() if not k.endswith("_extra_state")}
    assert set(state) == KEYS[projector_type]
    for key, shape in expected_shapes.items():
        if key in state:
            assert state[key].shape == shape
    x = torch.randn(5, 2, VISION)  # [s, b, vision_hidden]
    out = projector(x)
    assert out.shape == (5, 2, HIDDEN) and out._base is None
    torch.testing.assert_close(out, _reference(projector, x), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert all(p.grad is not None for p in projector.parameters())


def test_without_biases():
    projector = MultimodalProjector(TransformerConfig(**{**FIELDS, "add_bias_linear": False}), _submodules(),
                                    "affine", VISION)
    assert set(k for k in projector.state_dict() if not k.endswith("_extra_state")) == {"encoder.weight"}
    x = torch.randn(3, VISION)
    torch.testing.assert_close(projector(x), x @ projector.encoder.weight.detach().T)


@pytest.mark.parametrize(("projector_type", "submodules", "message"), [
    ("conv", _submodules(), r"projector_type \('conv'\) must be one of \['mlp', 'affine'\]"),
    ("mlp", None, r"needs submodules \(MLPSubmodules\) with linear_fc1 set"),
    ("affine", MLPSubmodules(), r"needs submodules \(MLPSubmodules\) with linear_fc1 set"),
])
def test_bad_arguments_name_the_values(projector_type: str, submodules, message: str):
    with pytest.raises(ValueError, match=message):
        MultimodalProjector(TransformerConfig(**FIELDS), submodules, projector_type, VISION)


def _compare_with_megatron() -> list[str]:
    with megatron_on_cpu():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.models.vision.multimodal_projector import MultimodalProjector as TheirProjector
            from megatron.core.tensor_parallel import ColumnParallelLinear as TheirColumn
            from megatron.core.tensor_parallel import RowParallelLinear as TheirRow
            from megatron.core.transformer.mlp import MLPSubmodules as TheirSubmodules
            from megatron.core.transformer.transformer_config import TransformerConfig as TheirConfig
        checked = []
        for projector_type in ("mlp", "affine"):
            torch.manual_seed(1)
            theirs = TheirProjector(TheirConfig(**FIELDS), TheirSubmodules(linear_fc1=TheirColumn,
                                                                            linear_fc2=TheirRow),
                                    projector_type, VISION)
            ours = _projector(projector_type)
            assert set(ours.state_dict()) == set(theirs.state_dict())
            theirs.load_state_dict(ours.state_dict())
            x = torch.randn(4, 3, VISION)
            torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
            checked.append(projector_type)
        return checked


def test_matches_megatron_core_projector():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core.models.vision.multimodal_projector")
    assert run_on_ranks(1, _compare_with_megatron) == [["mlp", "affine"]]
