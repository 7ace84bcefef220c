"""Per-layer CUDA graphs in training (``cuda_graph_impl="local"``, ``transformer.layer_cuda_graphs``).

CPU: the config rules (Megatron-Core's names, the refusals by name), the layer runs eagerly and unchanged where no
CUDA graph exists, the compiled route traces every layer call into one graph (with an eager backend), and
``DistributedDataParallel`` marks the gradient-buffer views static and refuses first-write overwrites. GPU: a bf16 GPT trained
with the distributed optimizer gives bit for bit the losses and main weights of the same layers compiled without
graphs (the same Inductor kernels; only the launches differ), with and without FP8 parameters, and the graphs were
recorded, none skipped.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.transformer import layer_cuda_graphs
from megatron_core.transformer.transformer_config import TransformerConfig
from tests.cuda_process_group import in_fresh_process
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import batch, build, llama_like

SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4)


def _config(**kwargs) -> TransformerConfig:
    return TransformerConfig(**SHAPE, **kwargs)


def test_local_impl_is_accepted_and_enable_cuda_graph_maps_to_it():
    assert _config(cuda_graph_impl="local").cuda_graph_impl == "local"
    assert _config(cuda_graph_impl="local", cuda_graph_modules=[]).cuda_graph_impl == "local"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = _config(enable_cuda_graph=True)
    assert config.cuda_graph_impl == "local"
    assert any("enable_cuda_graph is deprecated" in str(w.message) for w in caught)


@pytest.mark.parametrize("kwargs, names", [
    (dict(cuda_graph_impl="transformer_engine"), ["cuda_graph_impl", "transformer_engine"]),
    (dict(cuda_graph_impl="full_iteration", cuda_graph_modules=["attn"]), ["cuda_graph_modules", "full_iteration"]),
    (dict(cuda_graph_impl="graphs"), ["cuda_graph_impl", "graphs", "local"]),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["attn"]), ["cuda_graph_modules", "attn", "full"]),
    (dict(cuda_graph_impl="local", cuda_graph_scope="mlp"), ["cuda_graph_scope", "mlp"]),
    (dict(cuda_graph_impl="local", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
     ["recompute_granularity", "full"]),
    (dict(cuda_graph_impl="local", num_moe_experts=4), ["num_moe_experts", "4"]),
    (dict(enable_cuda_graph=True, cuda_graph_impl="local"), ["enable_cuda_graph", "cuda_graph_impl"]),
    (dict(external_cuda_graph=True), ["external_cuda_graph"]),
])
def test_unsupported_cuda_graph_settings_are_refused_by_name(kwargs, names):
    with pytest.raises(ValueError) as err:
        _config(**kwargs)
    for name in names:
        assert name in str(err.value), str(err.value)


def test_graphs_apply_only_to_grad_enabled_cuda_calls_outside_compiled_code():
    config = _config(cuda_graph_impl="local")
    x = torch.zeros(2)
    assert not layer_cuda_graphs.wants_cuda_graph(config, x)  # a CPU tensor: no CUDA graphs here
    assert not layer_cuda_graphs.wants_cuda_graph(_config(), x)
    assert not layer_cuda_graphs.wants_cuda_graph(config, None)
    if torch.cuda.is_available():
        y = x.cuda()
        assert layer_cuda_graphs.wants_cuda_graph(config, y)
        with torch.no_grad():
            assert not layer_cuda_graphs.wants_cuda_graph(config, y)
        assert not layer_cuda_graphs.wants_cuda_graph(_config(), y)


def _loss_and_grads(cuda_graph_impl: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build(llama_like(), cuda_graph_impl=cuda_graph_impl)
    ids, pos, labels = batch(3)
    loss = model(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_on_the_cpu_the_layer_runs_eagerly_and_unchanged():
    compiled_before = list(layer_cuda_graphs._compiled)
    loss, grads = _loss_and_grads("local")
    want_loss, want_grads = _loss_and_grads("none")
    assert layer_cuda_graphs._compiled == compiled_before  # nothing was compiled for a CPU call
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


def _train_two_steps(cuda_graph_impl: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build(llama_like(), cuda_graph_impl=cuda_graph_impl)
    ids, pos, labels = batch(3)
    losses = []
    for _ in range(2):
        loss = model(ids, pos, None, labels=labels).float().mean()
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_graphed_route_traces_every_layer_call_into_one_graph(monkeypatch):
    """The route a CUDA call takes, run on the CPU: each layer call goes through the one compiled function (here
    with AOTAutograd's eager backend instead of Inductor's graphs), Dynamo traces through ``TransformerLayer.__call__``
    into the plain layer, both layers share one graph without breaks, and losses and gradients equal the plain
    model's exactly."""
    from torch._dynamo.utils import counters

    from megatron_core.transformer import transformer_layer

    def wants_on_cpu(config, hidden_states) -> bool:  # wants_cuda_graph without the CUDA-device condition
        return (layer_cuda_graphs.local_cuda_graphs_enabled(config) and isinstance(hidden_states, torch.Tensor)
                and torch.is_grad_enabled() and not torch.compiler.is_compiling())

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(transformer_layer, "wants_cuda_graph", wants_on_cpu)
    monkeypatch.setattr(layer_cuda_graphs, "_compiled",
                        [torch.compile(layer_cuda_graphs._call_layer, backend="aot_eager")])
    try:
        losses, grads = _train_two_steps("local")
        stats, breaks = dict(counters["stats"]), dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    want_losses, want_grads = _train_two_steps("none")
    assert stats.get("unique_graphs") == 1 and not breaks, (stats, breaks)
    assert losses == want_losses
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


