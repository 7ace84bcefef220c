"""The full-iteration CUDA graph (``megatron_core.full_cuda_graph``, ``cuda_graph_impl="full_iteration"``).

CPU: the struct copy helpers and ``StaticBufferLoader`` on nested structures (values, fresh or reused storage,
shapes, dtypes, errors naming the mismatch), the wrapper passing every call through eagerly with exactly what the
wrapped function returns (also through the real schedule), ``data_read`` per model chunk, the config rules. GPU
(one H200, each run in a fresh process): a small GPT, fp32 and bf16, trained with the wrapped no-pipelining
schedule over 2 micro-batches gives bit for bit the losses and gradients of the eager schedule, the training and the
validation graphs are each captured once and then replayed (the wrapped function runs only for the warm-up and the
capture), and each call's new data reaches the graph.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import device, parallel_state
from megatron_core import full_cuda_graph as fcg
from megatron_core.full_cuda_graph import (
    FullCudaGraphWrapper,
    StaticBufferLoader,
    clone_tensors_in_struct,
    copy_tensors_in_struct,
)
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.transformer.transformer_config import TransformerConfig
from tests.dist_harness import run_on_ranks
from tests.pipeline_parallel import toy_model
from tests.pipeline_parallel.toy_model import ToyConfig, ToyStage, make_batches


@pytest.fixture(autouse=True)
def _fresh_graph_state(monkeypatch):
    """The wrapper's and the loader's process-wide state, empty for each test."""
    monkeypatch.setattr(StaticBufferLoader, "static_buffers", {"training": [], "validation": []})
    monkeypatch.setattr(FullCudaGraphWrapper, "curr_iteration", {"training": 0, "validation": 0})
    monkeypatch.setattr(FullCudaGraphWrapper, "cuda_graph", {"training": None, "validation": None})
    monkeypatch.setattr(FullCudaGraphWrapper, "result", {"training": None, "validation": None})


def _nested() -> dict:
    return {"tokens": torch.arange(6).view(2, 3), "mask": torch.ones(2, 3, dtype=torch.bool),
            "pair": (torch.tensor([1.5]), 7), "items": [torch.zeros(2, dtype=torch.bfloat16), "name"], "none": None}


# ---------------------------------------------------------------------------------------------------- helpers
def test_copy_tensors_in_struct_makes_detached_copies_and_keeps_other_values():
    src = _nested()
    src["grad"] = torch.ones(3, requires_grad=True) * 2
    out = copy_tensors_in_struct(src)
    assert set(out) == set(src) and isinstance(out["pair"], tuple) and isinstance(out["items"], list)
    for got, want in ((out["tokens"], src["tokens"]), (out["mask"], src["mask"]), (out["pair"][0], src["pair"][0]),
                      (out["items"][0], src["items"][0]), (out["grad"], src["grad"])):
        assert torch.equal(got.cpu(), want) and got.dtype == want.dtype and got.shape == want.shape
        assert got.device == device.get_current_device() and not got.requires_grad
        assert got.data_ptr() != want.data_ptr()
    assert out["pair"][1] == 7 and out["items"][1] == "name" and out["none"] is None
    src["tokens"].add_(1)
    assert torch.equal(out["tokens"].cpu(), torch.arange(6).view(2, 3))  # no storage shared
    assert copy_tensors_in_struct(5) == 5


def test_clone_tensors_in_struct_writes_into_the_existing_tensors():
    tgt = {"tokens": torch.zeros(2, 3, dtype=torch.long), "items": [torch.zeros(2), "old"], "n": 1}
    pointers = (tgt["tokens"].data_ptr(), tgt["items"][0].data_ptr())
    src = {"tokens": torch.arange(6).view(2, 3), "items": [torch.tensor([3.0, 4.0]), "new"], "n": 2}
    clone_tensors_in_struct(tgt, src)
    assert (tgt["tokens"].data_ptr(), tgt["items"][0].data_ptr()) == pointers
    assert torch.equal(tgt["tokens"], src["tokens"]) and torch.equal(tgt["items"][0], src["items"][0])
    assert tgt["items"][1] == "new" and tgt["n"] == 2


@pytest.mark.parametrize("tgt, src, error, words", [
    ({"a": torch.zeros(2)}, torch.zeros(2), TypeError, ["top level", "Tensor"]),
    ((torch.zeros(1),), (torch.zeros(1),), TypeError, ["top level", "tuple"]),
    ({"a": (torch.zeros(1),)}, {"a": (torch.ones(1),)}, TypeError, ["tuple", "['a']"]),
    ({"a": torch.zeros(2, 3)}, {"a": torch.zeros(3)}, ValueError, ["['a']", "(3,)", "(2, 3)"]),
    ({"a": torch.zeros(3)}, {"a": torch.zeros(3, dtype=torch.float64)}, ValueError, ["['a']", "float64", "float32"]),
    ({"a": [torch.zeros(1)]}, {"a": [torch.zeros(1), torch.zeros(1)]}, ValueError, ["['a']", "2 items", "1 in tgt"]),
    ({"a": torch.zeros(1)}, {"a": torch.zeros(1), "b": torch.zeros(1)}, ValueError, ["'b'", "missing"]),
    ({"a": 3}, {"a": torch.zeros(1)}, TypeError, ["['a']", "tensor", "int"]),
    ({"a": {"b": torch.zeros(1)}}, {"a": [torch.zeros(1)]}, TypeError, ["['a']", "list", "dict"]),
])
def test_clone_tensors_in_struct_refuses_mismatched_structures(tgt, src, error, words):
    with pytest.raises(error) as caught:
        clone_tensors_in_struct(tgt, src)
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_static_buffer_loader_allocates_once_then_copies_into_the_same_buffers():
    loader = StaticBufferLoader()
    first = loader({"x": torch.ones(2, 2), "step": 0}, "training", 0)
    assert StaticBufferLoader.static_buffers["training"] == [first]
    pointer = first["x"].data_ptr()
    again = loader(({"x": torch.full((2, 2), 3.0), "step": 1}, "ignored"), "training", 0)  # a tuple led by the dict
    assert again is first and first["x"].data_ptr() == pointer
    assert torch.equal(first["x"].cpu(), torch.full((2, 2), 3.0)) and first["step"] == 1
    grown = loader({"x": torch.zeros(2, 2), "y": torch.arange(3), "step": 2}, "training", 0)
    assert torch.equal(grown["y"].cpu(), torch.arange(3)) and grown["x"].data_ptr() == pointer
    second = loader({"x": torch.zeros(2, 2)}, "validation", 0)
    assert StaticBufferLoader.static_buffers["validation"] == [second] and second is not first
    assert len(StaticBufferLoader.static_buffers["training"]) == 1


@pytest.mark.parametrize("call, error, words", [
    (lambda load: load({"x": torch.zeros(1)}, "testing", 0), ValueError, ["stage", "'testing'"]),
    (lambda load: load({"x": torch.zeros(1)}, "training", 1), ValueError, ["microbatch (1)", "0"]),
    (lambda load: load([torch.zeros(1)], "training", 0), TypeError, ["dict", "list"]),
    (lambda load: load((torch.zeros(1),), "training", 0), TypeError, ["dict", "tuple"]),
])
def test_static_buffer_loader_refuses_bad_calls(call, error, words):
    with pytest.raises(error) as caught:
        call(StaticBufferLoader())
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_data_read_fills_one_iterator_of_static_buffers_per_model_chunk():
    wrapper = FullCudaGraphWrapper(lambda **kwargs: [])
    batches = [{"x": torch.full((2,), float(i))} for i in range(3)]
    (single,) = wrapper.data_read(iter(batches), torch.nn.Linear(1, 1), True, 2)
    assert [b["x"][0].item() for b in single] == [0.0, 1.0]
    assert wrapper.data_read([None], torch.nn.Linear(1, 1), True, 2) == [None]
    chunks = [torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)]
    first, second = wrapper.data_read([iter(batches), None], chunks, False, 2)
    assert second is None and [b["x"][0].item() for b in first] == [0.0, 1.0]
    assert len(StaticBufferLoader.static_buffers["validation"]) == 2
    with pytest.raises(ValueError, match="2 model chunks take a list of 2 data iterators, got a list of 1"):
        wrapper.data_read([iter(batches)], chunks, True, 1)
    with pytest.raises(ValueError, match="one model chunk takes one data iterator, got a list of 2"):
        wrapper.data_read([iter(batches), iter(batches)], chunks[0], True, 1)


# ---------------------------------------------------------------------------------------------------- wrapper, CPU
def test_without_cuda_every_call_runs_eagerly_and_returns_what_the_function_returns(monkeypatch):
    monkeypatch.setattr(fcg, "_on_cuda", lambda: False)  # also on a GPU machine: the CPU route
    seen = []

    def forward_backward(**kwargs):
        seen.append(kwargs)
        return [{"loss": torch.tensor(float(len(seen)))}]

    wrapper = FullCudaGraphWrapper(forward_backward, cuda_graph_warmup_steps=1)
    iterator = iter([])
    for call in range(4):
        forward_only = call == 3
        result = wrapper(forward_step_func=None, data_iterator=iterator, model="m", num_microbatches=2,
                         seq_length=8, forward_only=forward_only)
        assert result is FullCudaGraphWrapper.result["validation" if forward_only else "training"]
        assert result[0]["loss"].item() == call + 1
        assert seen[-1]["data_iterator"] is iterator  # passed through untouched
    assert len(seen) == 4
    assert FullCudaGraphWrapper.curr_iteration == {"training": 3, "validation": 1}
    assert FullCudaGraphWrapper.cuda_graph == {"training": None, "validation": None}
    wrapper.reset_cuda_graph("training")
    assert FullCudaGraphWrapper.curr_iteration == {"training": 0, "validation": 1}
    wrapper.reset_cuda_graph()
    assert FullCudaGraphWrapper.curr_iteration == {"training": 0, "validation": 0}
    assert FullCudaGraphWrapper.result == {"training": None, "validation": None}


def test_wrapper_refuses_bad_calls_and_settings():
    wrapper = FullCudaGraphWrapper(lambda **kwargs: [])
    with pytest.raises(TypeError, match="keyword arguments only"):
        wrapper(1)
    with pytest.raises(TypeError, match=r"\['num_microbatches', 'seq_length'\]"):
        wrapper(model=None, data_iterator=None, forward_only=False)
    for steps in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"cuda_graph_warmup_steps \(.*\) must be an integer >= 0"):
            FullCudaGraphWrapper(lambda **kwargs: [], cuda_graph_warmup_steps=steps)
    with pytest.raises(ValueError, match="stage \\('test'\\)"):
        wrapper.reset_cuda_graph("test")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_graph_pools_and_the_capture_stream_need_cuda():
    for call in (fcg.get_shared_capture_stream, fcg.get_shared_graph_pool, lambda: fcg.get_graph_pool(False)):
        with pytest.raises(RuntimeError, match="needs CUDA"):
            call()


def _wrapped_schedule_on_cpu() -> tuple[list, list, dict, dict]:
    parallel_state.initialize_model_parallel()
    try:
        runs = []
        for wrap in (False, True):
            model = ToyStage(ToyConfig(), list(range(toy_model.NUM_LAYERS)), pre_process=True)
            schedule = get_forward_backward_func()
            if wrap:
                schedule = FullCudaGraphWrapper(schedule, cuda_graph_warmup_steps=1)
            losses = []
            for step in range(3):
                out = schedule(forward_step_func=toy_model.forward_step, data_iterator=iter(make_batches(2, step)),
                               model=model, num_microbatches=2, seq_length=4, micro_batch_size=2, forward_only=False)
                losses.append([d["loss"] for d in out])
            runs.append((losses, model.named_grads()))
            FullCudaGraphWrapper.cuda_graph["training"] = None  # nothing captured: reset for the worker's next test
            FullCudaGraphWrapper.curr_iteration["training"] = 0
        (plain_losses, plain_grads), (wrapped_losses, wrapped_grads) = runs
        return plain_losses, wrapped_losses, plain_grads, wrapped_grads
    finally:
        parallel_state.destroy_model_parallel()


def test_on_cpu_the_wrapped_schedule_equals_the_schedule():
    ((plain_losses, wrapped_losses, plain_grads, wrapped_grads),) = run_on_ranks(1, _wrapped_schedule_on_cpu)
    for got, want in zip(wrapped_losses, plain_losses):
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
    assert plain_grads.keys() == wrapped_grads.keys()
    for name, grad in wrapped_grads.items():
        assert torch.equal(grad, plain_grads[name]), name


# ---------------------------------------------------------------------------------------------------- config
SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, attention_dropout=0.0)


def test_full_iteration_is_accepted_with_an_empty_module_list():
    for modules in ("full", [], None):
        config = TransformerConfig(**SHAPE, cuda_graph_impl="full_iteration", cuda_graph_modules=modules)
        assert config.cuda_graph_impl == "full_iteration"


@pytest.mark.parametrize("kwargs, names", [
    (dict(cuda_graph_modules=["attn"]), ["cuda_graph_modules", "attn", "full_iteration"]),
    (dict(cuda_graph_scope="mlp"), ["cuda_graph_scope", "mlp"]),
    (dict(attention_dropout=0.1), ["attention_dropout=0.1", "full_iteration"]),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True), ["sequence_parallel=True"]),
    (dict(recompute_granularity="selective"), ["recompute_granularity='selective'"]),
    (dict(num_moe_experts=4), ["num_moe_experts=4", "moe_grouped_gemm=False"]),
    (dict(num_moe_experts=4, moe_grouped_gemm=True), ["num_moe_experts=4", "fp32 experts"]),
    (dict(num_moe_experts=4, moe_grouped_gemm=True, bf16=True, expert_model_parallel_size=2),
     ["expert_model_parallel_size=2", "expert_tensor_parallel_size=1"]),
    (dict(num_moe_experts=4, moe_grouped_gemm=True, bf16=True, tensor_model_parallel_size=2),
     ["expert_tensor_parallel_size=2"]),
    (dict(num_moe_experts=4, moe_grouped_gemm=True, bf16=True, moe_expert_capacity_factor=1.0),
     ["moe_expert_capacity_factor=1.0", "moe_pad_expert_input_to_capacity"]),
    (dict(calculate_per_token_loss=True), ["calculate_per_token_loss=True", "finalize_model_grads"]),
])
def test_full_iteration_refusals_name_the_field(kwargs, names):
    with pytest.raises(ValueError) as caught:
        TransformerConfig(**{**SHAPE, **kwargs}, cuda_graph_impl="full_iteration")
    for name in names:
        assert name in str(caught.value), str(caught.value)


@pytest.mark.parametrize("kwargs", [
    dict(bf16=True),
    dict(fp16=True),
    dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),  # fp32: every expert padded
    dict(bf16=True, moe_token_dispatcher_type="alltoall"),
], ids=["bf16", "fp16", "fp32-padded", "alltoall"])
def test_full_iteration_accepts_moe_whose_counts_stay_on_the_device(kwargs):
    config = TransformerConfig(**SHAPE, num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True,
                               cuda_graph_impl="full_iteration", **kwargs)
    assert config.cuda_graph_impl == "full_iteration"


def test_a_host_read_of_the_expert_counts_inside_a_capture_says_where_and_what_a_captured_moe_needs(monkeypatch):
    """On CPU (fp32, per-expert GEMMs) the experts read their counts on the host; with a capture pretended, the
    forward stops there with the path and the rule named (on a GPU, CUDA would raise its bare capture error)."""
    from megatron_core import device as mdevice
    from megatron_core.models.gpt import GPTModel
    from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron_core.transformer.moe.host_counts import CAPTURABLE_MOE_RULE
    from tests.models.gpt_test_utils import MAX_SEQ, VOCAB, batch, llama_like

    spec = llama_like(hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                      num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True)
    model = GPTModel(TransformerConfig(**spec["config"]), get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True),
                     VOCAB, MAX_SEQ, **spec["model"])
    ids, pos, labels = batch(0)
    assert model(ids, pos, None, labels=labels).shape == labels.shape  # uncaptured: runs
    monkeypatch.setattr(mdevice, "is_capturing", lambda tensor: True)
    with pytest.raises(RuntimeError) as caught:
        model(ids, pos, None, labels=labels)
    message = str(caught.value)
    assert "reads the tokens-per-expert counts on the host" in message and CAPTURABLE_MOE_RULE in message
    assert "row split" in message or "fallback" in message, message


# ---------------------------------------------------------------------------------------------------- GPU
GPU_STEPS, GPU_MICROBATCHES, GPU_WARMUP = 5, 2, 2
EVAL_SEEDS = (500, 501, 500, 501, 502)  # the capture (third call) reads 500; replays read 501, then 502


def _gpu_micro_batches(seed: int) -> list[dict]:
    from tests.models.gpt_test_utils import batch

    out = []
    for m in range(GPU_MICROBATCHES):
        ids, pos, labels = batch(seed * 10 + m)
        out.append({"tokens": ids.cuda(), "position_ids": pos.cuda(), "labels": labels.cuda()})
    return out


def _gpt_forward_step(data_iterator, model):
    data = next(data_iterator)
    output = model(data["tokens"], data["position_ids"], None, labels=data["labels"])  # per-token losses [b, s]

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _gpu_train(graphed: bool, bf16: bool, moe: str = "") -> dict:
    """``GPU_STEPS`` Adam steps of a small llama-like GPT under DDP, then ``EVAL_SEEDS`` validation calls; the
    schedule wrapped in a ``FullCudaGraphWrapper`` (``GPU_WARMUP`` eager calls per stage) or called eagerly. ``moe``
    ``"bf16"`` / ``"fp8"``: every MLP an MoE of 4 grouped experts, top-2 (``"fp8"``: its GEMMs in FP8, torchao's
    tensorwise recipe for the dense layers and this library's grouped FP8 GEMMs for the experts)."""
    from megatron_core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron_core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from tests.models.gpt_test_utils import BATCH, SEQ, build, llama_like

    torch.manual_seed(0)
    dtype = dict(bf16=True, params_dtype=torch.bfloat16) if bf16 else {}
    spec = llama_like(hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128, **dtype)
    impl = "full_iteration" if graphed else "none"
    if moe:
        from megatron_core.fp8 import convert_to_float8
        from megatron_core.models.gpt import GPTModel
        from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from tests.models.gpt_test_utils import MAX_SEQ, VOCAB

        fp8 = dict(fp8="hybrid", fp8_recipe="tensorwise") if moe == "fp8" else {}
        config = TransformerConfig(**spec["config"], num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True,
                                   moe_token_dispatcher_type="alltoall", cuda_graph_impl=impl, **fp8)
        model = GPTModel(config, get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True), VOCAB, MAX_SEQ,
                         **spec["model"]).cuda()
        if fp8:
            convert_to_float8(model)
    else:
        model = build(spec, cuda_graph_impl=impl).cuda()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=bf16), [ddp])
    python_calls = {"training": 0, "validation": 0}

    def counted(**kwargs):
        python_calls["validation" if kwargs["forward_only"] else "training"] += 1
        return forward_backward_no_pipelining(**kwargs)

    schedule = FullCudaGraphWrapper(counted, cuda_graph_warmup_steps=GPU_WARMUP) if graphed else counted

    def run(seed: int, forward_only: bool) -> torch.Tensor:
        out = schedule(forward_step_func=_gpt_forward_step, data_iterator=iter(_gpu_micro_batches(seed)), model=ddp,
                       num_microbatches=GPU_MICROBATCHES, seq_length=SEQ, micro_batch_size=BATCH,
                       forward_only=forward_only)
        return torch.stack([d["lm loss"] for d in out]).cpu()  # copied now: the next replay overwrites them

    losses, grads = [], []
    for step in range(GPU_STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        losses.append(run(step, forward_only=False))
        grads.append(torch.cat([p.main_grad.detach().float().flatten() for p in model.parameters()]).cpu())
        assert opt.step()[0]
    ddp.eval()
    with torch.no_grad():
        eval_losses = [run(seed, forward_only=True) for seed in EVAL_SEEDS]
    torch.cuda.synchronize()
    return dict(losses=torch.stack(losses), grads=torch.stack(grads), eval=torch.stack(eval_losses),
                python_calls=python_calls,
                captured={stage: graph is not None for stage, graph in FullCudaGraphWrapper.cuda_graph.items()})


@pytest.mark.gpu
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_full_iteration_graph_trains_exactly_as_the_eager_schedule(bf16):
    """Bit for bit equal losses (every step, every micro-batch) and gradients: a replay that read a stale batch or
    stale weights, or lost a gradient write, would differ. The wrapped function ran only for the warm-up calls and
    the one capture per stage; the validation replays read their own batches (501 then 502 differ from 500, and the
    replay of 501 equals its eager call)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.cuda_process_group import in_fresh_process

    graphed = in_fresh_process(_gpu_train, True, bf16)
    eager = in_fresh_process(_gpu_train, False, bf16)
    assert graphed["captured"] == {"training": True, "validation": True}, graphed["captured"]
    assert graphed["python_calls"] == {"training": GPU_WARMUP + 1, "validation": GPU_WARMUP + 1}
    assert eager["python_calls"] == {"training": GPU_STEPS, "validation": len(EVAL_SEEDS)}
    assert torch.equal(graphed["losses"], eager["losses"]), (graphed["losses"], eager["losses"])
    assert torch.equal(graphed["grads"], eager["grads"]), (graphed["grads"] - eager["grads"]).abs().max()
    assert torch.equal(graphed["eval"], eager["eval"]), (graphed["eval"], eager["eval"])
    evals = graphed["eval"]
    assert torch.equal(evals[2], evals[0]) and torch.equal(evals[3], evals[1])  # captured / replayed vs eager
    assert not torch.equal(evals[3], evals[2]) and not torch.equal(evals[4], evals[3])  # new data reached the graph


@pytest.mark.gpu
@pytest.mark.parametrize("moe", ["bf16", "fp8"])
def test_full_iteration_graph_of_a_dropless_moe_trains_exactly_as_the_eager_schedule(moe):
    """The same for an MoE GPT (4 grouped experts, top-2, dropless, bf16; and with FP8 GEMMs): its token counts
    never leave the device, so the whole iteration is captured, and each replay routes its own batch (the routing
    changes with the data and the weights), giving the eager schedule's losses and gradients bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if moe == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9 or newer")
    from tests.cuda_process_group import in_fresh_process

    graphed = in_fresh_process(_gpu_train, True, True, moe)
    eager = in_fresh_process(_gpu_train, False, True, moe)
    assert graphed["captured"] == {"training": True, "validation": True}, graphed["captured"]
    assert graphed["python_calls"] == {"training": GPU_WARMUP + 1, "validation": GPU_WARMUP + 1}
    assert torch.equal(graphed["losses"], eager["losses"]), (graphed["losses"], eager["losses"])
    assert torch.equal(graphed["grads"], eager["grads"]), (graphed["grads"] - eager["grads"]).abs().max()
    assert torch.equal(graphed["eval"], eager["eval"]), (graphed["eval"], eager["eval"])
    assert not torch.equal(graphed["eval"][4], graphed["eval"][3])  # new data reached the graph
