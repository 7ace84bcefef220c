"""``BertModel`` against the installed Megatron-Core's own ``BertModel`` (local spec), fp32 on CPU.

Same state-dict keys and shapes; on the same weights the same LM logits, binary (NSP) logits,
per-token loss and gradients, tied and untied, with and without token types and the binary head,
and the same ``return_embeddings`` sentence embeddings. Right-padded samples are compared on their
real tokens: a padding token's query row has every key masked, where Megatron's local softmax
averages all values and SDPA returns zeros; those rows never reach a real token or the loss mask.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.megatron_oracle import megatron_on_cpu
from tests.models.bert.bert_test_utils import (
    CONFIG,
    MAX_SEQ,
    VOCAB,
    batch,
    build,
    masked_objective,
    randomize,
)

CASES = [
    dict(num_tokentypes=2, share_embeddings_and_output_weights=True, add_binary_head=True),
    dict(num_tokentypes=0, share_embeddings_and_output_weights=False, add_binary_head=False),
]


def _inputs(num_tokentypes: int) -> dict[str, torch.Tensor]:
    inputs = batch()
    if not num_tokentypes:
        inputs["tokentype_ids"] = None
    return inputs


def _compare(theirs: torch.nn.Module, ours: torch.nn.Module, num_tokentypes: int) -> None:
    inputs = _inputs(num_tokentypes)
    mask = inputs["attention_mask"]
    real = mask.bool()
    without_labels = {k: v for k, v in inputs.items() if k != "lm_labels"}
    (want_logits, want_binary), (got_logits, got_binary) = theirs(**without_labels), ours(**without_labels)
    assert got_logits.shape == want_logits.shape == (*mask.shape, VOCAB)
    torch.testing.assert_close(got_logits[real], want_logits[real], rtol=1e-5, atol=1e-5)
    if want_binary is None:
        assert got_binary is None
    else:
        torch.testing.assert_close(got_binary, want_binary, rtol=1e-5, atol=1e-5)
    (want_loss, want_binary), (got_loss, got_binary) = theirs(**inputs), ours(**inputs)
    torch.testing.assert_close(got_loss[real], want_loss[real], rtol=1e-5, atol=1e-5)
    masked_objective(want_loss, want_binary, mask).backward()
    masked_objective(got_loss, got_binary, mask).backward()
    their_params = dict(theirs.named_parameters())
    assert set(their_params) == {name for name, _ in ours.named_parameters()}
    for name, param in ours.named_parameters():
        assert torch.isfinite(param.grad).all(), name
        torch.testing.assert_close(param.grad, their_params[name].grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _compare_with_megatron() -> list[list[str]]:
    keys = []
    with megatron_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec as their_spec
        from megatron.core.models.bert.bert_model import BertModel as TheirModel
        from megatron.core.transformer.transformer_config import TransformerConfig as TheirConfig

        for case in CASES:
            torch.manual_seed(4)
            theirs = TheirModel(TheirConfig(**CONFIG), transformer_layer_spec=their_spec, vocab_size=VOCAB,
                                max_sequence_length=MAX_SEQ, **case)
            randomize(theirs, seed=5)
            ours = build(**case)
            their_state, our_state = theirs.state_dict(), ours.state_dict()
            assert set(our_state) == set(their_state)
            for key, value in their_state.items():
                if isinstance(value, torch.Tensor):
                    assert our_state[key].shape == value.shape, key
            ours.load_state_dict(their_state)
            _compare(theirs, ours, case["num_tokentypes"])
            keys.append(sorted(our_state))

        # Megatron-Core's constructor cannot take return_embeddings=True (it reads self.post_process before setting
        # it): switch it on after construction to compare the forward.
        inputs = {k: v for k, v in _inputs(2).items() if k != "lm_labels"}
        torch.manual_seed(4)
        theirs = TheirModel(TheirConfig(**CONFIG), transformer_layer_spec=their_spec, vocab_size=VOCAB,
                            max_sequence_length=MAX_SEQ, **CASES[0])
        randomize(theirs, seed=6)
        theirs.return_embeddings = True
        ours_tied = build(**CASES[0], return_embeddings=True)
        ours_tied.load_state_dict(theirs.state_dict())
        with torch.no_grad():
            want, got = theirs(**inputs), ours_tied(**inputs)
        assert got.shape == want.shape == (inputs["input_ids"].shape[0], CONFIG["hidden_size"])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return keys


def test_matches_megatron_core_bert_model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core.models.bert.bert_model")
    (keys,) = run_on_ranks(1, _compare_with_megatron)
    tied, untied = (set(k) for k in keys)
    heads = {"lm_head.dense.weight", "lm_head.dense.bias", "lm_head.layer_norm.weight", "lm_head.layer_norm.bias",
             "output_layer.bias", "encoder.final_layernorm.weight", "embedding.position_embeddings.weight"}
    assert heads <= tied and heads <= untied
    assert {"pooler.dense.weight", "binary_head.weight", "embedding.tokentype_embeddings.weight"} <= tied
    assert "output_layer.weight" not in tied and "output_layer.weight" in untied
    assert not any(k.startswith(("pooler.", "binary_head.", "embedding.tokentype")) for k in untied)
