"""Multi-token prediction (``transformer.multi_token_prediction``, ``GPTModel(mtp_block_spec=...)``).

- Against Megatron-Core (the installed megatron-core as an oracle, in a rank-pool process): the same weights give
  the same per-token loss and every gradient, MTP losses included, with one and two depths.
- Against a direct computation of DeepSeek-V3's MTP objective from the model's own modules.
- ``roll_tensor``: plain, packed sequences, and under context parallelism (2 ranks) equal to the full-sequence roll.
- Placement helpers, repeated layers, detached heads, checkpoint keys and errors.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_core import parallel_state
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.multi_token_prediction import (
    MTPLossAutoScaler,
    MTPLossLoggingHelper,
    get_mtp_ranks,
    roll_tensor,
)
from tests.dist_harness import run_on_ranks
from tests.megatron_oracle import megatron_on_cpu

VOCAB, SEQ, MAX_SEQ = 64, 12, 16
CONFIG = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
              normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
              hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)


@pytest.fixture(autouse=True)
def _clean_tracker():
    MTPLossLoggingHelper.tracker.clear()
    yield
    MTPLossLoggingHelper.tracker.clear()


def _model(depths: int, seed: int = 0, **overrides) -> GPTModel:
    torch.manual_seed(seed)
    config = TransformerConfig(**{**CONFIG, "mtp_num_layers": depths, **overrides})
    block = get_gpt_decoder_block_spec(config, False)
    return GPTModel(config, block, VOCAB, MAX_SEQ, position_embedding_type="rope",
                    mtp_block_spec=get_gpt_mtp_block_spec(config, block, False))


def _batch(seed: int = 3) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    loss_mask = (torch.rand(2, SEQ, generator=gen) > 0.2).float()
    return ids, torch.arange(SEQ).expand(2, -1), labels, loss_mask


# --- the objective, computed directly ----------------------------------------------------------------------------
def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` shifted left ``k`` tokens, zero-filled."""
    return torch.cat([x[:, k:], torch.zeros_like(x[:, :k])], dim=1) if k else x


