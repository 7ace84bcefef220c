"""Parallel training through the real step path equals one process, feature by feature.

Each model feature (``parallel_step_features.FEATURES``: llama-like GPT, q/k layernorm, q/k L2 norm, tied
embeddings, learned positions, gpt2-like biases + LayerNorm, attention output gate, attention sinks, MLA with
and without ``q_lora_rank``, DSA, gated delta net layers, MoE with grouped / sequential experts, shared experts,
expert bias, latent MoE, quantile balancing and aux losses, MTP, the hybrid Mamba and gated-delta-net models)
trains for 3 Adam steps (fp32, no dropout, fixed data) through what users run: ``get_model``
(``DistributedDataParallel``), ``get_forward_backward_func()``, ``finalize_model_grads`` and
``get_megatron_optimizer`` (``optimizer.step()`` with grad clipping), once in one process and once on 2 gloo
ranks per layout (TP=2, TP=2 + SP, CP=2, PP=2, DP=2 with the distributed optimizer, EP=2). Every tensor of the
sharded state dict (parameters and buffers such as the routers' expert bias) is compared in its global layout
(1e-5), together with each step's loss and grad norm; tensors that several ranks hold must be identical on all
of them (a TP-replicated weight whose gradient misses a reduction drifts apart on the ranks).

Each layout trains its features in one rank-pool call (two: the core features, and the rest marked slow). MoE under TP needs sequence parallelism (refused
without it, as in Megatron-Core), so the plain TP=2 layout has no MoE features; attention sinks are refused under
CP. ``cp2``, ``tp2`` and ``ep2`` train with ``calculate_per_token_loss``; the others with the default mean of
per-microbatch means.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist_harness import run_on_ranks
from tests.training.parallel_step_compare import differences_from_one_process, mean_losses
from tests.training.parallel_step_features import FEATURES, LAYOUTS
from tests.training.parallel_step_runner import assemble, train_features

WORLD = 2

_GPT = ("gpt", "qk_layernorm", "qk_l2_norm", "tied", "learned_absolute", "gpt2", "output_gate", "sinks",
        "mla", "mla_no_q_lora", "dsa", "gdn")
_MOE = ("moe_grouped", "moe_sequential", "moe_shared_bias", "moe_latent", "moe_quantile")
_REST = ("mtp", "hybrid", "hybrid_gdn")

# layout -> (features, {feature expected to fail: reason})
MATRIX: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "tp2": (_GPT + _REST, {}),
    "tp2_sp": (_GPT + _MOE + _REST, {}),
    "cp2": (tuple(f for f in _GPT if f != "sinks") + _MOE + _REST, {}),
    "pp2": (_GPT + _MOE + _REST, {}),
    "dp2_distopt": (_GPT + _MOE + _REST, {}),
    "ep2": (_MOE, {}),
}


# Run in the edit-test loop; a layout's other features are marked slow (the whole file takes about 40 s on 2 cores).
_CORE = ("gpt", "qk_layernorm", "tied", "gpt2", "mla", "moe_shared_bias", "mtp", "hybrid")


def _params() -> list[Any]:
    params = []
    for layout, (names, failing) in MATRIX.items():
        core = tuple(name for name in names if name in _CORE)
        more = tuple(name for name in names if name not in _CORE)
        params.append(pytest.param(layout, core, id=f"{layout}-core"))
        if more:
            params.append(pytest.param(layout, more, id=f"{layout}-more", marks=pytest.mark.slow))
        for name, reason in failing.items():
            params.append(pytest.param(layout, (name,), id=f"{layout}-{name}",
                                       marks=pytest.mark.xfail(strict=True, reason=reason)))
    return params


_REFERENCES: dict[tuple[bool, str], dict[str, Any]] = {}


def _references(per_token: bool, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The one-process runs of ``names`` (cached per loss normalisation and feature; one rank pool call)."""
    missing = [name for name in names if (per_token, name) not in _REFERENCES]
    if missing:
        mode = "one_process_per_token" if per_token else "one_process_mean"
        for name, result in run_on_ranks(1, train_features, missing, mode)[0].items():
            initial, init_problems = assemble([result["initial"]])
            final, final_problems = assemble([result["final"]])
            assert not init_problems + final_problems, init_problems + final_problems
            _REFERENCES[(per_token, name)] = dict(initial=initial, final=final, losses=mean_losses([result]),
                                                  grad_norms=result["grad_norms"])
    return {name: _REFERENCES[(per_token, name)] for name in names}


@pytest.mark.distributed_debug_off  # PP and the MTP roll under CP send/recv on groups that later run collectives
@pytest.mark.parametrize("layout,names", _params())
def test_parallel_training_matches_one_process(layout: str, names: tuple[str, ...]) -> None:
    assert set(names) <= set(FEATURES), set(names) - set(FEATURES)
    references = _references(LAYOUTS[layout].per_token, names)
    initial = {name: ref["initial"] for name, ref in references.items()}
    per_rank = run_on_ranks(WORLD, train_features, list(names), layout, initial)
    differences = [d for name in names for d in differences_from_one_process(name, references[name], [r[name] for r in per_rank])]
    assert not differences, f"{layout}: parallel training differs from one process:\n" + "\n".join(differences)


def test_matrix_covers_every_feature_and_layout() -> None:
    """Every layout is exercised (with unmarked cases), and every feature runs under TP+SP, PP and DP (the other
    layouts leave out only what they refuse: MoE without SP, attention sinks under CP, dense models under EP)."""
    assert set(MATRIX) == set(LAYOUTS)
    assert all(set(names) & set(_CORE) for names, _ in MATRIX.values())
    for layout in ("tp2_sp", "pp2", "dp2_distopt"):
        assert set(MATRIX[layout][0]) == set(FEATURES), (layout, set(FEATURES) - set(MATRIX[layout][0]))
