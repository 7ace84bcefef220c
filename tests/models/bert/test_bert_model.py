"""``BertModel`` on its own, fp32 on CPU: padding semantics, the heads against Hugging Face BERT's heads,
sentence embeddings, pipeline stages, and bad arguments / input (``ValueError`` naming the values).

Hugging Face ``BertForPreTraining`` cannot be compared end to end: its layers are post-norm with a
norm on the embeddings, while Megatron-Core's ``BertModel`` (the API mirrored) is pre-norm with a final
norm and has no other block type. Its heads are the same functions, and are compared here.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.models.bert.bert_model import BertModel
from megatron_core.models.bert.pooler import Pooler
from megatron_core.transformer.enums import AttnBackend, ModelType
from tests.models.bert.bert_test_utils import HIDDEN, LENGTHS, SEQ, VOCAB, batch, build, config, randomize


def _model(**kwargs) -> BertModel:
    torch.manual_seed(0)
    model = build(**kwargs)
    randomize(model, seed=1)
    return model


def test_real_tokens_ignore_the_padding():
    model = _model()
    inputs = {k: v for k, v in batch().items() if k != "lm_labels"}
    logits, binary = model(**inputs)
    assert logits.shape == (len(LENGTHS), SEQ, VOCAB) and binary.shape == (len(LENGTHS), 2)
    real = inputs["attention_mask"].bool()
    changed = dict(inputs, input_ids=torch.where(real, inputs["input_ids"], (inputs["input_ids"] + 7) % VOCAB))
    logits2, binary2 = model(**changed)
    torch.testing.assert_close(logits2[real], logits[real], rtol=0, atol=0)
    torch.testing.assert_close(binary2, binary, rtol=0, atol=0)
    assert not torch.allclose(logits2[~real], logits[~real])  # the padded positions did see the change
    assert torch.isfinite(logits).all()


def test_extended_mask_and_position_ids():
    model = build()
    mask = torch.tensor([[1, 1, 0]])
    extended = model.bert_extended_attention_mask(mask)
    assert model.attn_mask_dimensions == "b1ss" and extended.dtype == torch.bool
    assert extended.tolist() == [[[[False, False, True], [False, False, True], [True, True, True]]]]
    assert model.bert_position_ids(torch.zeros(2, 3, dtype=torch.long)).tolist() == [[0, 1, 2]] * 2
    assert model.model_type == ModelType.encoder_or_decoder


def test_heads_match_hugging_face_bert_heads():
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=16)
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(hf_cfg).eval()
    randomize(hf, seed=2)
    ours = build(config(layernorm_epsilon=hf_cfg.layer_norm_eps), share_embeddings_and_output_weights=True).eval()
    hf_state = hf.state_dict()
    mapping = {"lm_head.dense": "cls.predictions.transform.dense", "lm_head.layer_norm": "cls.predictions.transform.LayerNorm",
               "pooler.dense": "bert.pooler.dense", "binary_head": "cls.seq_relationship"}
    with torch.no_grad():
        for ours_name, hf_name in mapping.items():
            for kind in ("weight", "bias"):
                ours.get_parameter(f"{ours_name}.{kind}").copy_(hf_state[f"{hf_name}.{kind}"])
        ours.embedding.word_embeddings.weight.copy_(hf_state["bert.embeddings.word_embeddings.weight"])
        ours.output_layer.bias.copy_(hf_state["cls.predictions.bias"])
        hidden_bsh = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(3))
        want_lm, want_nsp = hf.cls(hidden_bsh, hf.bert.pooler(hidden_bsh))
        hidden_sbh = hidden_bsh.transpose(0, 1)
        logits, _ = ours.output_layer(ours.lm_head(hidden_sbh), weight=ours.shared_embedding_or_output_weight())
        got_nsp = ours.binary_head(ours.pooler(hidden_sbh, 0))
    torch.testing.assert_close(logits.transpose(0, 1), want_lm, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_nsp, want_nsp, rtol=1e-4, atol=1e-4)


def test_return_embeddings_averages_the_tokens_between_cls_and_sep():
    model = _model(return_embeddings=True)
    inputs = {k: v for k, v in batch().items() if k != "lm_labels"}
    got = model(**inputs)
    model.return_embeddings = False
    model.post_process = False  # the encoder output [s, b, h]
    hidden = model(**inputs)
    want = torch.stack([hidden[1:n - 1, i].mean(dim=0) for i, n in enumerate(LENGTHS)])
    assert got.shape == (len(LENGTHS), HIDDEN) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_pipeline_stages_compose_to_the_full_model():
    full = _model(share_embeddings_and_output_weights=False)
    cfg = config(num_layers=1)
    first = build(cfg, post_process=False, share_embeddings_and_output_weights=False)
    last = build(cfg, pre_process=False, share_embeddings_and_output_weights=False)
    assert not hasattr(first, "lm_head") and not hasattr(last, "embedding")
    state = full.state_dict()
    first.load_state_dict({k: v for k, v in state.items() if k in first.state_dict()})
    # The last stage's only layer is the full model's second one.
    renamed = {k.replace("encoder.layers.1.", "encoder.layers.0."): v for k, v in state.items()
               if not k.startswith("encoder.layers.0.")}
    last.load_state_dict({k: v for k, v in renamed.items() if k in last.state_dict()})
    inputs = batch()
    want_loss, want_binary = full(**inputs)
    last.set_input_tensor(first(**inputs))
    got_loss, got_binary = last(None, inputs["attention_mask"], lm_labels=inputs["lm_labels"])
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_binary, want_binary, rtol=1e-6, atol=1e-6)


def test_rope_replaces_learned_positions():
    model = _model(position_embedding_type="rope")
    assert not hasattr(model.embedding, "position_embeddings")
    inputs = batch()
    loss, _ = model(**inputs)
    assert loss.shape == inputs["input_ids"].shape and torch.isfinite(loss).all()


def test_pooler_picks_the_requested_position():
    pooler = Pooler(HIDDEN, torch.nn.init.normal_, config())
    hidden = torch.randn(4, 2, HIDDEN)
    torch.testing.assert_close(pooler(hidden, 2), torch.tanh(pooler.dense(hidden[2])))


@pytest.mark.parametrize(("change", "message"), [
    (dict(tokentype_ids=torch.zeros(3, 8, dtype=torch.long)), r"tokentype_ids given but BertModel was built with "
                                                              r"num_tokentypes=0"),
    (dict(attention_mask=torch.ones(3, 7)), r"attention_mask shape \(3, 7\) must equal input_ids shape \(3, 8\)"),
    (dict(attention_mask=torch.ones(3, 1, 8)), r"attention_mask of shape \[b, s\].*got \(3, 1, 8\)"),
    (dict(lm_labels=torch.zeros(3, 4, dtype=torch.long)), r"lm_labels shape \(3, 4\) must equal attention_mask "
                                                          r"shape \(3, 8\)"),
    (dict(input_ids=torch.zeros(1, 20, dtype=torch.long), attention_mask=torch.ones(1, 20)),
     r"input sequence length 20 exceeds the model's max_sequence_length 16"),
])
def test_bad_input_is_named(change, message):
    model = build(num_tokentypes=0)
    inputs = dict(batch(), tokentype_ids=None)
    inputs.update(change)
    with pytest.raises(ValueError, match=message):
        model(**inputs)


def test_missing_or_misshapen_tokentype_ids_are_named():
    model = build(num_tokentypes=2)
    inputs = batch()
    with pytest.raises(ValueError, match=r"num_tokentypes=2: tokentype_ids \[b, s\] are required"):
        model(**dict(inputs, tokentype_ids=None))
    with pytest.raises(ValueError, match=r"tokentype_ids shape \(3, 2\) must equal input_ids shape \(3, 8\)"):
        model(**dict(inputs, tokentype_ids=torch.zeros(3, 2, dtype=torch.long)))


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(return_embeddings=True, add_binary_head=False), r"return_embeddings=True needs post_process=True and "
                                                          r"add_binary_head=True, got post_process=True, "
                                                          r"add_binary_head=False"),
    (dict(position_embedding_type="yarn"), r"position_embedding_type \('yarn'\) must be one of"),
    (dict(num_tokentypes=-1), r"num_tokentypes \(-1\) must be an int >= 0"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build(**kwargs)


def test_local_spec_refuses_a_transformer_engine_backend():
    with pytest.raises(ValueError, match=r"attention_backend \(flash\) must be local or auto"):
        build(config(attention_backend=AttnBackend.flash))
