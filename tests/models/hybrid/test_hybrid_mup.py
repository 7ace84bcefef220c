"""muP on the hybrid model follows the same rules as GPT (one implementation in ``LanguageModule``).

Before issue #40 the hybrid model built its output layer with ``init_method`` (which muP scales down by
``1/sqrt(width_mult)``) and never applied ``mup_output_mult`` to its logits, so its logits grew with the width.
"""

from __future__ import annotations

import torch

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.models.hybrid import HybridModel, hybrid_layer_specs
from tests.models.mamba.mamba_test_utils import VOCAB, batch, config

WIDTH, BASE, STD = 64, 16, 0.05


def _hybrid(use_mup: bool, width: int = WIDTH, seed: int = 0) -> HybridModel:
    torch.manual_seed(seed)
    cfg = config("M*-", hidden_size=width, use_mup=use_mup, mup_base_hidden_size=BASE if use_mup else None,
                 init_method_std=STD)
    return HybridModel(cfg, hybrid_layer_specs.hybrid_stack_spec, VOCAB, 32, hybrid_layer_pattern="M*-")


def _capture_output_layer(model: HybridModel) -> dict:
    captured: dict = {}

    def hook(_module, _inputs, output) -> None:
        captured["raw"] = output[0]

    model.output_layer.register_forward_hook(hook)
    return captured


def test_untied_output_layer_starts_like_the_embedding_as_in_gpt():
    model = _hybrid(True)
    assert model.config.mup_width_mult == WIDTH / BASE
    hybrid_std = model.output_layer.weight.std().item()
    torch.manual_seed(0)
    gpt = GPTModel(model.config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=32)
    gpt_std = gpt.output_layer.weight.std().item()
    # Both at the embedding's width-independent std, not init_method's STD / sqrt(width_mult) = STD / 2.
    assert abs(hybrid_std - STD) < 0.1 * STD, hybrid_std
    assert abs(hybrid_std - gpt_std) < 0.1 * STD, (hybrid_std, gpt_std)


def test_logits_carry_the_mup_output_multiplier():
    model = _hybrid(True).eval()
    ids, pos, _ = batch()
    captured = _capture_output_layer(model)
    with torch.no_grad():
        logits = model(ids, pos, None)
    expected = captured["raw"].transpose(0, 1) * model.config.mup_output_mult
    assert model.config.mup_output_mult == BASE / WIDTH
    torch.testing.assert_close(logits, expected)


def test_without_mup_nothing_changes():
    model = _hybrid(False).eval()
    ids, pos, _ = batch()
    captured = _capture_output_layer(model)
    with torch.no_grad():
        logits = model(ids, pos, None)
    torch.testing.assert_close(logits, captured["raw"].transpose(0, 1))


def test_logit_scale_is_width_independent_under_mup():
    """A coordinate check at init: muP's logits keep their size from width 64 to 256 (SP's would not)."""
    ids, pos, _ = batch()
    sizes = []
    for width in (64, 256):
        with torch.no_grad():
            sizes.append(_hybrid(True, width).eval()(ids, pos, None).std().item())
    assert max(sizes) / min(sizes) < 2.0, sizes
