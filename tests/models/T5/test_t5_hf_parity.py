"""``T5Model`` against Hugging Face's T5 (``T5ForConditionalGeneration``) in a configuration both describe.

Megatron-Core's T5 matches T5 v1.0's architecture with: relative position buckets
(``position_embedding_type='relative'``), RMSNorm, no linear biases, no ``1/sqrt(d)`` attention scaling
(``softmax_scale=1.0``), a ReLU MLP and an untied output layer. Hugging Face's ``q``/``k``/``v`` weights
map onto the fused per-head ``linear_qkv`` (and ``k``/``v`` onto the cross-attention's per-head ``linear_kv``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.T5 import t5_test_utils as t5

BUCKETS, MAX_DISTANCE = 8, 16
HN = t5.HIDDEN // t5.HEADS


def _per_head(*weights: torch.Tensor) -> torch.Tensor:
    """Rows of each ``[heads * hn, h]`` weight interleaved head by head (Megatron's fused layouts)."""
    per_head = [w.reshape(t5.HEADS, HN, -1) for w in weights]
    return torch.cat(per_head, dim=1).reshape(len(weights) * t5.HIDDEN, -1)


def _from_hf(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {"embedding.word_embeddings.weight": hf["shared.weight"], "output_layer.weight": hf["lm_head.weight"],
             "lm_head.output_layer.weight": hf["lm_head.weight"],  # the same module under both names
             "encoder.final_layernorm.weight": hf["encoder.final_layer_norm.weight"],
             "decoder.final_layernorm.weight": hf["decoder.final_layer_norm.weight"]}
    for stack in ("encoder", "decoder"):
        state[f"{stack}_relative_pos_emb.relative_attention_bias.weight"] = hf[
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        for i in range(t5.LAYERS):
            src, dst = f"{stack}.block.{i}.layer.", f"{stack}.layers.{i}."
            attn = f"{src}0.SelfAttention."
            state[f"{dst}input_layernorm.weight"] = hf[f"{src}0.layer_norm.weight"]
            state[f"{dst}self_attention.linear_qkv.weight"] = _per_head(*(hf[f"{attn}{p}.weight"] for p in "qkv"))
            state[f"{dst}self_attention.linear_proj.weight"] = hf[f"{attn}o.weight"]
            ff = 1
            if stack == "decoder":
                cross = f"{src}1.EncDecAttention."
                state[f"{dst}pre_cross_attn_layernorm.weight"] = hf[f"{src}1.layer_norm.weight"]
                state[f"{dst}cross_attention.linear_q.weight"] = hf[f"{cross}q.weight"]
                state[f"{dst}cross_attention.linear_kv.weight"] = _per_head(hf[f"{cross}k.weight"],
                                                                           hf[f"{cross}v.weight"])
                state[f"{dst}cross_attention.linear_proj.weight"] = hf[f"{cross}o.weight"]
                ff = 2
            state[f"{dst}pre_mlp_layernorm.weight"] = hf[f"{src}{ff}.layer_norm.weight"]
            state[f"{dst}mlp.linear_fc1.weight"] = hf[f"{src}{ff}.DenseReluDense.wi.weight"]
            state[f"{dst}mlp.linear_fc2.weight"] = hf[f"{src}{ff}.DenseReluDense.wo.weight"]
    return state


def test_matches_hugging_face_t5():
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.T5Config(
        vocab_size=t5.VOCAB, d_model=t5.HIDDEN, d_kv=HN, d_ff=t5.FFN, num_layers=t5.LAYERS,
        num_decoder_layers=t5.LAYERS, num_heads=t5.HEADS, relative_attention_num_buckets=BUCKETS,
        relative_attention_max_distance=MAX_DISTANCE, dropout_rate=0.0, layer_norm_epsilon=1e-6,
        feed_forward_proj="relu", tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(hf_config).eval()
    t5.randomize(hf, seed=1)
    cfg = t5.config(normalization="RMSNorm", add_bias_linear=False, softmax_scale=1.0, activation_func=F.relu,
                    layernorm_epsilon=1e-6)
    ours = t5.model(cfg, position_embedding_type="relative", relative_attention_num_buckets=BUCKETS,
                    relative_attention_max_distance=MAX_DISTANCE)
    missing, unexpected = ours.load_state_dict(_from_hf(hf.state_dict()), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing

    batch = t5.inputs(seed=2)
    enc_keep = (~batch["encoder_attn_mask"][:, 0, 0, :]).long()  # [b, se]: 1 = attend
    dec_keep = (~batch["decoder_attn_mask"][:, 0, -1, :]).long()  # last row: causal part all visible
    want = hf(input_ids=batch["encoder_input_ids"], attention_mask=enc_keep,
              decoder_input_ids=batch["decoder_input_ids"], decoder_attention_mask=dec_keep).logits
    got = ours(**{k: v for k, v in batch.items() if k != "lm_labels"})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
