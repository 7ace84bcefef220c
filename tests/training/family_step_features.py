"""The model families of the family training audit: BERT, T5, pure-Mamba, LLaVA and MIMO.

A :class:`Family` says how to build one tiny model of a family for ``get_model`` (pipeline stages included),
which ``TransformerConfig`` fields it starts from, what one global batch is and which forward step (model call
and loss) Megatron-LM trains it with. ``FAMILIES`` holds them; ``FAMILY_LAYOUTS`` the 2-rank layouts (the
parallel-step audit's :class:`~tests.training.parallel_step_features.Layout`), all with the default mean of
per-microbatch losses except CP, which trains with ``calculate_per_token_loss`` (a mean per CP rank would weigh
the ranks' tokens unequally).

Every forward step's ``loss_func`` logs ``"lm loss"`` as ``[sum, count]``, so that the parallel-step compare
turns the loss-holding ranks' logs into one number per step. BERT trains with its own loss (the masked LM's
token mean plus the sentence-order cross entropy, one value per microbatch: logged as ``[loss, 1]``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron_core.models.bert.bert_model import BertModel
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.models.mamba import MambaModel
from megatron_core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron_core.models.mimo import MimoModel, MimoModelConfig, VisionModalitySubmodules
from megatron_core.models.multimodal.llava_model import LLaVAModel
from megatron_core.models.T5 import T5Model
from megatron_core.models.T5.t5_model import t5_extended_attention_mask
from megatron_core.models.T5.t5_spec import (
    get_t5_decoder_with_local_block_spec,
    get_t5_encoder_with_local_block_spec,
)
from megatron_core.models.vision import CLIPViTModel, MultimodalProjector, get_vit_layer_with_local_spec
from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.mlp import MLPSubmodules
from megatron_core.transformer.spec_utils import ModuleSpec
from tests.training.parallel_step_features import Layout, TrainOptions
from tests.training.parallel_step_runner import _forward_step as gpt_forward_step
from tests.training.parallel_step_runner import _global_batch as gpt_global_batch

VOCAB, SEQ, MBS, MAX_SEQ = 64, 8, 2, 16
ENC_SEQ, DEC_SEQ = 8, 6  # T5's encoder and decoder lengths (both divisible by TP for sequence parallelism)
IMG, PATCH = 16, 8  # LLaVA / MIMO images: 2x2 patches
IMAGE_TOKEN = VOCAB - 1
MAMBA_PATTERN = "M-MM"  # Mamba mixers and an MLP, no attention

_COMMON = dict(hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)
_BERT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, bias_activation_fusion=False)
_T5 = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, bias_activation_fusion=False,
           masked_softmax_fusion=False)
_MAMBA = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, normalization="RMSNorm",
              add_bias_linear=False, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, layernorm_epsilon=1e-5)
_LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
              normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
              add_bias_linear=False)
_CLIP = dict(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, add_bias_linear=True,
             add_qkv_bias=True, activation_func=F.gelu, bias_activation_fusion=False)
_PROJECTOR = dict(num_layers=1, hidden_size=32, ffn_hidden_size=32, num_attention_heads=4, add_bias_linear=True,
                  activation_func=F.gelu, bias_activation_fusion=False)


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(2000 + step)


def _sum_loss(output: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron-LM's token loss: ``(sum, token count, {"lm loss": [sum, count]})``."""
    mask = mask.float()
    loss = torch.sum(output.float() * mask)
    count = mask.sum()
    return loss, count.to(torch.int), {"lm loss": torch.stack([loss.detach().clone(), count])}


# --- BERT -------------------------------------------------------------------------------------------------------
def _bert(config: TransformerConfig, pre_process: bool, post_process: bool, vp_stage: int | None,
          pg_collection: Any) -> BertModel:
    return BertModel(config, 2, bert_layer_local_spec, VOCAB, MAX_SEQ, pre_process=pre_process,
                     post_process=post_process, share_embeddings_and_output_weights=True, add_binary_head=True,
                     vp_stage=vp_stage, pg_collection=pg_collection)