def _direct_objective(model: GPTModel, ids, pos, labels, loss_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """``(per-token main loss, main mean + scale / D * sum_k masked mean of depth k's loss)`` from the modules."""
    cfg = model.config
    emb = model.embedding(input_ids=ids, position_ids=pos)
    rope = model.rotary_pos_emb(SEQ)
    hidden = model.decoder(hidden_states=emb, attention_mask=None, rotary_pos_emb=rope)

    def token_loss(h, target):
        logits, _ = model.output_layer(h)
        return F.cross_entropy(logits.transpose(0, 1).reshape(-1, VOCAB), target.reshape(-1),
                               reduction="none").view(2, SEQ)

    main = token_loss(hidden, labels)
    total = main.mean()
    for k in range(1, cfg.mtp_num_layers + 1):
        layer = model.mtp.layers[k - 1]
        e = model.embedding(input_ids=_shift(ids, k), position_ids=_shift(pos, k))
        x, _ = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(hidden)], dim=-1))
        x, _ = layer.mtp_model_layer(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
        hidden = layer.final_layernorm(x)
        mask = _shift(loss_mask, k)
        total = total + cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers * (
            (token_loss(hidden, _shift(labels, k)) * mask).sum() / mask.sum())
    return main, total


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_loss_and_gradients_equal_the_direct_objective(depths: int):
    model = _model(depths)
    ids, pos, labels, mask = _batch()
    loss = model(ids, pos, None, labels=labels, loss_mask=mask)
    loss.mean().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    main, total = _direct_objective(model, ids, pos, labels, mask)
    total.backward()
    torch.testing.assert_close(loss, main, rtol=1e-6, atol=1e-6)  # the reported loss is the main one
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert got["mtp.layers.0.eh_proj.weight"].abs().sum() > 0
    losses = MTPLossLoggingHelper.tracker["loss_values"]
    assert losses.shape == (depths,) and (losses > 0).all()


def test_loss_scale_set_by_the_schedules_scales_only_the_mtp_gradients():
    model = _model(1)
    ids, pos, labels, mask = _batch()
    grads = []
    for scale in (1.0, 0.0):
        MTPLossAutoScaler.set_loss_scale(torch.tensor(scale))
        model.zero_grad()
        model(ids, pos, None, labels=labels, loss_mask=mask).mean().backward()
        grads.append(model.mtp.layers[0].eh_proj.weight.grad.clone())
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    assert grads[0].abs().sum() > 0 and grads[1].abs().sum() == 0


def test_repeated_layer_and_detached_heads():
    repeated = _model(2, mtp_use_repeated_layer=True)
    assert len(repeated.mtp.layers) == 1
    ids, pos, labels, mask = _batch()
    repeated(ids, pos, None, labels=labels, loss_mask=mask).mean().backward()
    assert repeated.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0

    detached = _model(1, mtp_detach_heads=True)
    loss = detached(ids, pos, None, labels=labels, loss_mask=mask)
    plain = _model(1)
    plain.load_state_dict(detached.state_dict())
    torch.testing.assert_close(loss, plain(ids, pos, None, labels=labels, loss_mask=mask))
    detached.zero_grad()
    # Only the MTP loss through the heads: the decoder's gradient equals the main loss's alone.
    loss.mean().backward()
    with_heads = detached.decoder.layers[0].mlp.linear_fc1.weight.grad.clone()
    main_only = _model(None)
    main_only.load_state_dict({k: v for k, v in detached.state_dict().items() if not k.startswith("mtp.")})
    main_only(ids, pos, None, labels=labels).mean().backward()
    torch.testing.assert_close(with_heads, main_only.decoder.layers[0].mlp.linear_fc1.weight.grad)


def test_checkpoint_keys_follow_megatron_core():
    model = _model(2)
    keys = {sh.key for sh in model.sharded_state_dict().values() if hasattr(sh, "key")}
    assert "mtp.layers.1.transformer_layer.self_attention.linear_qkv.weight" in keys
    assert "mtp.layers.0.eh_proj.weight" in keys and "mtp.layers.0.enorm.weight" in keys
    assert "mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight" in model.state_dict()


def test_eval_and_logits_paths():
    model = _model(1).eval()
    ids, pos, labels, mask = _batch()
    with torch.no_grad():
        logits = model(ids, pos, None)
    assert logits.shape == (2, SEQ, VOCAB)
    assert "loss_values" not in MTPLossLoggingHelper.tracker  # metrics are logged in training only


# --- roll_tensor ---------------------------------------------------------------------------------------------------
def test_roll_tensor_shifts_left_and_zero_fills():
    x = torch.arange(1, 7).view(1, 6)
    rolled, total = roll_tensor(x)
    assert rolled.tolist() == [[2, 3, 4, 5, 6, 0]] and int(total) == 20
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 2, 6]), cu_seqlens_kv=torch.tensor([0, 2, 6]))
    assert roll_tensor(x, packed_seq_params=packed)[0].tolist() == [[2, 0, 4, 5, 6, 0]]
    assert roll_tensor(None) == (None, None)
    with pytest.raises(ValueError, match="shifts=-1"):
        roll_tensor(x, shifts=1)


