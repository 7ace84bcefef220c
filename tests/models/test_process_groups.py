"""Parallel sizes come from the process groups, not from config fields (one resolver, Megatron-Core's rule).

- A GPT built and trained on explicitly passed groups (two TP=2 groups x two DP=2 groups on 4
  ranks, made with ``torch.distributed.new_group`` into a ``ProcessGroupCollection``;
  ``parallel_state`` never initialised): the initial weights, the loss, every gradient after DDP +
  ``finalize_model_grads``, the clipped grad norm and the weights after one step of the library's
  optimizer (plain and distributed) equal the TP=1 single-process run.
- A config that leaves ``tensor_model_parallel_size`` at its default under ``parallel_state`` TP=2
  (among them Megatron's own example config, which used to crash in attention) and TP=4: with ``use_cpu_initialization`` the model starts from exactly
  the TP=1 weights (SwiGLU fc1 is built with ``stride=2``), so loss and logits equal TP=1 without
  copying any weight; under TP=2 every gradient too. (Default sizes under PP=2 x TP=2 run in
  tests/pipeline_parallel/test_gpt_pipeline.py.)
- The 1F1B schedule, p2p, DDP and ``finalize_model_grads`` on hand-built PP=2 x DP=2 groups (config
  sizes at their defaults) match the whole model in one process: every loss and gradient.
- A config field that contradicts its group raises ``ValueError`` naming both; a language model under a CP group
  needs ``context_parallel_size`` set to the group's size (attention runs CP only where the config says so).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.pipeline_parallel import forward_backward_no_pipelining, get_forward_backward_func
from megatron_core.process_groups_config import ProcessGroupCollection
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import (
    MAX_SEQ,
    VOCAB,
    batch,
    build,
    gpt2_like,
    gpt_provider,
    llama_like,
    shard,
    unshard,
)
from tests.pipeline_parallel.gpt_stages import MBS, SEQ, gpt_forward_step, make_batches

WORLD = 4
TOL = dict(rtol=1e-5, atol=1e-5)


def _new_groups(partition: list[list[int]]) -> tuple[dist.ProcessGroup, list[dist.ProcessGroup]]:
    """Every rank creates every group of ``partition``; returns this rank's group and the ones to free."""
    mine, created = None, []
    for ranks in partition:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
            created.append(group)
    return mine, created


def _reference_step(spec: dict, opt_config: OptimizerConfig) -> dict:
    """TP=1 weights, loss, grads, grad norm and post-step weights (this process, no group set up)."""
    torch.manual_seed(1234)
    model = build(spec)
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    ids, pos, labels = batch()
    loss = model(ids, pos, None, labels=labels)
    loss.mean().backward()
    grads = {k: v.grad.detach().clone() for k, v in model.named_parameters()}
    _, grad_norm, _ = get_megatron_optimizer(opt_config, [model]).step()
    after = {k: v.detach().clone() for k, v in model.named_parameters()}
    return dict(init=init, loss=loss.detach(), grads=grads, grad_norm=grad_norm, after=after)


def _gather_tp(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    pieces = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return pieces


def _train_on_explicit_groups(kind: str, distributed_optimizer: bool) -> str:
    spec = llama_like() if kind == "llama" else gpt2_like()
    gated = spec["config"].get("gated_linear_unit", False)
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.05)
    ref = _reference_step(spec, opt_config)
    opt_config.use_distributed_optimizer = distributed_optimizer

    tp_group, tp_all = _new_groups([[0, 1], [2, 3]])
    dp_group, dp_all = _new_groups([[0, 2], [1, 3]])
    try:
        pgs = ProcessGroupCollection()
        pgs.tp, pgs.mp, pgs.dp, pgs.dp_cp = tp_group, tp_group, dp_group, dp_group
        assert not parallel_state.model_parallel_is_initialized()
        tp, tp_rank, dp_rank = tp_group.size(), tp_group.rank(), dp_group.rank()

        torch.manual_seed(1234)
        config = TransformerConfig(**spec["config"])
        model = gpt_provider(spec, config=config, pg_collection=pgs)
        assert model.decoder.layers[0].self_attention.num_attention_heads_per_partition == (
            spec["config"]["num_attention_heads"] // tp
        )
        # use_cpu_initialization: every shard is cut from the TP=1 master weights (SwiGLU fc1 with stride 2).
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, shard(name, ref["init"][name], tp, tp_rank, gated), rtol=0, atol=0,
                                       msg=lambda m, n=name: f"initial {n}: {m}")

        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer)
        ddp = DistributedDataParallel(config, ddp_config, model, pg_collection=pgs)
        optimizer = get_megatron_optimizer(opt_config, [ddp], pg_collection=pgs)
        ids, pos, labels = (t[dp_rank:dp_rank + 1] for t in batch())
        loss = ddp(ids, pos, None, labels=labels)
        torch.testing.assert_close(loss, ref["loss"][dp_rank:dp_rank + 1], **TOL)
        loss.mean().backward()
        finalize_model_grads([ddp], pg_collection=pgs)
        # The distributed optimizer reduce-scatters: each DP rank holds only its shard of the full
        # gradient, checked through the grad norm and the stepped weights below.
        for name, param in [] if distributed_optimizer else model.named_parameters():
            full = unshard(name, _gather_tp(param.main_grad, tp_group), gated)
            torch.testing.assert_close(full, ref["grads"][name], **TOL, msg=lambda m, n=name: f"grad {n}: {m}")

        success, grad_norm, _ = optimizer.step()
        assert success
        assert grad_norm == pytest.approx(ref["grad_norm"], rel=1e-5) and grad_norm > opt_config.clip_grad
        for name, param in model.named_parameters():
            full = unshard(name, _gather_tp(param.detach(), tp_group), gated)
            torch.testing.assert_close(full, ref["after"][name], **TOL, msg=lambda m, n=name: f"stepped {n}: {m}")
        return f"{kind} tp_rank={tp_rank} dp_rank={dp_rank}"
    finally:
        for group in tp_all + dp_all:
            dist.destroy_process_group(group)


