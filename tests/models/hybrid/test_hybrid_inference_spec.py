"""``hybrid_inference_stack_spec`` builds a HybridModel that decodes as the training spec's on the same weights.

The inference spec's MoE layers take dense top-k routing and grouped experts under an engine; its checkpoint keys
equal the training spec's but for the routed experts (grouped: ``linear_fc1.weight<i>``), so the training model's
state dict loads after renaming those. Greedy decoding (a plain loop, and the dynamic engine) gives the same tokens.
"""

from __future__ import annotations

import re

import pytest
import torch

from megatron_core._ground.inference_mode import InferenceMode
from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid import hybrid_layer_specs as specs
from megatron_core.models.mamba import mamba_layer_specs
from megatron_core.transformer.moe.experts import InferenceGroupedMLP
from megatron_core.transformer.moe.router import InferenceTopKRouter
from megatron_core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer
from tests.inference.hybrid_fixture import (
    MAX_SEQ,
    VOCAB,
    greedy_params,
    hybrid_config,
    hybrid_engine,
    plain_greedy,
)

PATTERN = "M*EM-E"
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_router_score_function="sigmoid",
           moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=16)


@pytest.fixture(autouse=True)
def _engine_flag_off():
    """Start and end outside an engine (the engines set the process-wide flag and keep it)."""
    InferenceMode.unset_active()
    yield
    InferenceMode.unset_active()


def _model(spec) -> HybridModel:
    return HybridModel(hybrid_config(PATTERN, **MOE), spec, VOCAB, MAX_SEQ, hybrid_layer_pattern=PATTERN,
                       position_embedding_type="rope").eval()


def _grouped_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sequential experts' state-dict keys renamed to grouped experts' (``local_experts.<i>.linear_fc1.weight`` ->
    ``linear_fc1.weight<i>``; the per-expert linears' empty ``_extra_state`` has no grouped counterpart)."""
    pattern = re.compile(r"experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
    return {pattern.sub(lambda m: f"experts.{m[2]}.{m[3]}{m[1]}", k): v for k, v in state.items()
            if not (".local_experts." in k and k.endswith("_extra_state"))}


@pytest.fixture(scope="module")
def models() -> tuple[HybridModel, HybridModel]:
    torch.manual_seed(0)
    train = _model(specs.hybrid_stack_spec)
    with torch.no_grad():  # a nonzero expert bias, so that it takes part in the routing
        for name, buffer in train.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(torch.linspace(-0.2, 0.2, buffer.numel()))
    torch.manual_seed(1)
    infer = _model(specs.hybrid_inference_stack_spec)
    infer.load_state_dict(_grouped_keys(train.state_dict()))
    return train, infer


def test_inference_spec_names_and_layers(models):
    train, infer = models
    assert specs.mamba_inference_stack_spec is specs.hybrid_inference_stack_spec
    assert mamba_layer_specs.hybrid_inference_stack_spec is specs.hybrid_inference_stack_spec
    assert specs.moe_inference.submodules.router is InferenceTopKRouter
    train_moe = [layer for layer in train.decoder.layers if hasattr(getattr(layer, "mlp", None), "router")]
    infer_moe = [layer for layer in infer.decoder.layers if hasattr(getattr(layer, "mlp", None), "router")]
    assert len(train_moe) == len(infer_moe) == 2
    assert all(type(layer) is MoETransformerLayer for layer in train_moe)
    assert all(type(layer) is TransformerLayer for layer in infer_moe)
    assert all(type(layer.mlp.experts) is InferenceGroupedMLP for layer in infer_moe)
    # The tensors' checkpoint keys (sequential experts also save their linears' empty extra state).
    checkpoint_keys = [{v.key for v in m.sharded_state_dict().values()
                        if hasattr(v, "key") and not v.key.endswith("_extra_state")} for m in models]
    assert checkpoint_keys[0] == checkpoint_keys[1]


def test_plain_greedy_decode_equals_the_training_spec(models):
    train, infer = models
    prompt = [5, 17, 3, 40, 9, 22]
    expected = plain_greedy(train, prompt, 8)
    assert plain_greedy(infer, prompt, 8) == expected  # outside an engine: the training path
    with InferenceMode.active():
        assert plain_greedy(infer, prompt, 8) == expected  # dense routing and grouped experts
        ids = torch.tensor([prompt])
        pos = torch.arange(len(prompt))[None]
        with torch.no_grad():
            torch.testing.assert_close(infer(ids, pos, None), train(ids, pos, None), rtol=1e-5, atol=1e-5)


def test_dynamic_engine_on_the_inference_spec_equals_the_training_spec(models):
    train, infer = models
    batch = [[5, 17, 3, 40, 9, 22], [1, 2, 3], [60, 12, 33, 8, 8]]
    expected = [plain_greedy(train, prompt, 6) for prompt in batch]
    engine = hybrid_engine(infer, max_requests=3)
    assert InferenceMode.is_active()
    futures = [engine.add_request(i, prompt, greedy_params(6)) for i, prompt in enumerate(batch)]
    while not all(f.done() for f in futures):
        engine.step_modern()
    assert [f.result(timeout=60).generated_tokens for f in futures] == expected
