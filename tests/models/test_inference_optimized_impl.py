"""``TransformerConfig(transformer_impl="inference_optimized")``: the decoder's layers are
``get_gpt_layer_with_inference_spec``'s, as Megatron-Core 0.19 builds them, and compute what the local layers do."""

from __future__ import annotations

import pytest
import torch

from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron_core.transformer import TransformerConfig

BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, use_cpu_initialization=True,
            add_bias_linear=False, normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0)


@pytest.mark.parametrize("moe", [False, True])
def test_inference_optimized_impl_builds_the_inference_layers_and_equals_local(moe: bool):
    extra = dict(num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[0, 1]) if moe else {}
    local_cfg = TransformerConfig(**BASE, **extra)
    inf_cfg = TransformerConfig(**BASE, **extra, transformer_impl="inference_optimized")
    torch.manual_seed(0)
    local = GPTModel(local_cfg, get_gpt_decoder_block_spec(local_cfg, False), 64, 16).eval()
    inference = GPTModel(inf_cfg, get_gpt_decoder_block_spec(inf_cfg, False), 64, 16).eval()
    # The inference spec files each separate norm under the fused module's checkpoint name.
    keys = [getattr(v, "key", "") for v in inference.sharded_state_dict().values()]
    assert any(k.endswith("self_attention.linear_qkv.layer_norm_weight") for k in keys)
    inference.load_state_dict(local.state_dict(), strict=True)
    ids = torch.randint(0, 64, (2, 8))
    pos = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(inference(ids, pos, None), local(ids, pos, None), rtol=1e-6, atol=1e-6)


def test_unknown_transformer_impl_is_refused_by_name():
    with pytest.raises(ValueError, match=r"transformer_impl \('flash'\) must be one of"):
        TransformerConfig(**BASE, transformer_impl="flash")
