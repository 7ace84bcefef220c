"""The dynamic inference engine equals a plain forward loop, feature by feature and layout by layout.

Each model feature of the training audit (``tests.training.parallel_step_features.FEATURES``: llama-like GPT, q/k
layernorm, q/k L2 norm, tied embeddings, learned positions, gpt2-like biases + LayerNorm, attention output gate,
MLA with and without ``q_lora_rank``, MoE with grouped / sequential experts, shared experts with expert bias,
latent MoE, quantile balancing, MTP with one layer per depth or one repeated layer, the hybrid Mamba model) serves five prompts of 2 to 11 tokens through
``DynamicInferenceEngine`` with continuous batching (2 requests in flight, 8 tokens per step with chunked prefill,
one request finishing early), greedy, with log-probabilities. Every generated token must equal the plain loop's
(the model's full forward re-run on the growing sequence, fp32, CPU, one process) and every log-probability match
it to 1e-5: in one process, under TP=2 (dense features), TP=2 with sequence parallelism (every feature: MoE under
TP needs it; the context pads each step to a multiple of the TP size), PP=2 and (MoE) EP=2 on gloo ranks holding
the one-process weights, under TP=2 x PP=2 with sequence parallelism (a dense GPT, MoE with shared experts, the
hybrid model), and with MTP speculative decoding (1 draft token per step, or 2 from the repeated layer) in one
process and under TP=2.

What the engine refuses raises ``ValueError`` naming it when the engine is built: attention sinks, gated delta net
layers (GPT and hybrid), DeepSeek sparse attention, speculative decoding under PP (and the refusals of a
sequence-parallel step, ``tests/inference/test_engine_sequence_parallel.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.inference.engine_feature_runner import FEATURES, layout_runs, reference_runs

TOL = dict(rtol=1e-5, atol=1e-5)

_DENSE = ("gpt", "qk_layernorm", "qk_l2_norm", "tied", "learned_absolute", "gpt2", "output_gate", "mla",
          "mla_no_q_lora", "mtp", "mtp_repeated", "hybrid")
_MOE = ("moe_grouped", "moe_sequential", "moe_shared_bias", "moe_latent", "moe_quantile")
SERVED = _DENSE + _MOE
REFUSED = {"sinks": "attention sinks", "dsa": "DeepSeek sparse attention", "gdn": "gated delta net",
           "hybrid_gdn": "gated delta net"}

# layout -> (layout_runs arguments, features)
LAYOUTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "tp2": (dict(tp=2), _DENSE),
    "tp2_sp": (dict(tp=2, sp=True), SERVED),
    "pp2": (dict(pp=2), SERVED),
    "ep2": (dict(ep=2), _MOE),
}

_REFERENCES: dict[tuple[str, int], dict[str, Any]] = {}


def _references(names: tuple[str, ...], speculative: int = 0) -> dict[str, dict[str, Any]]:
    """The one-process runs of ``names`` (cached; one rank-pool call for the missing ones)."""
    missing = [name for name in names if (name, speculative) not in _REFERENCES]
    if missing:
        for name, result in run_on_ranks(1, reference_runs, missing, speculative)[0].items():
            _REFERENCES[(name, speculative)] = result
    return {name: _REFERENCES[(name, speculative)] for name in names}


def _differences(name: str, reference: dict[str, Any], run: Any, where: str) -> list[str]:
    """How the engine's ``run`` (``(tokens, log_probs)`` or an error) differs from ``reference``'s plain loop."""
    if run[0] == "error":
        return [f"{name} {where}: the engine refused: {run[1]}: {run[2]}"]
    tokens, log_probs = run
    if tokens != reference["tokens"]:
        return [f"{name} {where}: tokens {tokens} != plain loop {reference['tokens']}"]
    out = []
    for index, (got, want) in enumerate(zip(log_probs, reference["log_probs"])):
        try:
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)
        except AssertionError as error:
            out.append(f"{name} {where}: request {index} log-probs: {str(error).splitlines()[2:4]}")
    return out


def _engine_run(result: dict[str, Any]) -> Any:
    return ("error", *result["error"]) if "error" in result else result["engine"]


def test_one_process_engine_equals_plain_loop() -> None:
    references = _references(SERVED)
    differences = [d for name in SERVED for d in _differences(name, references[name],
                                                              _engine_run(references[name]), "one process")]
    assert not differences, "\n".join(differences)


@pytest.mark.distributed_debug_off  # PP sends between stages on groups that later run collectives
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parallel_engine_equals_one_process_plain_loop(layout: str) -> None:
    arguments, names = LAYOUTS[layout]
    references = _references(names)
    weights = {name: references[name]["weights"] for name in names}
    per_rank = run_on_ranks(2, layout_runs, list(names), weights=weights, **arguments)
    differences = [d for name in names for rank, runs in enumerate(per_rank)
                   for d in _differences(name, references[name], runs[name], f"{layout} rank {rank}")]
    assert not differences, "\n".join(differences)


@pytest.mark.parametrize("name,drafts", [("mtp", 1), ("mtp_repeated", 2)])
def test_speculative_decoding_equals_plain_loop(name: str, drafts: int) -> None:
    """MTP drafts change nothing in the greedy tokens, in one process and under TP=2; PP refuses them."""
    reference = _references((name,), speculative=drafts)[name]
    assert not _differences(name, reference, _engine_run(reference), "one process, speculative")
    weights = {name: reference["weights"]}
    for rank, runs in enumerate(run_on_ranks(2, layout_runs, [name], tp=2, weights=weights, speculative=drafts)):
        assert not _differences(name, reference, runs[name], f"tp2 speculative rank {rank}")
    for runs in run_on_ranks(2, layout_runs, [name], pp=2, weights=weights, speculative=drafts):
        assert runs[name][:2] == ("error", "ValueError")
        assert f"num_speculative_tokens ({drafts}) is not supported with pipeline parallelism" in runs[name][2]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_features_raise_value_error_when_the_engine_is_built(name: str) -> None:
    result = _references((name,))[name]
    assert "engine" not in result, f"{name}: the engine served it; move it to SERVED"
    kind, message = result["error"]
    assert kind == "ValueError" and REFUSED[name] in message, result["error"]


@pytest.mark.distributed_debug_off  # PP sends between stages on groups that later run collectives
def test_sequence_parallel_pipeline_engine_equals_one_process_plain_loop() -> None:
    """TP=2 x PP=2 with sequence parallelism: each stage passes its slice of the padded step."""
    names = ("gpt", "moe_shared_bias", "hybrid")
    references = _references(names)
    weights = {name: references[name]["weights"] for name in names}
    per_rank = run_on_ranks(4, layout_runs, list(names), tp=2, pp=2, sp=True, weights=weights)
    differences = [d for name in names for rank, runs in enumerate(per_rank)
                   for d in _differences(name, references[name], runs[name], f"tp2_pp2_sp rank {rank}")]
    assert not differences, "\n".join(differences)


def test_matrix_covers_every_feature() -> None:
    """Every feature is either served (and then under PP, under TP with sequence parallelism, and under TP or EP)
    or refused."""
    assert set(SERVED) | set(REFUSED) == set(FEATURES), set(FEATURES) ^ (set(SERVED) | set(REFUSED))
    assert set(LAYOUTS["pp2"][1]) == set(SERVED) == set(LAYOUTS["tp2"][1]) | set(LAYOUTS["ep2"][1])
    assert set(LAYOUTS["tp2_sp"][1]) == set(SERVED)
