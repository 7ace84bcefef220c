"""``megatron_core.compile_guards``: the structural guards of compiled modules dropped, the value guards kept.

On CPU (Dynamo's guards do not depend on the backend, so ``aot_eager`` stands in for Inductor): a flag and a config
value a forward branches on still recompile the layer; the filter drops the structural guards on the module and
keeps the inputs' and globals'; an MoE GPT with FP8 experts (emulated), its layers compiled with the filter, trains
three steps of two micro-batches (the FP8 weight cache refreshed at each step's first) exactly as with Dynamo's own
guards. On a Hopper GPU the same with the per-expert FP8 GEMMs and Inductor.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from megatron_core import compile_guards
from megatron_core.compile_guards import layer_compile_options, module_value_guard_filter

needs_guard_filter = pytest.mark.skipif(not layer_compile_options(), reason="this torch takes no guard_filter_fn")


@dataclass
class _Config:
    scale: float = 2.0


class _Flagged(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.config = _Config()
        self.is_first_microbatch = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x) * self.config.scale
        if self.is_first_microbatch:
            self.is_first_microbatch = False
            return y + 100.0
        return y


@needs_guard_filter
def test_value_guards_still_recompile():
    torch._dynamo.reset()
    module = _Flagged()
    compiled = torch.compile(module, backend="aot_eager", options=layer_compile_options())
    x = torch.randn(2, 4)
    with torch.no_grad():
        first, second = compiled(x), compiled(x)
        module.config.scale = 3.0
        third = compiled(x)
        plain = module.linear(x)
    torch.testing.assert_close(first, plain * 2.0 + 100.0)
    torch.testing.assert_close(second, plain * 2.0)
    torch.testing.assert_close(third, plain * 3.0)


@needs_guard_filter
def test_structural_module_guards_are_dropped_and_the_rest_kept():
    torch._dynamo.reset()
    seen = []

    def recording(entries):
        keep = module_value_guard_filter(entries)
        seen.extend(zip(entries, keep))
        return keep

    module = _Flagged()
    torch.compile(module, backend="aot_eager", options={"guard_filter_fn": recording})(torch.randn(2, 4))
    dropped = [entry for entry, keep in seen if not keep]
    kept = [entry for entry, keep in seen if keep]
    assert dropped and all(compile_guards._on_module(entry) for entry in dropped)
    assert all(entry.guard_type not in compile_guards.VALUE_GUARD_TYPES for entry in dropped)
    kept_names = " ".join(entry.name for entry in kept)
    assert "is_first_microbatch" in kept_names and "scale" in kept_names
    assert any(entry.guard_type == "TENSOR_MATCH" and not compile_guards._on_module(entry) for entry in kept)


def _train_moe(options: dict, device: str, backend: str, steps: int = 3, microbatches: int = 2
               ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of ``steps`` SGD steps of ``microbatches`` micro-batches of a small FP8 MoE GPT whose layers are
    compiled with ``options``, and its final weights."""
    from megatron_core.fp8 import convert_to_float8
    from tests.transformer.moe.moe_parallel_utils import batches, build

    torch._dynamo.reset()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build("mixtral", moe_grouped_gemm=True, fp8="e4m3", fp8_recipe="tensorwise",
                  bf16=dtype == torch.bfloat16).to(device, dtype)
    convert_to_float8(model, emulate=device != "cuda")
    for layer in model.decoder.layers:
        layer.compile(backend=backend, options=options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(steps * microbatches, seq=16)
    losses = []
    for step in range(steps):
        model.set_is_first_microbatch()
        for ids, position_ids, labels in data[step * microbatches:(step + 1) * microbatches]:
            loss = model(ids.to(device), position_ids.to(device), None, labels=labels.to(device)).float().mean()
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_same_training(device: str, backend: str) -> None:
    want_losses, want_weights = _train_moe({}, device, backend)
    got_losses, got_weights = _train_moe(layer_compile_options(), device, backend)
    assert got_losses == want_losses
    for name, want in want_weights.items():
        assert torch.equal(got_weights[name], want), name


@needs_guard_filter
def test_fp8_moe_trains_as_with_every_guard():
    pytest.importorskip("torchao.float8")
    _assert_same_training("cpu", "aot_eager")


@pytest.mark.gpu
@needs_guard_filter
def test_gpu_fp8_moe_with_per_expert_gemms_trains_as_with_every_guard(monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU")
    pytest.importorskip("torchao.float8")
    from megatron_core.fp8 import expert_gemm_mode

    monkeypatch.setattr(expert_gemm_mode, "_mode", "per_expert")
    _assert_same_training("cuda", "inductor")
