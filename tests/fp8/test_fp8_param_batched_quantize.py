"""The batched (compiled) tensorwise quantization of FP8 parameters' main shards against the eager one.

``quantize_param_shard(..., batched=True)`` takes all the tensorwise amaxes in one compiled call and writes
all the float8 bytes in another; ``batched=False`` is the eager path (a cast to ``fp8_hp_dtype``, a
multi-tensor norm and one quantization per parameter). Both must give the same bytes and scales, bit for bit:

* on CPU (one rank of gloo, the compiled path forced): five parameters of different shapes and
  ``fp8_hp_dtype`` (bf16, fp16, fp32), one owning no shard, one an empty one, two a flat slice at a nonzero
  offset; the main weights sit on ties and near-ties of bf16 / fp16 rounding, one rounds up to the amax and
  some cross an e4m3 tie when rounded, so skipping the rounding to ``fp8_hp_dtype`` would change both the
  bytes and a scale (checked);
* a second call with new tensors of the same shapes compiles nothing (no recompile, no new graph);
* on CUDA (``gpu``): the same, the compiled path chosen by default.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatron_core.distributed.fp8_params import make_fp8_param, quantize, quantize_param_shard
from tests.dist_harness import run_on_ranks

# (shape, fp8_hp_dtype, owned flat slice [start, end), or None: a None shard, another rank owning it all)
LAYOUT = [((8, 16), torch.bfloat16, (0, 128)),
          ((6, 20), torch.float16, (37, 120)),
          ((4, 8), torch.float32, None),
          ((10, 12), torch.bfloat16, (5, 101)),
          ((3, 5), torch.bfloat16, (4, 4))]  # an empty shard: owns nothing either


AMAX = 2.0  # the largest main value rounds up to it in bf16 and fp16: the scale is 448 / 2 once rounded
SCALE = 224.0


def _crossers(hp_dtype: torch.dtype, count: int = 8) -> torch.Tensor:
    """Values in [1, 2) whose rounding to ``hp_dtype`` moves them across an e4m3 rounding tie at ``SCALE``:
    their bytes differ if the rounding is skipped (none for fp32)."""
    candidates = 1 + torch.rand(4096, generator=torch.Generator().manual_seed(7))
    scale = torch.tensor(SCALE)
    direct = quantize(candidates, scale, torch.float8_e4m3fn).view(torch.uint8)
    rounded = quantize(candidates.to(hp_dtype), scale, torch.float8_e4m3fn).view(torch.uint8)
    return candidates[direct != rounded][:count]


def _edges(hp_dtype: torch.dtype) -> torch.Tensor:
    """The value that rounds up to ``AMAX`` (exactly the amax once rounded), the rounding ties between
    neighbours of ``hp_dtype`` in [1, 2) and one fp32 step either side of them (``-`` too), and
    :func:`_crossers`."""
    bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[hp_dtype]  # significant bits
    ties = 1 + (torch.arange(1, 9, dtype=torch.float32) * 2 + 1) * 2.0 ** -bits
    ulp = 2.0 ** -23
    amax = torch.tensor([AMAX - 2.0 ** -12])
    return torch.cat([amax, ties, ties + ulp, -(ties - ulp), _crossers(hp_dtype)])


def _main_values(numel: int, hp_dtype: torch.dtype, seed: int, at: int = 0) -> torch.Tensor:
    """A full fp32 main weight: small random values, the rounding edges of ``hp_dtype`` from index ``at``."""
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 0.3
    edges = _edges(hp_dtype)[:numel - at]
    values[at:at + edges.numel()] = edges
    return values


def _case(device: str) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[int]]:
    """The FP8 parameters (from fixed initial values) and their owned main shards and start offsets."""
    params, mains, starts = [], [], []
    for k, (shape, hp_dtype, owned) in enumerate(LAYOUT):
        init = torch.randn(shape, generator=torch.Generator().manual_seed(100 + k)).to(hp_dtype)
        params.append(make_fp8_param(torch.nn.Parameter(init.to(device))))
        values = _main_values(init.numel(), hp_dtype, seed=k, at=0 if owned is None else owned[0]).to(device)
        mains.append(None if owned is None else values[owned[0]:owned[1]].clone())
        starts.append(0 if owned is None else owned[0])
    return params, mains, starts


def _state(params: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each parameter's float8 bytes (as uint8) and ``fp8_scale``, on the CPU."""
    return [(p.detach().view(torch.uint8).cpu().clone(), p.fp8_scale.cpu().clone()) for p in params]


def _graphs() -> int:
    """The graphs Dynamo compiled so far in this process."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _eager_and_batched(device: str, group: Any, batched: bool | None) -> dict:
    """The eager and the batched results on the same case; the graphs the batched call compiled, and those a
    second batched call on new tensors of the same shapes compiled."""
    torch._dynamo.reset()  # count this case's compiles alone (the pool's worker may have compiled others)
    eager = _case(device)
    quantize_param_shard(*eager, group, batched=False)
    batched_case = _case(device)
    before = _graphs()
    quantize_param_shard(*batched_case, group, batched=batched)
    first = _graphs() - before
    again = _case(device)
    with torch._dynamo.config.patch(error_on_recompile=True):
        quantize_param_shard(*again, group, batched=batched)
    return dict(eager=_state(eager[0]), batched=_state(batched_case[0]), again=_state(again[0]),
                first_graphs=first, second_graphs=_graphs() - before - first)


def _on_one_rank() -> dict:
    return _eager_and_batched("cpu", torch.distributed.group.WORLD, batched=True)


@pytest.fixture(scope="module")
def cpu_run() -> dict:
    return run_on_ranks(1, _on_one_rank, timeout=240)[0]


def _assert_same(got: list, want: list) -> None:
    for k, ((got_bytes, got_scale), (want_bytes, want_scale)) in enumerate(zip(got, want)):
        differ = int((got_bytes != want_bytes).sum())
        assert differ == 0, f"parameter {k}: {differ} bytes differ"
        assert torch.equal(got_scale, want_scale), f"parameter {k}: scale {got_scale} != {want_scale}"


def test_batched_tensorwise_quantization_equals_eager_on_cpu(cpu_run):
    _assert_same(cpu_run["batched"], cpu_run["eager"])
    _assert_same(cpu_run["again"], cpu_run["eager"])


def test_batched_quantization_compiles_once_for_fixed_shapes(cpu_run):
    assert cpu_run["first_graphs"] == 2  # the amaxes and the quantization
    assert cpu_run["second_graphs"] == 0


def test_main_values_exercise_the_rounding_to_hp_dtype():
    """Without the rounding to ``fp8_hp_dtype`` the bf16 and fp16 parameters' scales and bytes would differ,
    so the equality above checks that the batched path keeps it."""
    for hp_dtype in (torch.bfloat16, torch.float16):
        values = _main_values(96, hp_dtype, seed=0)
        rounded = values.to(hp_dtype)
        assert rounded.abs().amax().float() == AMAX and values.abs().amax() < AMAX
        assert _crossers(hp_dtype).numel() == 8
        scale = torch.tensor(SCALE)
        assert not torch.equal(quantize(values, scale, torch.float8_e4m3fn).view(torch.uint8),
                               quantize(rounded, scale, torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.gpu
def test_batched_tensorwise_quantization_equals_eager_on_cuda():
    run = _eager_and_batched("cuda", None, batched=None)  # the default on an accelerator: compiled
    assert run["first_graphs"] == 2 and run["second_graphs"] == 0
    _assert_same(run["batched"], run["eager"])
    _assert_same(run["again"], run["eager"])
