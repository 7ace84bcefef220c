"""``MimoModel`` against the installed Megatron-Core's own ``MimoModel`` (fp32, CPU, one rank).

Both are built from specs of each library's CLIP ViT, MLP projector and RoPE GPT model: same state-dict keys,
and on the same weights the same logits, per-token loss and gradients.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.megatron_oracle import megatron_on_cpu
from tests.models.mimo import mimo_fixture as f
from tests.models.multimodal import llava_fixture as lf


@contextlib.contextmanager
def _cuda_calls_stay_on_cpu():
    """Their CLIP moves its position ids with ``.cuda()`` and their softmax builds the default causal mask
    (MIMO passes no attention mask) on ``"cuda"``; on a machine without a GPU keep both on the CPU."""
    from megatron.core.fusions import fused_softmax

    saved = torch.Tensor.cuda, fused_softmax.get_default_causal_mask
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
        fused_softmax.get_default_causal_mask = lambda sq: torch.ones(sq, sq).triu(diagonal=1).bool()
    try:
        yield
    finally:
        torch.Tensor.cuda, fused_softmax.get_default_causal_mask = saved


def _their_mimo():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.mimo import MimoModel, MimoModelConfig, VisionModalitySubmodules
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    def config(ours):
        fields = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                  "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear",
                  "add_qkv_bias", "hidden_dropout", "attention_dropout", "bias_activation_fusion",
                  "use_cpu_initialization")
        return TransformerConfig(**{name: getattr(ours, name) for name in fields})

    vit_spec = get_vit_layer_with_local_spec()
    # 0.16's local ViT spec still says causal; 0.19 (the API mirrored here) has no mask.
    vit_spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask
    clip = ModuleSpec(module=CLIPViTModel, params=dict(
        ln_pre_impl=WrappedTorchNorm, transformer_config=config(lf.vision_config()), transformer_layer_spec=vit_spec, patch_dim=lf.PATCH,
        img_h=lf.IMG, img_w=lf.IMG))
    projector = ModuleSpec(module=MultimodalProjector, params=dict(
        config=config(lf.projection_config()),
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        projector_type="mlp", input_size=lf.V_HIDDEN))
    vision = ModuleSpec(module=VisionModalitySubmodules,
                        submodules={"encoders": {"clip_encoder": clip}, "input_projections": [projector]})
    language = ModuleSpec(module=GPTModel, params=dict(
        config=config(lf.language_config()), transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=lf.VOCAB, max_sequence_length=lf.MAX_SEQ, position_embedding_type="rope"))
    return MimoModel(MimoModelConfig(language_model_spec=language, modality_submodules_spec={"images": vision},
                                     special_token_ids={"images": f.IMAGE_TOKEN_ID}))


def _compare_with_megatron() -> list[str]:
    with megatron_on_cpu(), _cuda_calls_stay_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(4)
        theirs = _their_mimo()
        lf.randomize(theirs, seed=5)
        ours = f.build()
        assert set(ours.state_dict()) == set(theirs.state_dict())
        ours.load_state_dict(theirs.state_dict())
        ids, images = f.batch([2, 0, 1], seed=7)
        labels = torch.roll(ids, -1, dims=1).clamp(max=f.VOCAB - 2)
        inputs = {"images": {"clip_encoder": {"x": images}}}
        want, _ = theirs(ids, labels=labels, modality_inputs=inputs)
        got, _ = ours(ids, labels=labels, modality_inputs=inputs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        want.sum().backward()
        got.sum().backward()
        their_params = dict(theirs.named_parameters())
        for name, param in ours.named_parameters():
            ref = their_params[name].grad
            torch.testing.assert_close(param.grad, ref, rtol=1e-4, atol=1e-5 * max(1.0, ref.abs().max().item()),
                                       msg=lambda m, n=name: f"{n}: {m}")
        with torch.no_grad():
            torch.testing.assert_close(ours(ids, modality_inputs=inputs)[0], theirs(ids, modality_inputs=inputs)[0],
                                       rtol=1e-5, atol=1e-5)
        return sorted(ours.state_dict())


def test_matches_megatron_core_mimo_model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core.models.mimo")
    (keys,) = run_on_ranks(1, _compare_with_megatron)
    assert {k.split(".")[0] for k in keys} == {"modality_submodules", "language_model"}
    assert "modality_submodules.images.encoders.clip_encoder.class_token" in keys
    assert "modality_submodules.images.input_projections.0.encoder.linear_fc2.weight" in keys
