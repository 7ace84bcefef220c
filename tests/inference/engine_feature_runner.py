"""Rank side of the inference-engine feature audit: each feature's tiny model through the dynamic engine and through
a plain loop that re-runs the full forward on the growing sequence.

The models are the training audit's features (``tests.training.parallel_step_features.FEATURES``: config fields and
constructor arguments; :data:`FEATURES` adds ``mtp_repeated``), built here with a longer position table
(:data:`MAX_SEQ`) so that prompts plus generated tokens fit. :func:`reference_runs` (one process) builds each model, records its global weights (the sharded state
dict's tensors, layout-independent), its plain-loop greedy tokens and their log-probabilities, and the engine's;
:func:`layout_runs` builds each model under a parallel layout, loads those weights and returns the engine's.

One engine run is :data:`PROMPTS` served with at most 2 requests in flight and 8 tokens per step (chunked prefill:
the 11-token prompt is split), so requests wait and join running ones; request 3 asks for 2 tokens only and
finishes early; every token's log-probability is returned. A run that did not batch that way (2 requests in a
step, a prompt chunk, a request waiting while others run) raises ``AssertionError``.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.inference.config import InferenceConfig, MambaInferenceStateConfig
from megatron_core.inference.contexts import DynamicInferenceContext
from megatron_core.inference.engines import DynamicInferenceEngine
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import TextGenerationController
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.experimental_attention_variant_module_specs import (
    get_transformer_block_with_experimental_attention_variant_spec,
)
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron_core.transformer import TransformerConfig
from tests.training.parallel_step_features import FEATURES as TRAINING_FEATURES
from tests.training.parallel_step_features import VOCAB, Feature
from tests.transformer.moe.moe_parallel_utils import global_tensors, shards

MAX_SEQ = 32
# The training audit's features plus one MTP layer applied repeatedly (drafts 2 tokens with one layer).
FEATURES: dict[str, Feature] = {
    **TRAINING_FEATURES,
    "mtp_repeated": Feature("mtp_repeated", dict(TRAINING_FEATURES["mtp"].config, mtp_num_layers=2,
                                                 mtp_use_repeated_layer=True), model=TRAINING_FEATURES["mtp"].model),
}
NEW = 6
SEED = 1234
PROMPT_LENGTHS = (3, 11, 7, 2, 9)
EARLY = 3  # this request generates EARLY_NEW tokens only
EARLY_NEW = 2


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


PROMPTS = _prompts()


def new_tokens(index: int) -> int:
    """How many tokens request ``index`` generates."""
    return EARLY_NEW if index == EARLY else NEW


def build(feature: Feature, config: TransformerConfig, pre_process: bool = True, post_process: bool = True) -> Any:
    """``feature``'s model (or this pipeline stage's part of it) in eval mode."""
    if feature.hybrid:
        model = HybridModel(config, hybrid_stack_spec, VOCAB, MAX_SEQ, hybrid_layer_pattern=feature.hybrid,
                            pre_process=pre_process, post_process=post_process, **feature.model)
        for layer in model.decoder.layers:
            if hasattr(getattr(layer, "mixer", None), "chunk_size"):
                layer.mixer.chunk_size = 4  # prompts cross several scan chunks
        return model.eval()
    if config.experimental_attention_variant is not None:
        block = get_transformer_block_with_experimental_attention_variant_spec(config)
    else:
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, qk_l2_norm=config.qk_l2_norm)
    mtp = get_gpt_mtp_block_spec(config, block, False) if config.mtp_num_layers else None
    return GPTModel(config, block, VOCAB, MAX_SEQ, pre_process=pre_process, post_process=post_process,
                    mtp_block_spec=mtp, **feature.model).eval()


def _perturb(model: torch.nn.Module) -> None:
    """Move the parameters that start at constants (norm weights, Mamba ``D``, biases) away from them, so that a
    weight the engine path ignores shows up in the tokens."""
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 or name.endswith(("mixer.D", "bias")):
                param.add_(0.3 * torch.randn(param.shape, generator=gen).to(param.dtype))


@torch.no_grad()
def plain_greedy(model: Any, prompt: list[int], count: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from the full forward of the growing sequence (no KV cache)."""
    ids, log_probs = list(prompt), []
    for _ in range(count):
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], None)
        last = torch.log_softmax(logits[0, -1].float(), dim=-1)
        token = int(last.argmax())
        ids.append(token)
        log_probs.append(float(last[token]))
    return ids[len(prompt):], log_probs


