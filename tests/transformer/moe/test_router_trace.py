"""The MoE router tracer (``router_trace``): records equal the routers' real decisions, steps, sidecars, dumps."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from megatron_core.transformer.moe import router_trace
from megatron_core.transformer.moe.router import TopKRouter
from megatron_core.transformer.moe.router_trace import (
    get_moe_router_tracer,
    init_moe_router_tracer,
    load_hidden_states_for_record,
    load_logits_for_record,
)
from tests.transformer.moe.moe_parallel_utils import SEQ, batches, build

RECORD_KEYS = {"step", "stage", "block", "layer", "rank", "num_tokens", "topk", "top_indices"}


@pytest.fixture(autouse=True)
def _fresh_tracer():
    """No tracer before a test; after it, the test's tracer is flushed, unhooked and dropped."""
    router_trace._MOE_ROUTER_TRACER = None
    yield
    tracer = get_moe_router_tracer()
    if tracer is not None:
        tracer.remove_hooks()
        tracer.flush()
    router_trace._MOE_ROUTER_TRACER = None


class RouterSpy:
    """Our own hooks on every router: its input, probabilities and routing map, per call, by layer index."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[dict] = []
        self.routers = {name: m for name, m in model.named_modules() if isinstance(m, TopKRouter)}
        self.handles = [m.register_forward_hook(self._hook(int(name.split(".")[2])))
                        for name, m in self.routers.items()]

    def _hook(self, layer: int):
        def hook(module, inputs, outputs):
            probs, routing_map = outputs
            self.calls.append({"layer": layer, "input": inputs[0].detach().clone(), "probs": probs.detach().clone(),
                               "map": routing_map.clone(), "module": module})
        return hook

    def expected_indices(self, call: dict, drop_zero_prob: bool = False) -> list[list[int]]:
        """Each token's experts, ascending, padded with -1 to top-k."""
        routes = call["map"] & (call["probs"] != 0) if drop_zero_prob else call["map"]
        topk = call["module"].topk
        return [sorted(row.nonzero().flatten().tolist()) + [-1] * (topk - int(row.sum())) for row in routes]


def _train_forward(model: torch.nn.Module, batch) -> None:
    ids, pos, labels = batch
    model(ids, pos, None, labels=labels).sum().backward()


def _records(trace_dir: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (trace_dir / f"router_trace_rank{rank}.jsonl").read_text().splitlines()]


def _router_hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules() if isinstance(m, TopKRouter))


