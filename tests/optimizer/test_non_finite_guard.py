"""Non-finite guard: a NaN/Inf in one gradient on one rank skips the step on every rank (fp32 and bf16).

Two CPU ranks (DP=2, gloo) train ``TiedNetTP`` (tests/distributed/tiny_models.py) with no grad
scaler. Rank 1 writes a NaN or an Inf into one local gradient after backward, before the DP
reduction. Every rank's ``optimizer.step()`` must return ``(False, non-finite norm, None)`` and leave
the SHA-256 of all parameters (model and fp32 main params) and of the optimizer state as it was;
the next clean step must succeed and change the weights. Skipped steps are no-ops: the final
weights equal those of a run that only took the clean steps.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from megatron_core import parallel_state
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.optimizer import (
    ChainedOptimizer,
    DistributedOptimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from tests.dist_harness import run_on_ranks
from tests.distributed import tiny_models as tm

WORLD = 2
BAD_RANK = 1
# "chained": l1 tagged as an expert param, so get_megatron_optimizer returns a ChainedOptimizer of two.
LAYOUTS = {"ddp": (False, False), "distopt": (True, False), "chained": (False, True),
           "chained_distopt": (True, True)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _build(layout: str, dtype: torch.dtype, clip_grad: float) -> tuple[Any, Any, Any]:
    use_distopt, expert = LAYOUTS[layout]
    model = tm.TiedNetTP(tm.make_reference()).to(dtype)
    if expert:
        for param in model.l1.parameters():
            param.allreduce = False
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=dtype != torch.float32,
                                               use_distributed_optimizer=use_distopt)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    config = OptimizerConfig(lr=tm.LR, weight_decay=tm.WD, clip_grad=clip_grad, bf16=dtype == torch.bfloat16,
                             use_distributed_optimizer=use_distopt)
    opt = get_megatron_optimizer(config, [ddp])
    assert isinstance(opt, ChainedOptimizer) == expert
    subs = opt.chained_optimizers if expert else [opt]
    assert all(isinstance(s, DistributedOptimizer) == use_distopt for s in subs)
    assert all(getattr(s, "grad_scaler", None) is None for s in subs)
    return model, ddp, opt


def _backward(model, ddp, x, y, dtype: torch.dtype, poison: tuple[str, float] | None = None) -> None:
    """Gradients of this rank's share of the batch; ``poison`` = (param name, value) written on BAD_RANK."""
    ddp.zero_grad_buffer()
    mbs = tm.microbatches(x, y, parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size())
    for i, (xm, ym) in enumerate(mbs):
        loss = F.mse_loss(ddp(xm.unsqueeze(0).to(dtype)).float(), ym.unsqueeze(0)) / len(mbs)
        if i < len(mbs) - 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
    if poison is not None and torch.distributed.get_rank() == BAD_RANK:
        name, value = poison
        dict(model.named_parameters())[name].main_grad.view(-1)[3] = value  # one element, one rank
    finalize_model_grads([ddp])


def _feed(digest: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{t.dtype}{tuple(obj.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for key in sorted(obj, key=repr):
            digest.update(repr(key).encode())
            _feed(digest, obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _feed(digest, item)
    else:
        digest.update(repr(obj).encode())


def _sha256(obj: Any) -> str:
    digest = hashlib.sha256()
    _feed(digest, obj)
    return digest.hexdigest()


def _hashes(model, opt) -> tuple[str, str]:
    params = {name: p for name, p in model.named_parameters()}
    return _sha256([params, opt.get_parameters()]), _sha256(opt.state_dict())


def _guard(layout: str, dtype_name: str, clip_grad: float) -> dict[str, Any]:
    parallel_state.initialize_model_parallel()
    dtype = DTYPES[dtype_name]
    model, ddp, opt = _build(layout, dtype, clip_grad)
    data = tm.make_data(3)

    def step(x, y, poison=None):
        opt.zero_grad()
        _backward(model, ddp, x, y, dtype, poison)
        return opt.step()

    assert step(*data[0])[0]  # a clean step first, so the optimizer has state to protect
    skipped = []
    for name in ("l1.weight", "l2.bias"):
        for value in (float("nan"), float("inf")):
            before = _hashes(model, opt)
            ok, norm, zeros = step(*data[1], poison=(name, value))
            after = _hashes(model, opt)
            skipped.append({"what": f"{value} in {name}", "ok": ok, "norm": norm, "zeros": zeros,
                            "params_same": before[0] == after[0], "state_same": before[1] == after[1]})
    before = _hashes(model, opt)
    ok, norm, _ = step(*data[1])
    clean = {"ok": ok, "norm": norm, "params_changed": _hashes(model, opt)[0] != before[0]}

    # The same two clean steps on a fresh model: the skipped steps must have left no trace.
    ref_model, ref_ddp, ref_opt = _build(layout, dtype, clip_grad)
    for x, y in data[:2]:
        ref_opt.zero_grad()
        _backward(ref_model, ref_ddp, x, y, dtype)
        assert ref_opt.step()[0]
    clean["matches_clean_run"] = _hashes(model, opt) == _hashes(ref_model, ref_opt)
    return {"skipped": skipped, "clean": clean}


@pytest.mark.parametrize("clip_grad", [tm.CLIP, 0.0], ids=["clip", "noclip"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_non_finite_gradient_on_one_rank_skips_the_step_everywhere(layout: str, dtype_name: str,
                                                                   clip_grad: float) -> None:
    for rank, result in enumerate(run_on_ranks(WORLD, _guard, layout, dtype_name, clip_grad)):
        for entry in result["skipped"]:
            where = f"rank {rank}, {entry['what']}"
            assert entry["ok"] is False, where
            assert entry["norm"] is not None and not math.isfinite(entry["norm"]), f"{where}: norm {entry['norm']}"
            assert math.isnan(entry["norm"]) == entry["what"].startswith("nan"), f"{where}: norm {entry['norm']}"
            assert entry["zeros"] is None, where
            assert entry["params_same"], f"{where}: parameters changed"
            assert entry["state_same"], f"{where}: optimizer state changed"
        clean = result["clean"]
        assert clean["ok"] and math.isfinite(clean["norm"]) and clean["norm"] > 0, (rank, clean)
        assert clean["params_changed"], f"rank {rank}: the clean step after the skips did not train"
        assert clean["matches_clean_run"], f"rank {rank}: skipped steps left a trace in weights or state"
