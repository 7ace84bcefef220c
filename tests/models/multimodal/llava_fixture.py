"""A tiny LLaVA for the tests: CLIP tower (32x32 images, 8x8 patches), MLP projector, Llama language model.

``build`` makes our ``LLaVAModel``; ``hf_llava`` a random Hugging Face ``LlavaForConditionalGeneration`` of the
same shape and ``from_hf`` its state dict in our keys; ``randomize`` perturbs every parameter so that no
mapping mistake hides behind an init value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.activations import quick_gelu
from megatron_core.models.gpt import get_gpt_layer_local_spec
from megatron_core.models.multimodal.llava_model import LLaVAModel
from megatron_core.models.vision import get_vit_layer_with_local_spec
from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.mlp import MLPSubmodules
from tests.inference.llama_fixture import llama_to_mcore
from tests.models.vision.test_clip_vit_model import _from_hf as clip_from_hf

VOCAB, HIDDEN, FFN, LAYERS, HEADS, GROUPS, MAX_SEQ = 128, 64, 96, 2, 4, 2, 128
V_HIDDEN, V_HEADS, V_FFN, V_LAYERS, IMG, PATCH = 64, 4, 128, 2, 32, 8
IMAGE_TOKEN_ID = VOCAB - 1
IMG_SEQ = (IMG // PATCH) ** 2  # class token dropped


def language_config(**overrides) -> TransformerConfig:
    """Llama-like: RMSNorm, GQA, SwiGLU, no biases."""
    fields = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                  ffn_hidden_size=FFN, normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
                  activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                  use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **overrides})


def vision_config(**overrides) -> TransformerConfig:
    """CLIP-like: LayerNorm, quick-GELU, biases."""
    fields = dict(num_layers=V_LAYERS, hidden_size=V_HIDDEN, num_attention_heads=V_HEADS, ffn_hidden_size=V_FFN,
                  add_bias_linear=True, add_qkv_bias=True, activation_func=quick_gelu, layernorm_epsilon=1e-5,
                  hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
                  use_cpu_initialization=True)
    config = TransformerConfig(**{**fields, **overrides})
    config.vision_model_type = "clip"
    return config


def projection_config(**overrides) -> TransformerConfig:
    """Two-layer GELU MLP from the vision width to the language width (HF's LLaVA projector)."""
    fields = dict(num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=HIDDEN, num_attention_heads=4,
                  add_bias_linear=True, activation_func=F.gelu, bias_activation_fusion=False,
                  use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **overrides})


def projection_spec() -> MLPSubmodules:
    """The projector's column- then row-parallel linears."""
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def build(tp: int = 1, language: dict | None = None, **kwargs) -> LLaVAModel:
    """Our LLaVA (RoPE language model, CLIP class token dropped, image token ``IMAGE_TOKEN_ID``)."""
    args = dict(language_position_embedding_type="rope", img_h=IMG, img_w=IMG, patch_dim=PATCH,
                image_token_index=IMAGE_TOKEN_ID, drop_vision_class_token=True)
    args.update(kwargs)
    return LLaVAModel(
        language_config(tensor_model_parallel_size=tp, **(language or {})), get_gpt_layer_local_spec(), VOCAB, MAX_SEQ,
        vision_config(tensor_model_parallel_size=tp), get_vit_layer_with_local_spec(),
        vision_projection_config=projection_config(tensor_model_parallel_size=tp),
        vision_projection_layer_spec=projection_spec(), **args,
    )


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm scales around 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm_scale = param.dim() == 1 and "norm" in name and name.endswith("weight")
            param.copy_(1.0 + 0.2 * noise if is_norm_scale else 0.2 * noise)


def images(count: int, seed: int = 0) -> torch.Tensor:
    """``count`` random image tiles ``[count, 3, IMG, IMG]``."""
    return torch.randn(count, 3, IMG, IMG, generator=torch.Generator().manual_seed(seed))


def hf_llava():
    """A random ``LlavaForConditionalGeneration`` configured as Megatron's LLaVA reads CLIP (see the parity test)."""
    import transformers

    vision = transformers.CLIPVisionConfig(
        hidden_size=V_HIDDEN, intermediate_size=V_FFN, num_hidden_layers=V_LAYERS, num_attention_heads=V_HEADS,
        image_size=IMG, patch_size=PATCH, hidden_act="quick_gelu", layer_norm_eps=1e-5)
    text = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    # Megatron's LLaVA feeds the encoder's last layer (no post-layernorm) to the projector, without the class
    # token: HF's vision_feature_layer=-1 and the "default" strategy (which drops the class token).
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID, projector_hidden_act="gelu",
        vision_feature_layer=-1, vision_feature_select_strategy="default", image_seq_length=IMG_SEQ,
        multimodal_projector_bias=True)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    randomize(model, seed=11)
    return model


def from_hf(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our LLaVA state dict from a Hugging Face ``LlavaForConditionalGeneration`` state dict."""
    language = {"lm_head.weight": hf_state["lm_head.weight"]}
    language.update({"model." + k.removeprefix("model.language_model."): v for k, v in hf_state.items()
                     if k.startswith("model.language_model.")})
    vision = {k.removeprefix("model.vision_tower."): v for k, v in hf_state.items()
              if k.startswith("model.vision_tower.")}
    state = {f"language_model.{k}": v for k, v in llama_to_mcore(language, LAYERS, HEADS, GROUPS).items()}
    state.update({f"vision_model.{k}": v for k, v in clip_from_hf(vision, "clip").items()})
    for hf_name, ours in (("linear_1", "linear_fc1"), ("linear_2", "linear_fc2")):
        for kind in ("weight", "bias"):
            state[f"vision_projection.encoder.{ours}.{kind}"] = hf_state[f"model.multi_modal_projector.{hf_name}.{kind}"]
    return state