def test_records_equal_the_routers_decisions(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build("mixtral")
    init_moe_router_tracer(str(tmp_path), max_steps=5, rank=3, training_mode=True)
    get_moe_router_tracer().register_hooks([model])
    spy = RouterSpy(model)
    _train_forward(model, batches(1)[0])
    get_moe_router_tracer().advance_step(7)
    records = _records(tmp_path, rank=3)
    assert [r["layer"] for r in records] == [0, 1]  # one record per (step, layer)
    for record, call in zip(records, spy.calls, strict=True):
        assert set(record) == RECORD_KEYS
        assert record["layer"] == call["layer"]
        assert (record["step"], record["stage"], record["block"], record["rank"]) == (7, "pre_dispatch", "decoder", 3)
        assert (record["num_tokens"], record["topk"]) == (SEQ, 2)
        assert record["top_indices"] == spy.expected_indices(call)
        assert all(len(set(row)) == 2 and -1 not in row for row in record["top_indices"])


@pytest.mark.parametrize("pad", [False, True], ids=["drop", "drop-and-pad"])
def test_capacity_drops_are_written_as_minus_one(tmp_path: Path, pad: bool) -> None:
    torch.manual_seed(0)
    model = build("mixtral", moe_expert_capacity_factor=1.0, moe_token_drop_policy="position",
                  moe_pad_expert_input_to_capacity=pad)
    init_moe_router_tracer(str(tmp_path), max_steps=1, rank=0, training_mode=True)
    get_moe_router_tracer().register_hooks(model)
    spy = RouterSpy(model)
    _train_forward(model, batches(1)[0])
    get_moe_router_tracer().advance_step()
    records = _records(tmp_path)
    assert len(records) == 2
    for record, call in zip(records, spy.calls, strict=True):
        # With padding the routing map also holds zero-probability padding routes: those are not routes taken.
        assert record["top_indices"] == spy.expected_indices(call, drop_zero_prob=pad)
    assert any(-1 in row for r in records for row in r["top_indices"])  # capacity 1.0 drops some routes here
    assert pad == any(int(row.sum()) > 2 for call in spy.calls for row in call["map"])  # padding routes seen


def test_training_mode_stamps_steps_flushes_and_stops(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build("mixtral")
    init_moe_router_tracer(str(tmp_path), max_steps=2, rank=0, training_mode=True)
    tracer = get_moe_router_tracer()
    tracer.register_hooks(model)
    assert _router_hooks(model) == 2
    data = batches(3)
    _train_forward(model, data[0])
    assert _records(tmp_path) == []  # buffered until the step ends
    tracer.advance_step(10)
    assert [r["step"] for r in _records(tmp_path)] == [10, 10]  # on disk after each step
    model.eval()  # a validation pass in between is not a training step: not recorded
    with torch.no_grad():
        model(data[1][0], data[1][1], None)
    model.train()
    _train_forward(model, data[1])
    tracer.advance_step(11)
    assert _router_hooks(model) == 0  # max_steps reached: hooks gone
    _train_forward(model, data[2])
    tracer.advance_step(12)
    tracer.flush()
    assert [(r["step"], r["layer"]) for r in _records(tmp_path)] == [(10, 0), (10, 1), (11, 0), (11, 1)]


def test_inference_mode_detects_steps_from_a_repeated_layer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build("mixtral").eval()
    init_moe_router_tracer(str(tmp_path), max_steps=2, rank=0, training_mode=False)
    get_moe_router_tracer().register_hooks(model)
    spy = RouterSpy(model)
    data = batches(3)
    with torch.no_grad():
        model(data[0][0], data[0][1], None)
        assert _records(tmp_path) == []
        model(data[1][0], data[1][1], None)  # layer 0 fires again: step 0 is complete and written
        assert [r["step"] for r in _records(tmp_path)] == [0, 0]
        model(data[2][0], data[2][1], None)  # a third step is past max_steps
    get_moe_router_tracer().flush()
    records = _records(tmp_path)
    assert [(r["step"], r["layer"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["top_indices"] for r in records] == [spy.expected_indices(c) for c in spy.calls[:4]]


def test_sidecars_give_back_the_router_input_and_logits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build("mixtral")
    init_moe_router_tracer(str(tmp_path), max_steps=2, rank=0, training_mode=True, capture_hidden_states=True,
                           capture_logits=True)
    get_moe_router_tracer().register_hooks(model)
    spy = RouterSpy(model)
    for step, batch in enumerate(batches(2)):
        _train_forward(model, batch)
        get_moe_router_tracer().advance_step(step)
    records = _records(tmp_path)
    assert len(records) == len(spy.calls) == 4
    for record, call in zip(records, spy.calls, strict=True):
        hidden = call["input"].reshape(-1, call["input"].shape[-1])
        with torch.no_grad():
            logits = call["module"].gating(call["input"]).reshape(SEQ, -1)
        assert record["hs_shape"] == list(hidden.shape) and record["logit_shape"] == [SEQ, 4]
        loaded_hidden = load_hidden_states_for_record(record, str(tmp_path))
        loaded_logits = load_logits_for_record(record, str(tmp_path))
        assert loaded_hidden.dtype == loaded_logits.dtype == torch.bfloat16
        torch.testing.assert_close(loaded_hidden.float(), hidden, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(loaded_logits.float(), logits, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="hs_offset"):
        load_hidden_states_for_record({"rank": 0}, str(tmp_path))


def test_dump_router_weights_saves_each_layers_router(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build("deepseek")
    init_moe_router_tracer(str(tmp_path), max_steps=1, rank=0, training_mode=True, dump_router_weights=True)
    get_moe_router_tracer().register_hooks(model)
    _train_forward(model, batches(1)[0])
    get_moe_router_tracer().advance_step(0)
    get_moe_router_tracer().flush()
    state = torch.load(tmp_path / "router_state_rank0.pt", weights_only=True)
    assert set(state) == {("decoder", None, 0), ("decoder", None, 1)}
    for layer in (0, 1):
        router = model.decoder.layers[layer].mlp.router
        entry = state[("decoder", None, layer)]
        assert set(entry) == {"weight", "expert_bias", "score_function", "topk"}
        assert torch.equal(entry["weight"], router.weight.detach().float())
        assert torch.equal(entry["expert_bias"], router.expert_bias.float())
        assert (entry["score_function"], entry["topk"]) == ("sigmoid", 2)
    assert not (tmp_path / "hidden_states_rank0.bin").exists()  # sidecars only when asked for


def test_router_names_and_record_indices(tmp_path: Path) -> None:
    parse = router_trace._layer_key_from_name
    assert parse("module.decoder.layers.3.mlp.router") == ("decoder", None, 3)
    assert parse("mtp.layers.1.mtp_model_layer.layers.2.mlp.router") == ("mtp", 1, 2)
    assert parse("mtp.layers.0.mtp_model_layer.mlp.router") == ("mtp", 0, 0)
    assert parse("router") is None
    init_moe_router_tracer(str(tmp_path), max_steps=1, rank=0, training_mode=True)
    tracer = get_moe_router_tracer()
    tracer.record_indices(torch.tensor([[[0, 1], [2, 3]], [[1, 2], [3, 0]]]), step=4, layer_ids=[5, 9])
    tracer.record_indices([torch.tensor([[1, 3]])], block="mtp", mtp_idx=0)
    with pytest.raises(ValueError):
        tracer.record_indices(torch.zeros(2, 2, dtype=torch.long))
    tracer.flush()
    records = _records(tmp_path)
    assert [(r["step"], r["layer"], r["top_indices"]) for r in records[:2]] == [(4, 5, [[0, 1], [1, 2]]),
                                                                               (4, 9, [[2, 3], [3, 0]])]
    assert records[2]["block"] == "mtp" and records[2]["mtp_idx"] == 0 and records[2]["step"] == 0


def _megatron_router_trace_exists() -> bool:
    spec = importlib.util.find_spec("megatron")
    return spec is not None and any(
        os.path.exists(os.path.join(p, "core", "transformer", "moe", "router_trace.py"))
        for p in spec.submodule_search_locations or [])


def test_megatron_loaders_read_our_traces(tmp_path: Path) -> None:
    if not _megatron_router_trace_exists():  # checked on disk first: importing megatron.core is slow
        pytest.skip("the installed megatron-core has no transformer.moe.router_trace")
    oracle = pytest.importorskip("megatron.core.transformer.moe.router_trace")
    torch.manual_seed(0)
    model = build("mixtral")
    init_moe_router_tracer(str(tmp_path), max_steps=1, rank=0, training_mode=True, capture_hidden_states=True,
                           capture_logits=True)
    get_moe_router_tracer().register_hooks(model)
    _train_forward(model, batches(1)[0])
    get_moe_router_tracer().advance_step(0)
    for record in _records(tmp_path):
        assert torch.equal(oracle.load_hidden_states_for_record(record, str(tmp_path)),
                           load_hidden_states_for_record(record, str(tmp_path)))
        assert torch.equal(oracle.load_logits_for_record(record, str(tmp_path)),
                           load_logits_for_record(record, str(tmp_path)))