def _static_marks(cuda_graph_impl: str) -> list[str | None]:
    parallel_state.initialize_model_parallel()
    try:
        model = build(llama_like(), cuda_graph_impl=cuda_graph_impl)
        DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
        return [getattr(p.main_grad, "_dynamo_static_input_type", None) for p in model.parameters()]
    finally:
        parallel_state.destroy_model_parallel()


def test_ddp_marks_the_gradient_buffer_views_static_for_graphed_layers():
    (marks,) = run_on_ranks(1, _static_marks, "local")
    assert marks and all(mark == "unguarded" for mark in marks), marks
    (plain,) = run_on_ranks(1, _static_marks, "none")
    assert plain and all(mark is None for mark in plain), plain


def _ddp_with_overwrite() -> str:
    parallel_state.initialize_model_parallel()
    try:
        model = build(llama_like(), cuda_graph_impl="local")
        try:
            DistributedDataParallel(model.config, DistributedDataParallelConfig(
                use_distributed_optimizer=True, overwrite_main_grad_on_first_wgrad=True), model)
        except ValueError as err:
            return str(err)
        return ""
    finally:
        parallel_state.destroy_model_parallel()


def test_ddp_refuses_first_write_overwrites_under_graphed_layers():
    (message,) = run_on_ranks(1, _ddp_with_overwrite)
    assert "overwrite_main_grad_on_first_wgrad" in message and "cuda_graph_impl" in message, message


# ---------------------------------------------------------------------------------------------------- GPU
CUDA_STEPS, CUDA_MICROBATCHES, CUDA_LR = 4, 2, 1e-3


