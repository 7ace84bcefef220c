"""OptimizerParamScheduler against the closed-form schedules, and its checkpoint rules."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_core.optimizer_param_scheduler import OptimizerParamScheduler

MAX, MIN, INIT, WARM, DECAY = 1e-3, 1e-5, 1e-4, 10, 110


def _opt():
    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD([{"params": [p1], "wd_mult": 1.0}, {"params": [p2], "wd_mult": 0.0, "lr_mult": 2.0}],
                           lr=0.0)


def _sched(style, wsd_style=None, wd_style="constant", start_wd=0.1, end_wd=0.1, **kw):
    return OptimizerParamScheduler(
        _opt(), INIT, MAX, MIN, WARM, DECAY, style, start_wd, end_wd, 50, wd_style,
        wsd_decay_steps=40 if style == "WSD" else None, lr_wsd_decay_style=wsd_style, **kw)


def _ratio(step):
    return (step - WARM) / (DECAY - WARM)


def _wsd(step, shape):
    start = DECAY - 40
    if step <= start:
        return 1.0
    r = (step - start) / 40
    return {"linear": 1 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1), "exponential": 2 * 0.5**r - 1,
            "minus_sqrt": 1 - math.sqrt(r)}[shape]


CASES = [
    ("constant", None, lambda s: MAX),
    ("linear", None, lambda s: MIN + (1 - _ratio(s)) * (MAX - MIN)),
    ("cosine", None, lambda s: MIN + 0.5 * (math.cos(math.pi * _ratio(s)) + 1) * (MAX - MIN)),
    ("inverse-square-root", None, lambda s: max(MIN, MAX * math.sqrt(WARM) / math.sqrt(s))),
    *[("WSD", shape, lambda s, shape=shape: MIN + _wsd(s, shape) * (MAX - MIN))
      for shape in ("linear", "cosine", "exponential", "minus_sqrt")],
]


@pytest.mark.parametrize("style,wsd_style,formula", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_lr_matches_closed_form(style, wsd_style, formula):
    sched = _sched(style, wsd_style)
    seen = 0
    for step in (0, 3, 10, 11, 40, 75, 90, 100, 110, 111, 200):
        sched.step(step - seen)
        seen = step
        if step <= WARM:
            expected = INIT + (MAX - INIT) * step / WARM
        elif step > DECAY and style != "constant":
            expected = MIN
        else:
            expected = formula(step)
        assert sched.get_lr() == pytest.approx(expected, rel=1e-12, abs=1e-15), step
        groups = sched.optimizer.param_groups
        assert groups[0]["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert groups[1]["lr"] == pytest.approx(2 * expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("wd_style", ["linear", "cosine"])
def test_weight_decay_increment(wd_style):
    sched = _sched("constant", wd_style=wd_style, start_wd=0.0, end_wd=0.2)
    for step in (0, 10, 25, 50, 60):
        sched.num_steps = step
        r = min(step / 50, 1.0)
        coeff = r if wd_style == "linear" else 0.5 * (math.cos(math.pi * (1 - r)) + 1)
        assert sched.get_wd() == pytest.approx(0.2 * coeff, abs=1e-15)
    sched.step(0)
    assert sched.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.2)
    assert sched.optimizer.param_groups[1]["weight_decay"] == 0.0


def test_per_group_lr_bounds():
    sched = _sched("linear")
    sched.optimizer.param_groups[0].update(max_lr=2e-3, min_lr=0.0)
    sched.step(DECAY)
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(0.0)
    assert sched.optimizer.param_groups[1]["lr"] == pytest.approx(2 * MIN)


def test_state_dict_round_trip_and_legacy_keys():
    sched = _sched("cosine")
    sched.step(37)
    state = sched.state_dict()
    assert set(state) == {"max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps", "min_lr",
                          "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps"}
    fresh = _sched("cosine")
    fresh.load_state_dict(state)
    assert fresh.num_steps == 37 and fresh.get_lr() == sched.get_lr()
    legacy = {"start_lr": MAX, "min_lr": MIN, "warmup_iter": WARM, "end_iter": DECAY, "decay_style": "cosine",
              "num_iters": 37}
    old = _sched("cosine")
    old.load_state_dict(legacy)
    assert old.get_lr() == sched.get_lr()


def test_checkpoint_mismatch_rules():
    state = _sched("cosine").state_dict()
    state["max_lr"] = 5e-3
    strict = _sched("cosine", use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="learning rate"):
        strict.load_state_dict(state)
    take = _sched("cosine")
    take.load_state_dict(state)
    assert take.max_lr == 5e-3
    keep = _sched("cosine", use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    keep.load_state_dict(state)
    assert keep.max_lr == MAX


def test_invalid_arguments():
    with pytest.raises(ValueError, match=r"min_lr \(0.1\)"):
        OptimizerParamScheduler(_opt(), 0.0, 0.01, 0.1, 0, 10, "linear", 0.0, 0.0, 1, "constant")
    with pytest.raises(ValueError, match="wsd_decay_steps"):
        OptimizerParamScheduler(_opt(), 0.0, 0.01, 0.0, 0, 10, "WSD", 0.0, 0.0, 1, "constant")
    with pytest.raises(ValueError, match="lr_decay_style"):
        OptimizerParamScheduler(_opt(), 0.0, 0.01, 0.0, 0, 10, "step", 0.0, 0.0, 1, "constant")