@pytest.mark.parametrize("kind,distributed_optimizer", [("llama", False), ("gpt2", False), ("llama", True)])
def test_gpt_trains_on_explicit_groups_like_tp1(kind: str, distributed_optimizer: bool):
    results = run_on_ranks(WORLD, _train_on_explicit_groups, kind, distributed_optimizer)
    assert sorted(results) == sorted(
        f"{kind} tp_rank={t} dp_rank={d}" for d in range(2) for t in range(2)
    )


# Megatron-LM's examples/run_simple_mcore_train_loop.py config (TP size left at its default).
MEGATRON_EXAMPLE = dict(config=dict(num_layers=2, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True,
                                    pipeline_dtype=torch.float32), model=dict())


def _spec(kind: str) -> dict:
    return {"llama": llama_like, "gpt2": gpt2_like}[kind]() if kind != "megatron_example" else MEGATRON_EXAMPLE


def _default_sizes_match_tp1(cases: list[tuple[str, int]]) -> list[str]:
    done = []
    for kind, tp in cases:
        spec = _spec(kind)
        gated = spec["config"].get("gated_linear_unit", False)
        torch.manual_seed(1234)
        ref_model = build(spec).eval()  # eval: the example config keeps Megatron's default dropout
        ids, pos, labels = batch()
        ref_logits = ref_model(ids, pos, None)
        ref_loss = ref_model(ids, pos, None, labels=labels)
        ref_loss.sum().backward()

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            group = parallel_state.get_tensor_model_parallel_group()
            torch.manual_seed(1234)
            model = build(spec).eval()  # tensor_model_parallel_size left at its default (1)
            assert model.config.tensor_model_parallel_size == 1
            logits = torch.cat(_gather_tp(model(ids, pos, None), group), dim=-1)
            torch.testing.assert_close(logits, ref_logits, **TOL)
            loss = model(ids, pos, None, labels=labels)
            torch.testing.assert_close(loss, ref_loss, **TOL)
            if tp == 2:
                loss.sum().backward()
                for name, param in model.named_parameters():
                    full = unshard(name, _gather_tp(param.grad, group), gated)
                    torch.testing.assert_close(full, ref_model.get_parameter(name).grad, **TOL,
                                               msg=lambda m, n=name: f"grad {n}: {m}")
            done.append(f"{kind} tp={tp}")
        finally:
            parallel_state.destroy_model_parallel()
    return done


def test_default_config_sizes_follow_parallel_state_and_cpu_init_matches_tp1():
    cases = [("megatron_example", 2), ("llama", 2), ("llama", 4), ("gpt2", 2)]
    results = run_on_ranks(WORLD, _default_sizes_match_tp1, cases)
    assert all(r == [f"{k} tp={t}" for k, t in cases] for r in results)