def _bert_batch(step: int, count: int) -> list[dict[str, torch.Tensor]]:
    """Right-padded sentence pairs: ids, padding mask, token types, MLM labels / mask, sentence-order labels."""
    gen, out = _gen(step), []
    for _ in range(count):
        lengths = torch.randint(4, SEQ + 1, (MBS,), generator=gen)
        lengths[0] = SEQ
        padding = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        split = torch.randint(1, 4, (MBS, 1), generator=gen)
        loss_mask = (torch.rand(MBS, SEQ, generator=gen) < 0.4).float() * padding
        loss_mask[:, 1] = 1.0
        out.append({"text": torch.randint(0, VOCAB, (MBS, SEQ), generator=gen), "padding_mask": padding,
                    "types": (torch.arange(SEQ)[None, :] >= split).long() * padding,
                    "labels": torch.randint(0, VOCAB, (MBS, SEQ), generator=gen), "loss_mask": loss_mask,
                    "is_random": torch.randint(0, 2, (MBS,), generator=gen)})
    return out


def _bert_forward_step(data_iterator, model):
    """Megatron-LM's ``pretrain_bert`` step: masked-LM token mean + sentence-order cross entropy."""
    batch = next(data_iterator)
    output = model(batch["text"], batch["padding_mask"], tokentype_ids=batch["types"], lm_labels=batch["labels"])

    def loss_func(output_tensor):
        lm_loss_, sop_logits = output_tensor
        mask = batch["loss_mask"].float()
        lm_loss = torch.sum(lm_loss_.float().reshape(-1) * mask.reshape(-1)) / mask.sum()
        sop_loss = F.cross_entropy(sop_logits.view(-1, 2).float(), batch["is_random"].view(-1), ignore_index=-1)
        loss = lm_loss + sop_loss
        return loss, {"lm loss": torch.stack([loss.detach().clone(), torch.ones(())])}

    return output, loss_func


# --- T5 ---------------------------------------------------------------------------------------------------------
def _t5(relative: bool) -> Callable[..., T5Model]:
    position = dict(position_embedding_type="relative", relative_attention_num_buckets=8,
                    relative_attention_max_distance=16) if relative else {}

    def build(config: TransformerConfig, pre_process: bool, post_process: bool, vp_stage: int | None,
              pg_collection: Any) -> T5Model:
        layers = config.num_layers
        return T5Model(config, config, get_t5_encoder_with_local_block_spec(layers),
                       get_t5_decoder_with_local_block_spec(layers), VOCAB, MAX_SEQ, pre_process=pre_process,
                       post_process=post_process, share_embeddings_and_output_weights=True,
                       pg_collection=pg_collection, **position)

    return build


def _t5_batch(step: int, count: int) -> list[dict[str, torch.Tensor]]:
    """Encoder / decoder ids, labels, loss mask and the Megatron masks (True = masked) with padded samples."""
    gen, out = _gen(step), []
    future = torch.ones(DEC_SEQ, DEC_SEQ, dtype=torch.bool).triu(1)
    for _ in range(count):
        enc_valid = torch.randint(4, ENC_SEQ + 1, (MBS,), generator=gen)
        dec_valid = torch.randint(3, DEC_SEQ + 1, (MBS,), generator=gen)
        enc_pad = torch.arange(ENC_SEQ)[None, :] >= enc_valid[:, None]
        dec_pad = torch.arange(DEC_SEQ)[None, :] >= dec_valid[:, None]
        masks = t5_extended_attention_mask([enc_pad[:, None, :].expand(MBS, ENC_SEQ, ENC_SEQ),
                                            future[None] | dec_pad[:, None, :],
                                            enc_pad[:, None, :].expand(MBS, DEC_SEQ, ENC_SEQ)])
        out.append({"text_enc": torch.randint(0, VOCAB, (MBS, ENC_SEQ), generator=gen),
                    "text_dec": torch.randint(0, VOCAB, (MBS, DEC_SEQ), generator=gen),
                    "labels": torch.randint(0, VOCAB, (MBS, DEC_SEQ), generator=gen),
                    "loss_mask": (~dec_pad).float(), "enc_mask": masks[0], "dec_mask": masks[1],
                    "enc_dec_mask": masks[2]})
    return out


def _t5_forward_step(data_iterator, model):
    """Megatron-LM's ``pretrain_t5`` step (the token-sum form of its masked mean)."""
    batch = next(data_iterator)
    output = model(batch["text_enc"], batch["text_dec"], batch["enc_mask"], batch["dec_mask"],
                   batch["enc_dec_mask"], lm_labels=batch["labels"])
    return output, lambda output_tensor: _sum_loss(output_tensor, batch["loss_mask"])


