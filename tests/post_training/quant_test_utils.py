"""Tiny GPT models for the post-training tests: built from the Model Optimizer spec, quantized with a
predefined Model Optimizer recipe after one calibration batch, on one process or sharded over TP.

Sizes: hidden 128 and FFN 256 so that INT4 AWQ's 128-wide weight blocks fit whole; at TP=2 use :data:`WIDE`
(hidden 256, FFN 512), so that they also fit in every row-parallel layer's input shard (256 / 2, 512 / 2).
Weights are fp32 unless a dtype is given; the reference model of a seed is the same on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.models.gpt import GPTModel
from megatron_core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec
from megatron_core.transformer import TransformerConfig
from tests.models.gpt_test_utils import shard

VOCAB, SEQ, BATCH, MAX_SEQ = 128, 16, 2, 32
RECIPES = ("FP8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG", "INT4_AWQ_CFG", "NVFP4_DEFAULT_CFG")
WIDE = {"hidden_size": 256, "ffn_hidden_size": 512}
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def config(**overrides) -> TransformerConfig:
    """Llama-like: RMSNorm, GQA, SwiGLU, RoPE, no biases."""
    cfg = dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256,
               normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def build(seed: int = 1234, dtype: torch.dtype = torch.float32, **overrides) -> GPTModel:
    """A GPT on the Model Optimizer spec, full logits (``parallel_output=False``), in eval mode, in ``dtype``."""
    torch.manual_seed(seed)
    cfg = config(**overrides)
    model = GPTModel(cfg, get_gpt_modelopt_spec(cfg, local_core_attention=True), VOCAB, MAX_SEQ,
                     position_embedding_type="rope", parallel_output=False)
    return model.to(dtype).eval()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids)``, each ``[b, s]``."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)


def logits(model: GPTModel, seed: int = 7) -> torch.Tensor:
    """``[b, s, vocab]`` logits on the evaluation batch (another batch than calibration's)."""
    with torch.no_grad():
        return model(*batch(seed), None)


def calibrate(model: GPTModel) -> None:
    """Model Optimizer's ``forward_loop``: one calibration batch."""
    model(*batch(0), None)


def quantize(model: GPTModel, recipe: str) -> GPTModel:
    """``mtq.quantize`` with the predefined recipe named ``recipe``."""
    import modelopt.torch.quantization as mtq

    return mtq.quantize(model, getattr(mtq, recipe), calibrate)


def load_sharded(model: GPTModel, full_state: dict, tp: int, tp_rank: int) -> None:
    """Copy this TP rank's shard of the TP=1 weights ``full_state`` into ``model``."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard(name, full_state[name], tp, tp_rank, gated=True))


def reference(recipe: str | None, dtype: torch.dtype = torch.float32, **overrides) -> tuple[dict, torch.Tensor]:
    """``(TP=1 weights, logits)`` of the reference model, quantized with ``recipe`` unless it is None."""
    model = build(dtype=dtype, **overrides)
    weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    if recipe is not None:
        quantize(model, recipe)
    return weights, logits(model)


# ---- MoE models (tests/post_training/test_ptq_moe*.py) ----
# A Mixtral-shaped MoE GPT (4 experts, top-2 softmax router, SwiGLU experts) with hidden 128 and expert FFN 128,
# so that INT4 AWQ's 128-wide blocks fit whole. Calibration and evaluation batches are [BATCH, SEQ] like the dense
# (the MoE GPT's vocabulary and sequence length); ``moe_batch(i)`` is the i-th one of a fixed sequence.
MOE = {"hidden_size": 128, "ffn_hidden_size": 128, "num_attention_heads": 4}


def build_moe(grouped: bool, seed: int = 1234, dtype: torch.dtype = torch.float32, **overrides) -> GPTModel:
    """The Mixtral-like MoE GPT of ``tests.transformer.moe`` (grouped or sequential experts), eval mode, ``dtype``."""
    from megatron_core.post_training.modelopt import register_quant_modules
    from tests.transformer.moe.moe_parallel_utils import build as build_moe_gpt

    register_quant_modules()
    torch.manual_seed(seed)
    model = build_moe_gpt("mixtral", moe_grouped_gemm=grouped, **{**MOE, **overrides})
    return model.to(dtype).eval()


def moe_batch(index: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids)`` of the MoE GPT's batch ``index``, each ``[BATCH, seq]``, on ``device``."""
    from tests.transformer.moe.moe_parallel_utils import SEQ as MOE_SEQ
    from tests.transformer.moe.moe_parallel_utils import VOCAB as MOE_VOCAB

    ids = torch.randint(0, MOE_VOCAB, (BATCH, MOE_SEQ), generator=torch.Generator().manual_seed(100 + index))
    return ids.to(device), torch.arange(MOE_SEQ, device=device).unsqueeze(0).expand(BATCH, MOE_SEQ)


def moe_logits(model: GPTModel, index: int, device: str = "cpu") -> torch.Tensor:
    """``[b, s, vocab]`` logits on batch ``index``."""
    with torch.no_grad():
        return model(*moe_batch(index, device), None)


def quantize_on(model: GPTModel, recipe: str, indices: list[int], device: str = "cpu") -> GPTModel:
    """``mtq.quantize`` with the predefined ``recipe``, calibrating on the batches ``indices``."""
    import modelopt.torch.quantization as mtq

    def loop(m: GPTModel) -> None:
        for i in indices:
            m(*moe_batch(i, device), None)

    return mtq.quantize(model, getattr(mtq, recipe), loop)


def quantize_on_global(model: GPTModel, recipe: str, indices: list[int]) -> GPTModel:
    """``mtq.quantize`` with ``recipe``, calibrating on the batches ``indices`` as one batch (one forward).

    What one process sees of data-parallel ranks that calibrate on one of those batches each.
    """
    import modelopt.torch.quantization as mtq

    batches = [moe_batch(i) for i in indices]
    ids, position_ids = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    return mtq.quantize(model, getattr(mtq, recipe), lambda m: m(ids, position_ids, None))


# ---- pipeline stages of the dense GPT (tests/post_training/test_ptq_pipeline*.py) ----


def build_stage(weights: dict, dtype: torch.dtype = torch.float32) -> GPTModel:
    """This pipeline rank's stage of :func:`build`'s GPT holding the one-process ``weights`` (global layer names)."""
    import re

    from megatron_core import parallel_state
    from megatron_core.transformer.pipeline_layout import get_transformer_layer_offset

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cfg = config(pipeline_model_parallel_size=pp, pipeline_dtype=dtype)
    model = GPTModel(cfg, get_gpt_modelopt_spec(cfg, local_core_attention=True), VOCAB, MAX_SEQ,
                     position_embedding_type="rope", parallel_output=False,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage()).to(dtype).eval()
    offset = get_transformer_layer_offset(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)
            param.copy_(weights[key])
    return model


def pipeline_forward(model: GPTModel, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor | None:
    """One forward-only microbatch through the library's pipeline schedule: the logits on the last stage, else None."""
    from megatron_core import parallel_state
    from megatron_core.pipeline_parallel import get_forward_backward_func

    def step(data_iterator, stage):
        tokens, positions = next(data_iterator)
        output = stage(tokens, positions, None)

        def collect(output_tensor, non_loss_data=False):
            return output_tensor.detach().clone()

        return output, collect

    data = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter([(ids, position_ids)]), model=model, num_microbatches=1,
        seq_length=ids.shape[1], micro_batch_size=ids.shape[0], forward_only=True, collect_non_loss_data=True)
    return data[0] if parallel_state.is_pipeline_last_stage() else None


# ---- data-parallel calibration of the dense GPT (tests/post_training/test_ptq_parallel.py) ----


def sized_batch(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids)`` of ``size`` sequences, each ``[size, SEQ]``."""
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(SEQ).unsqueeze(0).expand(size, SEQ)


def global_batch(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batches' sequences as one batch (what one process sees of the data-parallel ranks' batches)."""
    return torch.cat([ids for ids, _ in batches]), torch.cat([pos for _, pos in batches])


def quantize_with(model: GPTModel, recipe: str, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> GPTModel:
    """``mtq.quantize`` with the predefined ``recipe``, calibrating on ``batches`` one after another."""
    import modelopt.torch.quantization as mtq

    def loop(m: GPTModel) -> None:
        for ids, position_ids in batches:
            m(ids, position_ids, None)

    return mtq.quantize(model, getattr(mtq, recipe), loop)