def _recorded_graphs() -> int:
    """How many CUDA graphs Inductor's graph trees hold on the current device."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    if manager is None:
        return 0
    nodes = [node for roots in manager.roots.values() for node in roots]
    count = 0
    while nodes:
        node = nodes.pop()
        count += 1
        nodes += [child for children in node.children.values() for child in children]
    return count


def _cuda_train(cuda_graph_impl: str, compile_layers: bool, fp8_param: bool, weight_cache: bool = False) -> dict:
    """A bf16 llama-like GPT (FP8 parameters if asked) on CUDA: DDP with the distributed optimizer, 2 micro-batches
    per step, ``CUDA_STEPS`` Adam steps; per-step losses, the fp32 main weights, the graphs recorded and skipped.
    ``weight_cache``: each step starts with ``set_is_first_microbatch`` (the FP8 weights' transposes cached)."""
    from torch._dynamo.utils import counters

    from megatron_core.fp8 import convert_to_float8

    torch._dynamo.reset()  # also drops the CUDA graph trees of an earlier run
    counters.clear()
    torch.manual_seed(0)
    fp8 = dict(fp8="hybrid", fp8_recipe="tensorwise") if fp8_param else {}
    spec = llama_like(**fp8, hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=1024,
                      bf16=True, params_dtype=torch.bfloat16)
    model = build(spec, fp8_param=fp8_param, cuda_graph_impl=cuda_graph_impl).cuda()
    if fp8_param:
        convert_to_float8(model)
    if compile_layers:
        for layer in model.decoder.layers:
            layer.compile()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, fp8_param_gather=fp8_param), model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=CUDA_LR, bf16=True, use_distributed_optimizer=True), [ddp])
    micro = [tuple(t.cuda() for t in batch(seed)) for seed in range(3, 3 + CUDA_MICROBATCHES)]
    losses = []
    for _ in range(CUDA_STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        total = torch.zeros((), device="cuda")
        if weight_cache:
            model.set_is_first_microbatch()
        for ids, pos, labels in micro:
            loss = ddp(ids, pos, None, labels=labels).float().mean() / CUDA_MICROBATCHES
            loss.backward()
            total += loss.detach()
        finalize_model_grads([ddp])
        assert opt.step()[0]
        losses.append(total)
    torch.cuda.synchronize()
    main = {id(e.model_param): e.main_param.detach().clone() for e in opt._entries()}
    return dict(losses=torch.stack(losses).cpu(), main=[main[id(p)].cpu() for p in model.parameters()],
                graphs=_recorded_graphs(), skips=counters["inductor"]["cudagraph_skips"])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_param", [False, True], ids=["bf16", "fp8_param"])
def test_cuda_graphed_layers_train_exactly_as_the_compiled_layers(fp8_param):
    """The same layers compiled without graphs are the yardstick: bit for bit equal losses and main weights after 4
    steps of 2 micro-batches (a replay that read a stale input or lost a ``main_grad`` write would differ). The
    eager model agrees within bf16's compile-vs-eager rounding (2% over the run). Each run has a process of its own:
    Inductor may fuse differently when it compiles the same layers a second time in a process (``in_fresh_process``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if fp8_param:
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("needs a GPU with FP8 tensor cores (compute capability >= 8.9)")
        pytest.importorskip("torchao.float8")
    graphed = in_fresh_process(_cuda_train, "local", False, fp8_param)
    compiled = in_fresh_process(_cuda_train, "none", True, fp8_param)
    eager = in_fresh_process(_cuda_train, "none", False, fp8_param)
    assert graphed["skips"] == 0, graphed["skips"]
    assert graphed["graphs"] >= 2 * SHAPE["num_layers"], graphed["graphs"]  # at least each layer's fwd and bwd
    assert compiled["graphs"] == 0, compiled["graphs"]
    assert torch.equal(graphed["losses"], compiled["losses"]), (graphed["losses"], compiled["losses"])
    for got, want in zip(graphed["main"], compiled["main"]):
        assert torch.equal(got, want), (got - want).abs().max()
    assert torch.allclose(graphed["losses"], eager["losses"], rtol=2e-2), (graphed["losses"], eager["losses"])
    assert graphed["losses"][-1] < graphed["losses"][0]


@pytest.mark.gpu
def test_cuda_graphed_fp8_layers_with_cached_weight_transposes():
    """FP8 layers whose weights' transposes are cached for each step (``set_is_first_microbatch``: refreshed in the
    first micro-batch's forward, read by every micro-batch's backward). Graphed against the same layers compiled
    without graphs, both with the cache: bit for bit equal losses and main weights after 4 steps (a refresh that a
    replay skipped would leave step 2's data gradients on step 1's weights), no graph skipped. Eagerly, with the cache
    against without it: bit for bit (the cached codes are the transposed ones). The compiled graphs with the refresh
    are other graphs than without it, so Inductor's kernels, and bf16 roundings, may differ between those two."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability >= 8.9)")
    graphed = in_fresh_process(_cuda_train, "local", False, True, True)
    compiled = in_fresh_process(_cuda_train, "none", True, True, True)
    eager_cached = in_fresh_process(_cuda_train, "none", False, True, True)
    eager = in_fresh_process(_cuda_train, "none", False, True)
    assert graphed["skips"] == 0, graphed["skips"]
    for got, want in ((graphed, compiled), (eager_cached, eager)):
        assert torch.equal(got["losses"], want["losses"]), (got["losses"], want["losses"])
        for a, b in zip(got["main"], want["main"]):
            assert torch.equal(a, b), (a - b).abs().max()
    assert torch.allclose(graphed["losses"], eager["losses"], rtol=2e-2), (graphed["losses"], eager["losses"])
