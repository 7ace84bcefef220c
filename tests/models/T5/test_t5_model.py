"""``T5Model`` against megatron-core's own T5Model (the installed 0.16.1, on CPU), and its input checks.

The oracle runs in a rank-pool worker (see tests/megatron_oracle.py). Megatron-Core's local block specs name
``TENorm`` as the final norm, which is ``None`` without Transformer Engine; the oracle's block specs get its
``WrappedTorchNorm`` there instead (what TE's LayerNorm computes), matching this library's local specs.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.megatron_oracle import megatron_on_cpu
from tests.models.T5 import t5_test_utils as t5

CASES = {
    "untied_learned": dict(share_embeddings_and_output_weights=False, position_embedding_type="learned_absolute"),
    "tied_rope": dict(share_embeddings_and_output_weights=True, position_embedding_type="rope"),
}


def _their_model(case: dict):
    from megatron.core.models.T5 import T5Model as TheirModel
    from megatron.core.models.T5 import t5_spec as their_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm as TheirNorm
    from megatron.core.transformer.transformer_config import TransformerConfig as TheirConfig

    cfg = TheirConfig(**t5.CONFIG_FIELDS)
    encoder = their_spec.get_t5_encoder_with_local_block_spec(t5.LAYERS)
    decoder = their_spec.get_t5_decoder_with_local_block_spec(t5.LAYERS)
    encoder.layer_norm = decoder.layer_norm = TheirNorm
    return TheirModel(cfg, cfg, encoder, decoder, vocab_size=t5.VOCAB, max_sequence_length=t5.MAX_SEQ, **case)


def _sharded_keys(model: torch.nn.Module) -> dict:
    """Each sharded-state entry's checkpoint key, global shape and replica id."""
    return {name: (entry.key, tuple(getattr(entry, "global_shape", ()) or ()), entry.replica_id)
            for name, entry in model.sharded_state_dict().items()}