def _cp_chunks(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's part of ``x [b, s]`` under the load-balanced context-parallel split (chunks r and 2cp-1-r)."""
    chunks = x.chunk(2 * cp, dim=-1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=-1)


def _check_cp_roll() -> bool:
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    try:
        cp_group, rank = parallel_state.get_context_parallel_group(), parallel_state.get_context_parallel_rank()
        x = torch.arange(1, 17).view(1, 16).float()
        rolled, _ = roll_tensor(_cp_chunks(x, 2, rank), cp_group=cp_group)
        want, _ = roll_tensor(x)
        assert torch.equal(rolled, _cp_chunks(want, 2, rank)), (rank, rolled)
        cu = torch.tensor([0, 8, 16])  # two packed sequences of 8 (before the CP split)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
        local = torch.cat([_cp_chunks(x[:, :8], 2, rank), _cp_chunks(x[:, 8:], 2, rank)], dim=-1)
        rolled, _ = roll_tensor(local, cp_group=cp_group, packed_seq_params=packed)
        want_full, _ = roll_tensor(x, packed_seq_params=packed)
        want_local = torch.cat([_cp_chunks(want_full[:, :8], 2, rank), _cp_chunks(want_full[:, 8:], 2, rank)], dim=-1)
        assert torch.equal(rolled, want_local), (rank, rolled, want_local)
        return True
    finally:
        parallel_state.destroy_model_parallel()


def test_roll_tensor_under_context_parallelism_equals_the_full_sequence_roll():
    assert run_on_ranks(2, _check_cp_roll) == [True, True]


def test_mtp_ranks_and_refusals():
    config = TransformerConfig(**{**CONFIG, "mtp_num_layers": 1})
    assert get_mtp_ranks([4, 5, 6], config) == [6]
    assert get_mtp_ranks([4, 5, 6], TransformerConfig(**CONFIG)) == []
    with pytest.raises(ValueError, match="mtp_layer_pattern"):
        from megatron_core.transformer.multi_token_prediction import MultiTokenPredictionLayer

        block = get_gpt_mtp_block_spec(config, get_gpt_decoder_block_spec(config, False), False)
        MultiTokenPredictionLayer(config, block.layer_specs[0].submodules, mtp_layer_pattern="M*")


# --- Megatron-Core as an oracle ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _megatron_on_cpu():
    """The shared oracle setup, with Megatron-Core's MTP metrics tracker emptied (it is sized by the depth count of
    an earlier run in this process)."""
    with megatron_on_cpu():
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper as TheirHelper

        TheirHelper.tracker.clear()
        yield


def _compare_with_megatron(depths: int) -> bool:
    with _megatron_on_cpu():
        from megatron.core.models.gpt import GPTModel as TheirGPT
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec as their_local_spec
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec as their_mtp_spec
        from megatron.core.transformer.transformer_config import TransformerConfig as TheirConfig

        torch.manual_seed(11)
        their_config = TheirConfig(**{**CONFIG, "mtp_num_layers": depths})
        layer = their_local_spec()
        theirs = TheirGPT(their_config, layer, VOCAB, MAX_SEQ, position_embedding_type="rope",
                          mtp_block_spec=their_mtp_spec(their_config, layer, use_transformer_engine=False))
        ours = _model(depths, seed=5)
        state = {k.replace(".transformer_layer.", ".mtp_model_layer."): v for k, v in theirs.state_dict().items()}
        ours.load_state_dict(state)
        ids, pos, labels, mask = _batch()
        causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
        want = theirs(ids, pos, causal, labels=labels, loss_mask=mask)
        want.mean().backward()
        got = ours(ids, pos, None, labels=labels, loss_mask=mask)
        got.mean().backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        their_grads = {k.replace(".transformer_layer.", ".mtp_model_layer."): p.grad
                       for k, p in theirs.named_parameters()}
        for name, param in ours.named_parameters():
            torch.testing.assert_close(param.grad, their_grads[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")
        return True


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_matches_megatron_core(depths: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core.transformer.multi_token_prediction")
    assert run_on_ranks(1, _compare_with_megatron, depths) == [True]


def test_schedule_scales_mtp_losses_like_the_main_loss_over_micro_batches():
    """Through the pipeline schedule with 2 micro-batches, the gradients are the mean of each micro-batch's direct
    objective: the schedule divides the MTP losses' backward scale by the micro-batch count, as the main loss."""
    from megatron_core.pipeline_parallel import get_forward_backward_func

    model = _model(1)
    batches = [_batch(seed) for seed in (3, 4)]

    def forward_step(data_iterator, model):
        ids, pos, labels, mask = next(data_iterator)
        return model(ids, pos, None, labels=labels, loss_mask=mask), lambda per_token: (per_token.mean(), {})

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=model,
                                num_microbatches=2, seq_length=SEQ, micro_batch_size=2)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for ids, pos, labels, mask in batches:
        (_direct_objective(model, ids, pos, labels, mask)[1] / 2).backward()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("fields,match", [
    (dict(mtp_num_layers=-1), r"mtp_num_layers \(-1\) must be a non-negative integer"),
    (dict(mtp_num_layers=1, mtp_loss_scaling_factor=None), "mtp_loss_scaling_factor must be a number"),
])
def test_bad_mtp_fields_are_refused_naming_them(fields: dict, match: str):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**{**CONFIG, **fields})
