"""Tiny HybridModel builders, a dynamic engine over one, and the plain greedy loop they are checked against."""

from __future__ import annotations

import torch

from megatron_core.inference.config import InferenceConfig, MambaInferenceStateConfig
from megatron_core.inference.contexts import DynamicInferenceContext
from megatron_core.inference.engines import DynamicInferenceEngine
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import TextGenerationController
from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron_core.transformer import TransformerConfig

VOCAB = 64
MAX_SEQ = 48


def hybrid_config(pattern: str, **overrides) -> TransformerConfig:
    """A tiny RMSNorm config: 4 attention heads (2 KV groups), 4 Mamba heads of 8 in 2 groups, state 8."""
    cfg = dict(num_layers=len(pattern), hidden_size=16, num_attention_heads=4, num_query_groups=2,
               ffn_hidden_size=32, normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
               attention_dropout=0.0, use_cpu_initialization=True, mamba_state_dim=8, mamba_head_dim=8,
               mamba_num_groups=2, layernorm_epsilon=1e-5)
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def build_hybrid(pattern: str = "M*M-", seed: int = 0, chunk_size: int | None = None, pre_process: bool = True,
                 post_process: bool = True, **overrides) -> HybridModel:
    """A HybridModel with RoPE, in eval mode; the Mamba mixers' scan chunk is ``chunk_size`` when given
    (small chunks make prefill cross several scan chunks)."""
    torch.manual_seed(seed)
    model = HybridModel(hybrid_config(pattern, **overrides), hybrid_stack_spec, VOCAB, MAX_SEQ,
                        hybrid_layer_pattern=pattern, position_embedding_type="rope", pre_process=pre_process,
                        post_process=post_process).eval()
    with torch.no_grad():  # D and the norm weight start at ones: perturb them so every term is exercised
        for name, param in model.named_parameters():
            if name.endswith(("mixer.D", "mixer.norm.weight")):
                param.add_(0.3 * torch.randn_like(param))
    if chunk_size is not None:
        for layer in model.decoder.layers:
            if hasattr(layer, "mixer"):
                layer.mixer.chunk_size = chunk_size
    return model


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    """Random prompts of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def plain_greedy(model: HybridModel, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding by re-running the full forward (no context) on the growing sequence."""
    ids = list(prompt)
    for _ in range(new_tokens):
        logits = model(torch.tensor([ids], device=_device(model)), torch.arange(len(ids), device=_device(model))[None],
                       None)
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def hybrid_engine(model: HybridModel, **settings) -> DynamicInferenceEngine:
    """A dynamic engine over ``model`` with its Mamba state config (small cache; ``settings`` override)."""
    config = dict(block_size_tokens=4, buffer_size_gb=0.01, max_sequence_length=MAX_SEQ, max_requests=3)
    config.update(settings)
    inference_config = InferenceConfig(mamba_inference_state_config=MambaInferenceStateConfig.from_model(model),
                                       **config)
    context = DynamicInferenceContext(model.config, inference_config)
    return DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), None), context)


def greedy_params(new_tokens: int) -> SamplingParams:
    """Greedy sampling of exactly ``new_tokens`` tokens (no termination token)."""
    return SamplingParams(top_k=1, num_tokens_to_generate=new_tokens, termination_id=-1)