def _compare_with_megatron(case_name: str) -> list[str]:
    case = CASES[case_name]
    with megatron_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(3)
        theirs = _their_model(case)
        t5.randomize(theirs, seed=4)
        ours = t5.model(**case)
        their_state = theirs.state_dict()
        assert sorted(ours.state_dict()) == sorted(their_state)
        for key, value in ours.state_dict().items():
            if isinstance(value, torch.Tensor):
                assert value.shape == their_state[key].shape, key
        ours.load_state_dict(their_state)
        assert _sharded_keys(ours) == _sharded_keys(theirs)
        batch = t5.inputs(seed=5)
        logits_in = {k: v for k, v in batch.items() if k != "lm_labels"}
        torch.testing.assert_close(ours(**logits_in), theirs(**logits_in), rtol=1e-5, atol=1e-5)
        want, got = theirs(**batch), ours(**batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        weights = torch.rand(got.shape, generator=torch.Generator().manual_seed(6))
        (want * weights).sum().backward()
        (got * weights).sum().backward()
        their_params = dict(theirs.named_parameters())
        names = []
        for name, param in ours.named_parameters():
            ref = their_params[name].grad
            torch.testing.assert_close(param.grad, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()),
                                       msg=lambda m, n=name: f"{case_name} {n}: {m}")
            names.append(name)
        return sorted(ours.state_dict())


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_matches_megatron_core_t5_model(case_name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core.models.T5.t5_model")
    (keys,) = run_on_ranks(1, _compare_with_megatron, case_name)
    layer = "decoder.layers.0."
    assert {k[len(layer):].rsplit(".", 1)[0] for k in keys if k.startswith(layer)} == {
        "input_layernorm", "self_attention.linear_qkv", "self_attention.linear_proj", "pre_cross_attn_layernorm",
        "cross_attention.linear_q", "cross_attention.linear_kv", "cross_attention.linear_proj", "pre_mlp_layernorm",
        "mlp.linear_fc1", "mlp.linear_fc2"}
    tied = CASES[case_name]["share_embeddings_and_output_weights"]
    assert ("lm_head.output_layer.bias" in keys) == tied and ("output_layer.weight" in keys) == (not tied)


def test_encoder_only_output_and_precomputed_encoder_states():
    model = t5.model()
    t5.randomize(model, seed=1)
    batch = t5.inputs()
    hidden = model(**batch, output_encoder_hidden_only=True)
    assert hidden.shape == (t5.ENC_LEN, t5.BATCH, t5.HIDDEN)
    # Decoding from the encoder's output gives the same loss as the full forward.
    torch.testing.assert_close(model(**{**batch, "encoder_input_ids": None}, encoder_hidden_states=hidden),
                               model(**batch), rtol=0, atol=0)


def test_relative_position_bias_matches_hugging_face_t5():
    transformers = pytest.importorskip("transformers")
    from megatron_core.models.common.embeddings.relative_pos_embedding import RelativePositionEmbedding

    for decoder in (False, True):
        hf_config = transformers.T5Config(d_model=t5.HIDDEN, num_heads=t5.HEADS, d_kv=16, is_decoder=decoder,
                                          relative_attention_num_buckets=32, relative_attention_max_distance=20)
        hf = transformers.models.t5.modeling_t5.T5Attention(hf_config, has_relative_attention_bias=True)
        ours = RelativePositionEmbedding(bidirectional=not decoder, init_method=torch.nn.init.normal_,
                                         num_attention_heads=t5.HEADS, relative_attention_num_buckets=32,
                                         relative_attention_max_distance=20)
        with torch.no_grad():
            hf.relative_attention_bias.weight.copy_(ours.relative_attention_bias.weight)
            torch.testing.assert_close(ours(40, 40), hf.compute_bias(40, 40), rtol=0, atol=0)


def test_relative_model_runs_and_learns_the_bias():
    model = t5.model(position_embedding_type="relative", relative_attention_num_buckets=8,
                     relative_attention_max_distance=16)
    t5.randomize(model, seed=2)
    assert model.position_embeddings is None and not model.embedding.add_position_embedding
    loss = model(**t5.inputs())
    loss.sum().backward()
    for name in ("encoder_relative_pos_emb", "decoder_relative_pos_emb"):
        grad = getattr(model, name).relative_attention_bias.weight.grad
        assert grad is not None and grad.abs().sum() > 0


@pytest.mark.parametrize("field, value, words", [
    ("encoder_attn_mask", torch.zeros(2, 1, 12, 11, dtype=torch.bool), ["encoder_attn_mask", "(2, 1, 12, 11)",
                                                                        "[2, 1, 12, 12]"]),
    ("encoder_decoder_attn_mask", torch.zeros(2, 1, 8, 8, dtype=torch.bool),
     ["encoder_decoder_attn_mask", "(2, 1, 8, 8)", "[2, 1, 8, 12]"]),
    ("lm_labels", torch.zeros(2, 7, dtype=torch.long), ["lm_labels", "(2, 7)", "[2, 8]"]),
    ("decoder_input_ids", torch.zeros(3, 8, dtype=torch.long), ["batch", "(2, 12)", "(3, 8)"]),
    ("encoder_input_ids", torch.zeros(2, 40, dtype=torch.long), ["40", "max_sequence_length 32"]),
])
def test_bad_inputs_name_the_values(field, value, words):
    model = t5.model()
    batch = {**t5.inputs(), field: value}
    with pytest.raises(ValueError) as err:
        model(**batch)
    for word in words:
        assert word in str(err.value)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"position_embedding_type \('alibi'\)"):
        t5.model(position_embedding_type="alibi")
    with pytest.raises(ValueError, match="add_encoder and add_decoder"):
        t5.model(add_encoder=False, add_decoder=False)
    with pytest.raises(ValueError, match=r"vocab_size \(0\)"):
        from megatron_core.models.T5 import T5Model
        from megatron_core.models.T5.t5_spec import get_t5_decoder_with_local_block_spec as dec
        from megatron_core.models.T5.t5_spec import get_t5_encoder_with_local_block_spec as enc

        T5Model(t5.config(), t5.config(), enc(2), dec(2), vocab_size=0, max_sequence_length=8)


def _checkpoint_round_trip(directory: str) -> bool:
    from megatron_core import dist_checkpointing

    source = t5.model(share_embeddings_and_output_weights=True)
    t5.randomize(source, seed=7)
    dist_checkpointing.save(source.sharded_state_dict(), directory)
    target = t5.model(share_embeddings_and_output_weights=True)
    target.load_state_dict(dist_checkpointing.load(target.sharded_state_dict(), directory))
    batch = t5.inputs()
    torch.testing.assert_close(target(**batch), source(**batch), rtol=0, atol=0)
    return True


def test_distributed_checkpoint_round_trip(tmp_path):
    assert run_on_ranks(1, _checkpoint_round_trip, str(tmp_path)) == [True]
