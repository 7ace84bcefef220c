"""The Mamba sizes and ``is_hybrid_model`` are real TransformerConfig fields (not Megatron-only placeholders):
the mixer reads the sizes, and ``is_hybrid_model`` sets the output-layer init's depth multiplier to 1."""

from __future__ import annotations

import dataclasses

import torch

from megatron_core.transformer import TransformerConfig
from tests.models.mamba.mamba_test_utils import build

MAMBA_FIELDS = ("is_hybrid_model", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")


def test_mamba_fields_are_plain_config_fields():
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    for name in MAMBA_FIELDS:
        assert not {"ignored", "refused"} & set(fields[name].metadata), name
    defaults = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)
    assert (defaults.mamba_state_dim, defaults.mamba_head_dim, defaults.mamba_num_groups,
            defaults.mamba_num_heads, defaults.is_hybrid_model) == (128, 64, 8, None, False)


def test_mixer_reads_the_sizes():
    mixer = build("M", mamba_num_heads=8, mamba_state_dim=4).decoder.layers[0].mixer
    assert (mixer.nheads, mixer.d_state, mixer.headdim, mixer.ngroups) == (8, 4, 8, 2)
    assert mixer.in_proj.weight.shape[0] == 2 * 8 * 8 + 2 * 2 * 4 + 8


def test_is_hybrid_model_scales_output_init_by_num_layers_only():
    stds = {}
    for hybrid in (False, True):
        cfg = TransformerConfig(num_layers=8, hidden_size=8, num_attention_heads=2, init_method_std=0.5,
                                is_hybrid_model=hybrid)
        weight = torch.empty(4000, 50)
        torch.manual_seed(0)
        cfg.output_layer_init_method(weight)
        stds[hybrid] = weight.std().item()
    torch.testing.assert_close(stds[False], 0.5 / (2 * 8) ** 0.5, rtol=0.02, atol=0)
    torch.testing.assert_close(stds[True], 0.5 / 8 ** 0.5, rtol=0.02, atol=0)