# --- pure Mamba -------------------------------------------------------------------------------------------------
def _staged(pattern: str, config: TransformerConfig) -> str:
    """``pattern`` cut into one ``|``-separated segment per pipeline stage (even split)."""
    stages = config.pipeline_model_parallel_size
    size = len(pattern) // stages
    return "|".join(pattern[i:i + size] for i in range(0, len(pattern), size)) if stages > 1 else pattern


def _mamba(config: TransformerConfig, pre_process: bool, post_process: bool, vp_stage: int | None,
           pg_collection: Any) -> MambaModel:
    return MambaModel(config, mamba_stack_spec=mamba_stack_spec, vocab_size=VOCAB, max_sequence_length=MAX_SEQ,
                      hybrid_layer_pattern=_staged(MAMBA_PATTERN, config), pre_process=pre_process,
                      post_process=post_process, position_embedding_type="none", vp_stage=vp_stage,
                      pg_collection=pg_collection)


# --- LLaVA and MIMO ---------------------------------------------------------------------------------------------
def _encoder_configs(config: TransformerConfig) -> tuple[TransformerConfig, TransformerConfig]:
    """The vision tower's and projector's configs: the language model's TP, no SP / CP / PP (the encoder runs
    whole on the first pipeline stage, on the full image sequence)."""
    vision = TransformerConfig(**_COMMON, **_CLIP, tensor_model_parallel_size=config.tensor_model_parallel_size)
    vision.vision_model_type = "clip"
    projection = TransformerConfig(**_COMMON, **_PROJECTOR,
                                   tensor_model_parallel_size=config.tensor_model_parallel_size)
    return vision, projection


def _projector_spec() -> MLPSubmodules:
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def _llava(freeze: tuple[bool, bool, bool] | None) -> Callable[..., LLaVAModel]:
    def build(config: TransformerConfig, pre_process: bool, post_process: bool, vp_stage: int | None,
              pg_collection: Any) -> LLaVAModel:
        vision, projection = _encoder_configs(config)
        model = LLaVAModel(config, get_gpt_layer_local_spec(), VOCAB, MAX_SEQ, vision, get_vit_layer_with_local_spec(),
                           drop_vision_class_token=True, vision_projection_config=projection,
                           vision_projection_layer_spec=_projector_spec(), language_position_embedding_type="rope",
                           pre_process=pre_process, post_process=post_process, add_encoder=pre_process,
                           add_decoder=True, img_h=IMG, img_w=IMG, patch_dim=PATCH, image_token_index=IMAGE_TOKEN,
                           vp_stage=vp_stage, pg_collection=pg_collection)
        if freeze is not None:
            model.freeze(*freeze)
        return model

    return build


def _image_batch(step: int, count: int, tokens_per_image: int) -> list[dict[str, torch.Tensor]]:
    """Text with one image per sample (``tokens_per_image`` image tokens at a random place), labels, loss mask
    and the images."""
    gen, out = _gen(step), []
    text_len = SEQ - tokens_per_image
    for _ in range(count):
        ids = torch.randint(0, IMAGE_TOKEN, (MBS, SEQ), generator=gen)
        for row in range(MBS):
            start = int(torch.randint(0, text_len + 1, (1,), generator=gen))
            ids[row, start:start + tokens_per_image] = IMAGE_TOKEN
        mask = (torch.rand(MBS, SEQ, generator=gen) > 0.25).float()
        mask[:, -1] = 1.0
        out.append({"ids": ids, "labels": torch.randint(0, IMAGE_TOKEN, (MBS, SEQ), generator=gen),
                    "loss_mask": mask, "images": torch.randn(MBS, 3, IMG, IMG, generator=gen)})
    return out


def _llava_batch(step: int, count: int) -> list[dict[str, torch.Tensor]]:
    return _image_batch(step, count, 1)  # LLaVA expands its one token per image itself


def _llava_forward_step(data_iterator, model):
    """The multimodal example's step: per-token loss over the expanded (image-aware) loss mask."""
    batch = next(data_iterator)
    output, mask = model(batch["images"], batch["ids"], None, None, labels=batch["labels"],
                         loss_mask=batch["loss_mask"])
    return output, lambda output_tensor: _sum_loss(output_tensor, mask)