def _contradictions() -> list[str]:
    messages = []
    tp_group, tp_all = _new_groups([[0, 1], [2, 3]])
    try:
        pgs = ProcessGroupCollection()
        pgs.tp = tp_group
        cfg = dict(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
        # An explicit collection: config TP=4 against a TP group of 2.
        with pytest.raises(ValueError) as err:
            GPTModel(TransformerConfig(**cfg, tensor_model_parallel_size=4), get_gpt_layer_local_spec(), 64, 16,
                     pg_collection=pgs)
        messages.append(str(err.value))
        # The vocabulary must split over the group's size, named as such.
        with pytest.raises(ValueError, match=r"vocab_size \(51\).*group size \(2\).*pad_vocab_size"):
            GPTModel(TransformerConfig(**cfg), get_gpt_layer_local_spec(), 51, 16, pg_collection=pgs)
    finally:
        for group in tp_all:
            dist.destroy_process_group(group)
    # parallel_state: TP=2 x PP=2 against config TP=4, then config PP=4.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    for field in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        config = TransformerConfig(**{**cfg, "num_layers": 4}, pipeline_dtype=torch.float32, **{field: 4})
        with pytest.raises(ValueError) as err:
            GPTModel(config, get_gpt_layer_local_spec(), 64, 16)
        messages.append(str(err.value))
    parallel_state.destroy_model_parallel()
    # CP=2: a language model's config must state it (its attention runs CP only where the config says so).
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    with pytest.raises(ValueError) as err:
        GPTModel(TransformerConfig(**cfg), get_gpt_layer_local_spec(), 64, 16)
    messages.append(str(err.value))
    GPTModel(TransformerConfig(**cfg, context_parallel_size=2, attention_dropout=0.0), get_gpt_layer_local_spec(), 64, 16)
    return messages


def test_config_size_that_contradicts_its_group_raises():
    for messages in run_on_ranks(WORLD, _contradictions):
        explicit_tp, state_tp, state_pp, state_cp = messages
        assert "context_parallel_size is 1" in state_cp and "context-parallel process group has 2 ranks" in state_cp
        for text in (explicit_tp, state_tp):
            assert "tensor_model_parallel_size is 4" in text and "tensor-parallel process group has 2 ranks" in text
        assert "pipeline_model_parallel_size is 4" in state_pp and "pipeline-parallel process group has 2 ranks" in state_pp


def _pipeline_on_explicit_groups(num_microbatches: int) -> dict:
    """PP=2 x DP=2 from hand-built groups, config sizes at their defaults, vs the whole model in one process."""
    spec = llama_like(num_layers=4)
    config_kwargs = dict(**spec["config"], pipeline_dtype=torch.float32)
    model_kwargs = dict(vocab_size=VOCAB, max_sequence_length=MAX_SEQ, **spec["model"])
    torch.manual_seed(1234)
    ref = GPTModel(TransformerConfig(**config_kwargs), get_gpt_layer_local_spec(), **model_kwargs)
    batches = make_batches(2 * num_microbatches, seed=7)
    ref_losses = forward_backward_no_pipelining(
        forward_step_func=gpt_forward_step, data_iterator=iter(batches), model=ref,
        num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MBS,
    )

    pp_group, pp_all = _new_groups([[0, 1], [2, 3]])
    dp_group, dp_all = _new_groups([[0, 2], [1, 3]])
    try:
        pgs = ProcessGroupCollection()
        pgs.pp, pgs.dp, pgs.dp_cp, pgs.mp = pp_group, dp_group, dp_group, pp_group
        pp_rank, dp_rank = pp_group.rank(), dp_group.rank()
        config = TransformerConfig(**config_kwargs, finalize_model_grads_func=finalize_model_grads)
        stage = GPTModel(config, get_gpt_layer_local_spec(), pre_process=pp_rank == 0, post_process=pp_rank == 1,
                         pg_collection=pgs, **model_kwargs)
        assert len(stage.decoder.layers) == 2 and stage.decoder.layers[0].layer_number == 1 + 2 * pp_rank
        names = {}
        with torch.no_grad():
            for name, param in stage.named_parameters():
                names[name] = re.sub(r"^decoder\.layers\.(\d+)\.",
                                     lambda m: f"decoder.layers.{int(m.group(1)) + 2 * pp_rank}.", name)
                param.copy_(ref.get_parameter(names[name]))
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), stage, pg_collection=pgs)
        config.no_sync_func = ddp.no_sync
        mine = batches[dp_rank * num_microbatches:(dp_rank + 1) * num_microbatches]
        losses = get_forward_backward_func(schedule_pg_collection=pgs)(
            forward_step_func=gpt_forward_step, data_iterator=iter(mine), model=ddp,
            num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS, pg_collection=pgs,
        )
        if pp_rank == 1:
            expected = ref_losses[dp_rank * num_microbatches:(dp_rank + 1) * num_microbatches]
            torch.testing.assert_close(torch.stack([d["lm loss"] for d in losses]),
                                       torch.stack([d["lm loss"] for d in expected]), **TOL)
        else:
            assert losses == []
        for name, param in stage.named_parameters():
            torch.testing.assert_close(param.main_grad, ref.get_parameter(names[name]).grad, **TOL,
                                       msg=lambda m, n=names[name]: f"grad {n}: {m}")
        return {"pp_rank": pp_rank, "params": sorted(names.values())}
    finally:
        for group in pp_all + dp_all:
            dist.destroy_process_group(group)


def test_pipeline_schedule_on_explicit_groups_matches_one_process():
    results = run_on_ranks(WORLD, _pipeline_on_explicit_groups, 4)
    covered = {name for r in results for name in r["params"]}
    torch.manual_seed(0)
    whole = GPTModel(TransformerConfig(**llama_like(num_layers=4)["config"]), get_gpt_layer_local_spec(),
                     VOCAB, MAX_SEQ, **llama_like()["model"])
    assert covered == {name for name, _ in whole.named_parameters()}
    assert sorted(r["pp_rank"] for r in results) == [0, 0, 1, 1]


def test_the_collection_takes_its_groups_by_keyword():
    marker = object()
    collection = ProcessGroupCollection(tp=marker, ep=None)
    assert collection.tp is marker and collection.pp is None and collection.ep is None
    with pytest.raises(ValueError, match=r"unknown process group names \['tensor'\]"):
        ProcessGroupCollection(tensor=marker)
