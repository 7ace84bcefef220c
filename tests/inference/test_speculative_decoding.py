"""Speculative decoding with MTP drafts (``InferenceConfig.num_speculative_tokens``) in the dynamic engine.

Greedy outputs must not depend on the drafts: k = 1, 2, 3 give exactly the tokens of k = 0, with random MTP
layers (drafts almost always rejected) and with a model trained a few steps to count (drafts often accepted).
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.inference.config import InferenceConfig, MambaInferenceStateConfig
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers.mtp_utils_pytorch import (
    mamba_state_selective_copy,
    prepare_next_forward_pass,
    rewind_kv_cache,
    verify_speculative_tokens,
)
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.transformer_config import MLATransformerConfig
from tests.dist_harness import run_on_ranks
from tests.inference.mtp_fixture import CONFIG, MAX_POS, VOCAB, counting_gpt, engine, mtp_gpt, prompts
from tests.inference.speculative_tp_checks import tp_speculative_run

NEW = 12


def _greedy(eng, batch, new=NEW, **params):
    params = SamplingParams(top_k=1, num_tokens_to_generate=new, termination_id=-1, **params)
    return [r.merge().generated_tokens for r in eng.generate(batch, params)]


@pytest.fixture(scope="module")
def random_model():
    model = mtp_gpt(depths=3)
    batch = prompts()
    return model, batch, _greedy(engine(model), batch)


@pytest.fixture(scope="module")
def counting_model():
    model = counting_gpt(depths=3, steps=5)
    batch = prompts()
    return model, batch, _greedy(engine(model), batch)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_with_random_mtp_drafts_equals_plain_decoding(random_model, k):
    model, batch, expected = random_model
    eng = engine(model, num_speculative_tokens=k)
    assert _greedy(eng, batch) == expected
    assert eng.speculative_drafted_count > 0
    assert eng.context.block_allocator.get_total_used() == 0
    assert not eng.speculative_drafts


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_trained_mtp_drafts_accepts_some_and_equals_plain(counting_model, k):
    model, batch, expected = counting_model
    eng = engine(model, num_speculative_tokens=k)
    assert _greedy(eng, batch) == expected
    assert 0 < eng.speculative_accepted_count < eng.speculative_drafted_count
    plain = engine(model)
    _greedy(plain, batch)
    assert eng.step_count < plain.step_count  # accepted drafts save forwards
    assert eng.context.block_allocator.get_total_used() == 0


def test_speculative_with_eviction_and_chunked_prefill_equals_plain(counting_model):
    model, batch, expected = counting_model
    # 2 layers * 2 groups * 8 dims * 4 bytes * 2 (k, v) = 256 bytes per token; 8-token blocks: 2 KiB each.
    blocks = 6  # the longest request alone needs 6 blocks: requests are paused and evicted
    eng = engine(model, num_speculative_tokens=2, buffer_size_gb=blocks * 2048 / 1024**3, max_sequence_length=48,
                 enable_chunked_prefill=True, max_tokens=16)
    assert eng.context.total_block_count == blocks
    assert _greedy(eng, batch) == expected
    assert eng.evicted_request_count > 0
    assert eng.context.block_allocator.get_total_used() == 0


def test_stop_token_and_length_limit_inside_an_accepted_run(counting_model):
    model, batch, expected = counting_model
    stop = expected[1][5]  # a token that an accepted run of request 1 emits
    want = [seq[: seq.index(stop) + 1] if stop in seq else seq for seq in expected]
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=stop)
    eng = engine(model, num_speculative_tokens=3)
    assert [r.merge().generated_tokens for r in eng.generate(batch, params)] == want
    for new in (1, 5):  # the limit falls inside a run of drafts: never more than asked
        assert _greedy(eng, batch, new=new) == [seq[:new] for seq in expected]
    short = [batch[0], batch[2], batch[4]]  # 5, 9 and 2 prompt tokens
    eng = engine(model, num_speculative_tokens=3, max_sequence_length=16)
    out = _greedy(eng, short, new=None)
    assert [len(p) + len(o) for p, o in zip(short, out)] == [16] * len(short)
    assert [o[:NEW] for o in out] == [expected[i][: min(len(o), NEW)] for i, o in zip((0, 2, 4), out)]
    assert eng.context.block_allocator.get_total_used() == 0


def test_sampling_and_log_probs_with_drafts(counting_model):
    model, batch, _ = counting_model
    eng = engine(model, num_speculative_tokens=2)
    params = SamplingParams(temperature=0.7, top_k=8, num_tokens_to_generate=9, termination_id=-1,
                            return_log_probs=True, top_n_logprobs=2)
    for record in eng.generate(batch, params):
        request = record.merge()
        assert len(request.generated_tokens) == 9
        assert len(request.generated_log_probs) == 9 and all(lp <= 0 for lp in request.generated_log_probs)
        assert len(request.generated_top_n_logprobs) == 9
    assert eng.speculative_accepted_count > 0
    assert eng.context.block_allocator.get_total_used() == 0
    # Greedy log-probs equal those of plain decoding.
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=6, termination_id=-1, return_log_probs=True)
    spec = [r.merge().generated_log_probs for r in engine(model, num_speculative_tokens=2).generate(batch, greedy)]
    plain = [r.merge().generated_log_probs for r in engine(model).generate(batch, greedy)]
    assert torch.allclose(torch.tensor(spec), torch.tensor(plain), atol=1e-5)


def test_config_and_model_refusals(random_model):
    model, _, _ = random_model
    for bad, match in [(dict(num_speculative_tokens=-1), "num_speculative_tokens"),
                       (dict(num_speculative_tokens=8, block_size_tokens=8), "block_size_tokens"),
                       (dict(num_speculative_tokens=2, logprobs_mode="processed_logprobs"), "logprobs_mode"),
                       (dict(num_speculative_tokens=3, max_tokens=3), "max_tokens")]:
        with pytest.raises(ValueError, match=match):
            InferenceConfig(**bad)
    mamba = MambaInferenceStateConfig(["M", "*"], (4, 3), (2, 4, 4), torch.float32, torch.float32)
    with pytest.raises(ValueError, match="mamba_inference_state_config"):
        InferenceConfig(num_speculative_tokens=1, mamba_inference_state_config=mamba)
    with pytest.raises(ValueError, match="mtp_num_layers"):
        engine(mtp_gpt(depths=1), num_speculative_tokens=2)
    assert engine(mtp_gpt(depths=1, mtp_use_repeated_layer=True), num_speculative_tokens=2).num_speculative_tokens == 2
    plain = GPTModel(TransformerConfig(**CONFIG), get_gpt_layer_local_spec(), VOCAB, MAX_POS,
                     position_embedding_type="rope").eval()
    with pytest.raises(ValueError, match="mtp_num_layers"):
        engine(plain, num_speculative_tokens=1)


def test_verify_and_prepare_next_forward_pass():
    # Three decode requests with two drafts each, then one prefill request.
    fed = torch.tensor([5, 6, 7, 3, 4, 5, 6, 7, 8, 2])
    out = torch.tensor([6, 9, 9, 4, 5, 6, 1, 1, 1, 3])
    last, mask, _ = verify_speculative_tokens(fed, out, 3, 1, 2)
    assert mask.tolist() == [1, 1, 0, 1, 1, 1, 1, 0, 0, 1]
    assert last.tolist() == [1, 5, 6, 9]
    sampled, seq = torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    per_request, counts = torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    prepare_next_forward_pass(3, out, torch.arange(10) + 100, last, mask, fed, sampled, seq, per_request, counts, 2)
    assert sampled.tolist() == [9, 6, 1, 3] and seq.tolist() == [101, 105, 106, 109]
    assert per_request.tolist() == [[6, -1], [4, 5], [-1, -1]] and counts.tolist() == [1, 2, 0]


def test_rewind_kv_cache_crosses_back_a_block():
    # Block size 4, 3 drafts. Request 0: 9 tokens (offset 0 in block 7) rejects 2 -> back into block 5.
    # Request 1: accepts all. Request 2 prefilled. Row 3 is past num_active_requests.
    accepted = torch.tensor([1, 3, 0, 0])
    prefill = torch.tensor([0, 0, 1, 0])
    offset = torch.tensor([0, 2, 1, 0])
    length = torch.tensor([9, 7, 5, 4])
    counts = torch.tensor([3, 2, 2, 1])
    last = torch.tensor([7, 4, 2, 9])
    ids = torch.tensor([[1, 5, 7], [3, 4, -1], [6, 2, -1], [9, -1, -1]])
    release, remove = rewind_kv_cache(accepted, prefill, offset, length, counts, last, ids, 3, 4, 3)
    assert remove.tolist() == [True, False, False, False]
    assert release[0] == 7
    assert offset.tolist() == [2, 2, 1, 0] and length.tolist() == [7, 7, 5, 4]
    assert counts.tolist() == [2, 2, 2, 1] and last.tolist() == [5, 4, 2, 9]
    assert ids[0].tolist() == [1, 5, -1]


def test_mamba_state_selective_copy():
    inter = torch.arange(2 * 3 * 3, dtype=torch.float).view(2, 3, 3, 1)
    current = torch.zeros(2, 3, 1)
    mamba_state_selective_copy(inter, current, torch.tensor([0, 1]), torch.tensor([2, 0]), torch.tensor([1, 2]), 2)
    assert current[:, 2, 0].tolist() == [inter[0, 2, 1, 0].item(), inter[1, 2, 1, 0].item()]
    assert current[:, 0].abs().sum() == 0


def test_tensor_parallel_speculative_equals_single_process(counting_model):
    model, batch, expected = counting_model
    single = engine(model, num_speculative_tokens=2)
    assert _greedy(single, batch) == expected
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    results = run_on_ranks(2, tp_speculative_run, full, batch, 2, NEW)
    for tokens, drafted, accepted in results:
        assert tokens == expected
        assert (drafted, accepted) == (single.speculative_drafted_count, single.speculative_accepted_count)


def test_deepseek_style_mla_moe_mtp_model():
    """MLA attention and MoE layers (DeepSeek-V3's MTP layers) draft too; greedy output equals plain decoding."""
    torch.manual_seed(0)
    config = MLATransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
        qk_pos_emb_head_dim=4, v_head_dim=6, ffn_hidden_size=64, add_bias_linear=False, use_cpu_initialization=True,
        rope_type="rope", normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0, mtp_num_layers=2,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
    block = get_gpt_decoder_block_spec(config, False)
    model = GPTModel(config, block, VOCAB, MAX_POS, position_embedding_type="rope",
                     mtp_block_spec=get_gpt_mtp_block_spec(config, block, False)).eval()
    batch = prompts((5, 11, 3))
    eng = engine(model, num_speculative_tokens=2)
    assert _greedy(eng, batch, new=6) == _greedy(engine(model), batch, new=6)
    assert eng.speculative_drafted_count > 0 and eng.context.block_allocator.get_total_used() == 0


def test_speculative_with_prefix_caching(counting_model):
    model, batch, expected = counting_model
    eng = engine(model, num_speculative_tokens=2, enable_prefix_caching=True, prefix_caching_eviction_policy="lru")
    assert _greedy(eng, batch) == expected
    assert _greedy(eng, batch[1:4]) == expected[1:4]  # their prompt blocks are shared now
    assert eng.context.prefix_cache_hits > 0
    assert eng.context.block_allocator.get_total_used() == 0