def _mimo(config: TransformerConfig, pre_process: bool, post_process: bool, vp_stage: int | None,
          pg_collection: Any) -> MimoModel:
    vision, projection = _encoder_configs(config)
    language = ModuleSpec(module=GPTModel, params=dict(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
        max_sequence_length=MAX_SEQ, position_embedding_type="rope", scatter_embedding_sequence_parallel=False))
    clip = ModuleSpec(module=CLIPViTModel, params=dict(transformer_config=vision,
                                                       transformer_layer_spec=get_vit_layer_with_local_spec(),
                                                       patch_dim=PATCH, img_h=IMG, img_w=IMG))
    projector = ModuleSpec(module=MultimodalProjector, params=dict(config=projection, submodules=_projector_spec(),
                                                                   projector_type="mlp", input_size=32))
    images = ModuleSpec(module=VisionModalitySubmodules,
                        submodules={"encoders": {"clip_encoder": clip}, "input_projections": [projector]})
    return MimoModel(MimoModelConfig(language_model_spec=language, modality_submodules_spec={"images": images},
                                     special_token_ids={"images": IMAGE_TOKEN}))


MIMO_TOKENS_PER_IMAGE = (IMG // PATCH) ** 2 + 1  # CLIP's class token is kept


def _mimo_batch(step: int, count: int) -> list[dict[str, torch.Tensor]]:
    return _image_batch(step, count, MIMO_TOKENS_PER_IMAGE)


def _mimo_forward_step(data_iterator, model):
    """MIMO's training step: the language model's per-token loss over the loss mask it returns."""
    batch = next(data_iterator)
    output, mask = model(batch["ids"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                         modality_inputs={"images": {"clip_encoder": {"x": batch["images"]}}})
    return output, lambda output_tensor: _sum_loss(output_tensor, mask)


@dataclass(frozen=True)
class Family:
    """One tiny model of a family: ``build(config, pre_process, post_process, vp_stage, pg_collection)``, its
    ``TransformerConfig`` fields, ``batch(step, count)`` (a step's global microbatches), ``forward_step``, whether
    a microbatch is cut per CP rank by ``get_batch_on_this_cp_rank`` (else the model cuts its own sequence), and
    the sequence length the pipeline schedule sends between stages; ``frozen``: the key prefix of the part whose
    parameters it freezes (``""``: none)."""

    name: str
    build: Callable[..., torch.nn.Module]
    config: dict[str, Any]
    batch: Callable[[int, int], list[dict[str, torch.Tensor]]]
    forward_step: Callable[..., Any]
    cp_split: bool = False
    seq_length: int = SEQ
    frozen: str = ""

    def make_config(self, **parallel: Any) -> TransformerConfig:
        """The model's (language) config with the layout's fields (``parallel``) added."""
        return TransformerConfig(**{**_COMMON, **self.config, **parallel})


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("bert", _bert, _BERT, _bert_batch, _bert_forward_step),
    Family("t5", _t5(relative=False), _T5, _t5_batch, _t5_forward_step, seq_length=ENC_SEQ),
    Family("t5_relative", _t5(relative=True), _T5, _t5_batch, _t5_forward_step, seq_length=ENC_SEQ),
    Family("mamba", _mamba, _MAMBA, gpt_global_batch, gpt_forward_step, cp_split=True),
    Family("llava", _llava(None), _LLAMA, _llava_batch, _llava_forward_step, seq_length=MAX_SEQ),
    Family("llava_frozen_vision", _llava((False, True, False)), _LLAMA, _llava_batch, _llava_forward_step,
           seq_length=MAX_SEQ, frozen="vision_model."),
    Family("llava_frozen_language", _llava((True, False, False)), _LLAMA, _llava_batch, _llava_forward_step,
           seq_length=MAX_SEQ, frozen="language_model."),
    Family("mimo", _mimo, _LLAMA, _mimo_batch, _mimo_forward_step),
)}

FAMILY_LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (
    Layout("tp2", tp=2),
    Layout("tp2_sp", tp=2, sp=True),
    Layout("cp2", cp=2, per_token=True),
    Layout("pp2", pp=2),
    Layout("dp2_distopt", distributed_optimizer=True),
)}


def one_process(layout: Layout) -> Layout:
    """The one-process run that ``layout`` must reproduce (its loss normalisation)."""
    mode = "per_token" if layout.per_token else "mean"
    return Layout(f"one_process_{mode}", per_token=layout.per_token, train=TrainOptions())
