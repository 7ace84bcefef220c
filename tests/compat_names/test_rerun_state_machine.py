"""The rerun state machine on CPU: injected transient, persistent and correct-result faults through its
public API, NaN detection, the checkpoint round trip, determinism stats and a 2-rank re-run."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch

from megatron_core import rerun_state_machine as rsm
from megatron_core.rerun_state_machine import (
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    destroy_rerun_state_machine,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
)
from tests.dist_harness import run_on_ranks


@pytest.fixture(autouse=True)
def _fresh_machine(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    destroy_rerun_state_machine()
    yield
    destroy_rerun_state_machine()


class _Trainer:
    """A toy training loop: each step reads one micro-batch and 'computes' its loss.

    ``fault`` maps (step, attempt) to an override of the computed loss, so a fault can be made to
    happen on the first run only (transient) or on every run (persistent).
    """

    def __init__(self, machine, fault=None, steps=4):
        self.machine = machine
        self.fault = fault or {}
        self.data = RerunDataIterator(iter([torch.tensor(float(i + 1)) for i in range(100)]))
        self.steps = steps
        self.log = []

    def run_step(self, step):
        attempt = 0
        seen = []
        while self.machine.should_run_forward_backward(self.data):
            batch = next(self.data)
            noise = torch.rand(())  # RNG is restored for a re-run
            loss = batch * 2 + 0 * noise
            loss = self.fault.get((step, attempt), loss)
            seen.append((float(batch), float(noise), float(loss)))
            self.machine.validate_result(loss, torch.isnan, "loss is NaN", fatal=True)
            attempt += 1
        verdict = self.machine.should_checkpoint_and_exit()
        self.log.append((step, seen, verdict))
        return verdict


def _validating_machine(**kwargs):
    initialize_rerun_state_machine(mode=RerunMode.VALIDATE_RESULTS, **kwargs)
    return get_rerun_state_machine()


def test_disabled_mode_raises_on_rejected_result():
    machine = get_rerun_state_machine()  # implicit, disabled
    assert machine.get_mode() == RerunMode.DISABLED
    assert machine.should_run_forward_backward(None)
    machine.validate_result(torch.tensor(1.0), torch.isnan, "loss is NaN")
    with pytest.raises(RuntimeError, match="loss is NaN"):
        machine.validate_result(torch.tensor(math.nan), torch.isnan, "loss is NaN")
    machine.validate_result(torch.tensor(math.nan), torch.isnan, "loss is NaN", fatal=False)
    assert not machine.should_run_forward_backward(None)
    assert machine.should_checkpoint_and_exit() == (False, False, 0)


def test_healthy_steps_run_once():
    trainer = _Trainer(_validating_machine())
    for step in range(3):
        assert trainer.run_step(step) == (False, False, 0)
    assert [len(seen) for _, seen, _ in trainer.log] == [1, 1, 1]
    assert [seen[0][0] for _, seen, _ in trainer.log] == [1.0, 2.0, 3.0]  # each step reads new data


def test_transient_nan_is_rerun_in_place_and_attributed_transient(tmp_path):
    tracker = tmp_path / "rejected.txt"
    machine = _validating_machine(result_rejected_tracker_filename=str(tracker))
    trainer = _Trainer(machine, fault={(1, 0): torch.tensor(math.nan)})
    assert trainer.run_step(0) == (False, False, 0)
    verdict = trainer.run_step(1)
    _, seen, _ = trainer.log[1]
    assert len(seen) == 2
    assert seen[0][:2] == seen[1][:2]  # same micro-batch and same RNG draw on the re-run
    assert math.isnan(seen[0][2]) and seen[1][2] == 4.0
    assert verdict == (False, True, rsm.EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    text = tracker.read_text()
    assert "status=RerunValidationStatus.INITIAL_RUN" in text
    assert "FIRST_RERUN_NOT_REPRODUCIBLE" in text


def test_first_step_is_not_validated():
    trainer = _Trainer(_validating_machine(), fault={(0, 0): torch.tensor(math.nan)})
    assert trainer.run_step(0) == (False, False, 0)
    assert len(trainer.log[0][1]) == 1


def test_non_fatal_transient_continues_training():
    machine = _validating_machine()
    data = RerunDataIterator(iter([torch.tensor(1.0)] * 10))
    for step in range(2):
        runs = 0
        while machine.should_run_forward_backward(data):
            loss = next(data)
            if (step, runs) == (1, 0):
                loss = torch.tensor(math.inf)
            machine.validate_result(loss, torch.isinf, "loss is inf", fatal=False)
            runs += 1
        assert machine.should_checkpoint_and_exit() == (False, False, 0)
    assert runs == 2 and machine.state == RerunState.NOT_RUNNING_YET


def _run_with_injector(kind):
    injector = RerunErrorInjector(error_injection_rate=1, error_injection_type=kind)
    injector.should_inject_errors = False
    machine = _validating_machine(error_injector=injector)
    trainer = _Trainer(machine)
    trainer.run_step(0)
    injector.should_inject_errors = True
    verdict = trainer.run_step(1)
    injector.should_inject_errors = False
    return machine, trainer, verdict


def test_injected_transient_error():
    machine, trainer, verdict = _run_with_injector(RerunDiagnostic.TRANSIENT_ERROR)
    assert len(trainer.log[1][1]) == 2
    assert verdict == (False, True, rsm.EXIT_CODE_FAILED_ON_RESULT_VALIDATION)


def _resume_elsewhere(machine, data_iterator):
    """Checkpoint the machine, start a 'new job' on other hardware, and load it there."""
    saved = machine.state_dict(data_iterator, "torch_dist")
    assert machine.validate_state_dict(saved)
    assert saved["sharded"].key == "rerun_state_machine_state"
    destroy_rerun_state_machine()
    resumed = _validating_machine(error_injector=RerunErrorInjector(1, RerunDiagnostic.TRANSIENT_ERROR))
    resumed.error_injector.should_inject_errors = False
    resumed.load_state_dict(saved)
    return resumed


@pytest.mark.parametrize("kind, expect_exit", [
    (RerunDiagnostic.PERSISTENT_ERROR, rsm.EXIT_CODE_FAILED_ON_RESULT_VALIDATION),
    (RerunDiagnostic.CORRECT_RESULT, rsm.EXIT_CODE_FAILED_ON_RESULT_VALIDATION),
])
def test_reproducible_fault_checkpoints_and_reruns_elsewhere(kind, expect_exit, caplog):
    machine, trainer, verdict = _run_with_injector(kind)
    assert len(trainer.log[1][1]) == 2  # initial run + in-place re-run: reproduced
    assert verdict == (True, True, rsm.EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    assert machine.state == RerunState.WILL_RERUN_FROM_CHECKPOINT
    resumed = _resume_elsewhere(machine, trainer.data)
    assert resumed.error_injector.injected_error_type == kind
    resumed.suspicious_node = "another-node"  # the resumed job runs on other hardware
    trainer.machine = resumed
    with caplog.at_level(logging.WARNING, logger="megatron_core.rerun_state_machine"):
        verdict = trainer.run_step(1)
    assert len(trainer.log[-1][1]) == 1
    assert verdict == (False, True, expect_exit)
    wanted = "possible persistent error" if kind == RerunDiagnostic.PERSISTENT_ERROR else "correct result"
    assert wanted in caplog.text


def test_resumed_on_same_hardware_asks_to_resume_again():
    machine, trainer, _ = _run_with_injector(RerunDiagnostic.PERSISTENT_ERROR)
    resumed = _resume_elsewhere(machine, trainer.data)
    trainer.machine = resumed
    assert trainer.run_step(1) == (False, True, rsm.EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    assert resumed.state == RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT


def test_state_dict_is_plain_data_and_disabled_machine_saves_nothing(tmp_path):
    machine, trainer, _ = _run_with_injector(RerunDiagnostic.PERSISTENT_ERROR)
    saved = machine.state_dict(trainer.data, "torch_dist")
    path = tmp_path / "sd.pt"
    torch.save({k: v for k, v in saved.items() if k != "sharded"} | {"sharded": saved["sharded"].data}, path)
    reloaded = torch.load(path, weights_only=True)
    assert reloaded["mode"] == "validate_results" and reloaded["state"] == RerunState.WILL_RERUN_FROM_CHECKPOINT.value
    assert machine.state_dict(trainer.data, "torch") is None
    destroy_rerun_state_machine()
    assert get_rerun_state_machine().state_dict(None, "torch_dist") is None
    assert not get_rerun_state_machine().validate_state_dict(None)


def test_report_determinism_stats_reruns_every_step(caplog):
    initialize_rerun_state_machine(mode=RerunMode.REPORT_DETERMINISM_STATS)
    machine = get_rerun_state_machine()
    data = RerunDataIterator(iter([torch.tensor(1.0)] * 10))
    values = iter([1.0, 1.0, 1.0, 1.001])
    with caplog.at_level(logging.INFO, logger="megatron_core.rerun_state_machine"):
        for _ in range(2):
            runs = 0
            while machine.should_run_forward_backward(data):
                next(data)
                machine.validate_result(torch.tensor(next(values)), torch.isnan, "loss")
                runs += 1
            assert runs == 2 and machine.should_checkpoint_and_exit() == (False, False, 0)
    stats = machine.stats[rsm.Caller("loss", 0)]
    assert stats.zero_cnt == 1 and len(stats.samples) == 1
    assert stats.samples[0] == pytest.approx(0.001 / 1.0005, rel=1e-3)
    assert "Stats on computation determinism" in caplog.text


def test_is_unexpectedly_large():
    machine = _validating_machine()
    for v in (1.0, 2.0, 1.5):
        assert not machine.is_unexpectedly_large(torch.tensor(v), threshold=10, context="loss", num_samples=3)
    assert not machine.is_unexpectedly_large(torch.tensor(19.0), 10, "loss", num_samples=3)
    assert machine.is_unexpectedly_large(torch.tensor(25.0), 10, "loss", num_samples=3)
    assert not machine.is_unexpectedly_large(torch.tensor(math.nan), 10, "loss", num_samples=3)


def test_data_iterator_replays_and_checks():
    initialize_rerun_state_machine(mode=RerunMode.VALIDATE_RESULTS)
    it = RerunDataIterator(iter(range(10)))
    assert [next(it), next(it)] == [0, 1]
    it.rewind()
    assert [next(it), next(it)] == [0, 1]
    with pytest.raises(RuntimeError, match="more micro-batches"):
        next(it)
    it.advance()
    assert next(it) == 2
    with pytest.raises(TypeError, match="RerunDataIterator"):
        get_rerun_state_machine().should_run_forward_backward(iter(range(3)))


def test_error_injector_validates_its_arguments():
    with pytest.raises(ValueError, match="RerunDiagnostic"):
        RerunErrorInjector(1, "transient")
    injector = RerunErrorInjector(5, RerunDiagnostic.PERSISTENT_ERROR)
    injector.load_state_dict(injector.state_dict())
    assert injector.error_injection_type == RerunDiagnostic.PERSISTENT_ERROR


def test_skipped_iterations_from_tracker_file(tmp_path):
    tracker = tmp_path / "t.txt"
    lines = [
        ("j1", 0, 5, "RERUN_DISABLED"), ("j2", 0, 5, "RERUN_DISABLED"),  # same rank twice: skip 5
        ("j1", 0, 7, "RERUN_DISABLED"), ("j1", 1, 7, "RERUN_DISABLED"),  # two ranks in one job: keep 7
        ("j1", 0, 7, "RERUN_DISABLED"),
        ("j1", 2, 9, "FIRST_RERUN_NOT_REPRODUCIBLE"), ("j2", 2, 9, "FIRST_RERUN_NOT_REPRODUCIBLE"),
    ]
    tracker.write_text("".join(
        f"ts=now node=n device=cpu jobID={j} rank={r} iteration={i} status=RerunValidationStatus.{s} "
        f"result=nan message='m'\n" for j, r, i, s in lines))
    assert rsm.RerunStateMachine.get_skipped_iterations_from_tracker_file(str(tracker)) == [5]


def _two_rank_rerun():
    warnings.simplefilter("ignore")
    destroy_rerun_state_machine()
    initialize_rerun_state_machine(mode=RerunMode.VALIDATE_RESULTS)
    machine = get_rerun_state_machine()
    machine.first_iteration_complete = True
    rank = torch.distributed.get_rank()
    data = RerunDataIterator(iter([torch.tensor(float(rank))] * 4))
    runs = 0
    while machine.should_run_forward_backward(data):
        x = next(data)
        loss = torch.tensor(math.nan) if (rank == 1 and runs == 0) else x
        machine.validate_result(loss, torch.isnan, "loss is NaN")
        runs += 1
    verdict = machine.should_checkpoint_and_exit()
    destroy_rerun_state_machine()
    return runs, verdict


def test_a_rejection_on_one_rank_reruns_every_rank():
    results = run_on_ranks(2, _two_rank_rerun)
    assert results == [(2, (False, True, rsm.EXIT_CODE_FAILED_ON_RESULT_VALIDATION))] * 2