class EngineRunFailed(RuntimeError):
    """Some requests did not complete (the engine contained an error raised while serving them)."""


def engine_greedy(model: Any, num_speculative_tokens: int = 0) -> tuple[list[list[int]], list[list[float]]]:
    """:data:`PROMPTS` through a :class:`DynamicInferenceEngine` over ``model``: each request's greedy tokens and
    their log-probabilities."""
    mamba = MambaInferenceStateConfig.from_model(model) if isinstance(model, HybridModel) else None
    config = InferenceConfig(block_size_tokens=4, buffer_size_gb=0.01, max_sequence_length=MAX_SEQ, max_requests=2,
                             max_tokens=8, enable_chunked_prefill=True, mamba_inference_state_config=mamba,
                             num_speculative_tokens=num_speculative_tokens)
    context = DynamicInferenceContext(model.config, config)
    engine = DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), None), context)
    futures = [engine.add_request(i, prompt, SamplingParams(top_k=1, num_tokens_to_generate=new_tokens(i),
                                                             termination_id=-1, return_log_probs=True))
               for i, prompt in enumerate(PROMPTS)]
    in_flight, chunked, waited = 0, False, False
    while not all(f.done() for f in futures):
        waited |= bool(engine.waiting) and bool(engine.running)
        engine.step_modern()
        in_flight = max(in_flight, len(engine.context.step_entries))
        chunked |= any(not entry.sample for entry in engine.context.step_entries)
    if (in_flight, chunked, waited) != (2, True, True):
        raise AssertionError(f"the run did not batch continuously: at most {in_flight} requests in a step (want 2), "
                             f"chunked prefill {chunked}, requests waiting while others ran {waited}")
    requests = [f.result(timeout=60) for f in futures]
    failed = [f"request {r.request_id} ended {r.status.name}: {r.error}" for r in requests
              if r.status.name != "COMPLETED"]
    if failed:
        raise EngineRunFailed("; ".join(failed))
    if engine.context.block_allocator.get_total_used():
        raise AssertionError("the engine left KV blocks allocated after every request finished")
    return [list(r.generated_tokens) for r in requests], [list(r.generated_log_probs) for r in requests]


def _init(feature: Feature, **parallel: Any) -> TransformerConfig:
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    return feature.make_config(**parallel)


def reference_runs(names: list[str], speculative: int = 0) -> dict[str, dict[str, Any]]:
    """One process: per feature, its global weights, the plain loop's tokens and log-probs and the engine's (or the
    error the engine raised, as ``"error"``: ``(type name, message)``)."""
    parallel_state.initialize_model_parallel()
    try:
        out = {}
        for name in names:
            feature = FEATURES[name]
            model = build(feature, _init(feature))
            _perturb(model)
            plain = [plain_greedy(model, prompt, new_tokens(i)) for i, prompt in enumerate(PROMPTS)]
            result: dict[str, Any] = dict(weights=global_tensors(model), tokens=[t for t, _ in plain],
                                          log_probs=[lp for _, lp in plain])
            try:
                result["engine"] = engine_greedy(model, speculative)
            except (ValueError, NotImplementedError, EngineRunFailed) as error:
                result["error"] = (type(error).__name__, str(error))
            out[name] = result
        return out
    finally:
        parallel_state.destroy_model_parallel()


def _load(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for shard in shards(model):
            shard.data.copy_(weights[shard.key][shard.global_slice()])


def layout_runs(names: list[str], tp: int = 1, pp: int = 1, ep: int = 1, sp: bool = False,
                weights: dict[str, dict[str, torch.Tensor]] | None = None,
                speculative: int = 0) -> dict[str, Any]:
    """Under TP / PP / EP: per feature, the engine's ``(tokens, log_probs)`` on the one-process ``weights`` (or
    ``("error", type name, message)`` when it refuses)."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    try:
        stage = parallel_state.get_pipeline_model_parallel_rank()
        out: dict[str, Any] = {}
        for name in names:
            feature = FEATURES[name]
            config = _init(feature, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                           expert_model_parallel_size=ep, sequence_parallel=sp, pipeline_dtype=torch.float32)
            model = build(feature, config, pre_process=stage == 0, post_process=stage == pp - 1)
            _load(model, weights[name])
            try:
                out[name] = engine_greedy(model, speculative)
            except (ValueError, NotImplementedError, EngineRunFailed) as error:
                out[name] = ("error", type(error).__name__, str(error))
        return out
    finally:
        parallel_state.destroy_model_parallel()
