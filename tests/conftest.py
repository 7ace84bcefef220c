"""Shared pytest set-up: GPU marker handling, cleanup of the distributed rank pools, and a
suite-wide check that no test leaves a child process behind."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.dist_harness import close_all_pools, recycle_bloated_pools, set_debug_off_for_current_test
from tests.process_tree import descendants, parent_pid

# Helpers Python and torch keep alive until the interpreter exits (torch.compile's pool of Inductor compile
# workers among them); not left behind by a test.
_INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver",
                        "torch/_inductor/compile_worker")


# Tests over ~12 s in `pytest --durations` (`.ci/run` on 2 cores with a cold Inductor cache, 2026-12-04; a few
# were over 15 s on a busier machine before), marked `slow` here (whole modules that are slow carry
# `pytestmark = pytest.mark.slow` instead); the edit-test loop (`-m "not slow and not gpu"`, README) skips them,
# CI runs them. The seconds also order the files for xdist (`_longest_files_first`).
SLOW_TESTS = {
    "tests/examples/test_pretrain_gpt_resume.py::test_killed_run_resumes_with_identical_losses[tp2_pp2]": 62,
    "tests/tools/test_scaling_dry_run.py::test_scaling_dry_run_tp2_sp_and_loaded_baseline_on_cpu": 51,
    "tests/examples/test_pretrain_gpt_resume.py::test_killed_run_resumes_with_identical_losses[dp2_tp2]": 48,
    "tests/inference/test_greedy_moe_hf.py::test_mixtral_padded_decode_layout_matches_hf[compiled]": 41,
    "tests/distributed/test_overwrite_main_grad.py::test_overwrite_in_compiled_layers_matches_zeroed_buffers": 37,
    "tests/examples/test_pretrain_gpt_flags.py::test_moe_use_upcycling_starts_a_moe_run_from_a_dense_checkpoint": 36,
    "tests/inference/test_parallel_inference.py::test_tp2_compiled_decode_layout_matches_hf": 34,
    "tests/tools/test_scaling_dry_run.py::test_parity_dry_run_interleaved_pp2_on_cpu": 32,
    "tests/inference/test_greedy_hf.py::test_compiled_padded_decode_matches_hf": 30,
    "tests/optimizer/test_flat_adam.py::test_flat_kernel_matches_reference_and_skips_on_non_finite_norm[compiled]": 25,
    "tests/models/hf/test_pretrain_hybrid.py::test_tensor_parallel_training_equals_one_process": 23,
    "tests/reliability/test_multirank_crash_save.py::test_rank_killed_mid_save_resumes_from_previous_checkpoint_bit_exactly": 23,
    "tests/dist_checkpointing/test_mcore_interop.py::test_megatron_core_loads_our_checkpoints": 22,
    "tests/dist_checkpointing/test_training_state.py::test_bit_exact_resume[dp2_tp2_distopt]": 22,
    "tests/fp8/test_fp8_param_compile.py::test_compiled_fp8_param_gpt_matches_eager_under_ddp": 21,
    "tests/reliability/test_checkpoint_manifest.py::test_corrupt_shard_of_another_rank_fails_the_load_on_every_rank": 21,
    "tests/reliability/test_inf_loss.py::test_inf_loss_on_one_rank_skips_the_step_everywhere[dp2]": 19,
    "tests/examples/test_pretrain_gpt_fsdp2.py::test_fsdp2_trains_like_ddp_and_its_checkpoint_resumes_under_ddp": 18,
    "tests/optimizer/test_precision_aware_optimizer.py::test_bf16_moments_match_fp32_loss_curve_and_halve_state_bytes": 18,
    "tests/inference/server_adversarial/test_cli_server.py::test_top_k_above_the_vocabulary_is_a_400_not_a_hang[completion-hi]": 17,
    "tests/reliability/test_checkpoint_architecture.py::test_architecture_mismatch_names_field_and_both_values": 17,
    "tests/examples/test_pretrain_gpt_flags.py::test_deepseek_tiny_preset_trains_saves_and_resumes": 16,
    "tests/inference/test_cli.py::test_generate_from_hybrid_checkpoint_matches_naive_decoding": 16,
    "tests/inference/test_hybrid_engine_triton_interpreter.py::test_hybrid_engine_through_the_kernels_in_the_interpreter": 23,
    "tests/ssm/test_mamba_inference_triton_interpreter.py::test_fused_decode_step_under_torch_compile_in_the_interpreter": 18,
    "tests/models/test_gpt_model_api.py::test_compiled_model_computes_rope_angles_in_graph_and_matches_eager[True]": 15,
    "tests/fp8/test_fp8_swiglu_grad_cast.py::test_interpreted_kernels_give_the_amax_and_both_layouts": 13,
    "tests/ssm/test_ssd_triton_interpreter.py::test_triton_scan_in_the_interpreter_matches_reference": 12,
    "tests/dist_checkpointing/test_training_state.py::test_bit_exact_resume[tp2_pp2]": 15,
    "tests/examples/test_pretrain_gpt_flags.py::test_step_time_breakdown_reports_every_part_and_leaves_the_losses_alone": 15,
    "tests/parallel_state/test_parallel_state.py::test_invalid_sizes_name_the_numbers": 15,
    "tests/examples/test_pretrain_gpt_flags.py::test_fixed_validation_set_repeats_the_same_batches": 14,
    "tests/reliability/test_config_validation.py::test_checks_hold_under_python_O": 14,
    "tests/reliability/test_mistyped_load.py::test_load_if_present_and_the_resumable_job_pattern": 14,
    "tests/models/hybrid/test_hybrid_bf16_training.py::test_bf16_training_ends_within_the_fp32_run_to_run_spread": 14,
    "tests/post_training/test_distill.py::test_distillation_at_tp2_equals_one_process[fp32]": 13,
    "tests/post_training/test_ptq_moe_parallel.py::test_ep2_quantized_moe_equals_one_process": 13,
    "tests/post_training/test_ptq_moe_parallel.py::test_moe_checkpoint_saved_at_ep2_loads_at_ep1": 12,
    "tests/parallel_state/test_parallel_state.py::test_group_membership_matches_independent_oracle": 12,
    "tests/reliability/test_desync_diagnosis.py::test_shape_mismatch_raises_runtime_error_naming_op_and_shapes": 11,
}
# What a test takes when SLOW_TESTS does not say: a module marked slow starts training runs in subprocesses; the
# other tests take about 0.1 s on average (the suite's time outside its 250 slowest tests over their number).
_SECONDS_OF_A_SLOW_TEST, _SECONDS_OF_A_TEST = 8.0, 0.1


def _expected_seconds(item: pytest.Item) -> float:
    if item.nodeid in SLOW_TESTS:
        return SLOW_TESTS[item.nodeid]
    if item.get_closest_marker("skip"):
        return 0.0
    return _SECONDS_OF_A_SLOW_TEST if item.get_closest_marker("slow") else _SECONDS_OF_A_TEST


def _longest_files_first(items: list[pytest.Item]) -> None:
    """Order the files by their expected seconds, longest first, keeping each file's own order: `-n 2 --dist
    loadfile` hands files out in this order, so the long files do not start last and leave one worker alone at the
    end (xdist's own reorder, by number of tests, put the few-test training files last)."""
    seconds: dict[str, float] = {}
    for item in items:
        seconds[item.location[0]] = seconds.get(item.location[0], 0.0) + _expected_seconds(item)
    items.sort(key=lambda item: -seconds[item.location[0]])


def pytest_configure(config: pytest.Config) -> None:
    # Keep the order `_longest_files_first` gives (xdist's `--loadscope-reorder` is on by default).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _share_cores_between_xdist_workers() -> None:
    """Give each pytest-xdist worker its share of the CPU cores for torch's intra-op threads: by default every
    worker starts one thread per core, so two workers on two cores run four busy threads that wait for each
    other (about 9% of the suite's time on a 2-core machine). Processes the tests start inherit the setting."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_cores_between_xdist_workers()

# Every `examples/pretrain_gpt.py` the tests start (and its torchrun ranks) ends without the interpreter's teardown
# once it has returned (exit handlers still run): about 1-1.5 s of CPU per process saved.
os.environ.setdefault("PRETRAIN_GPT_FAST_EXIT", "1")

# Inductor's cache keys leave ATEN_CPU_CAPABILITY out (torch 2.13): kernels compiled under one CPU capability are
# reused under another, where they fail to build or compute NaNs. A run under a forced capability gets a cache of
# its own (set before any rank pool starts, so the ranks inherit it).
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{os.getuid()}_{os.environ['ATEN_CPU_CAPABILITY'].lower()}")

# Tests whose results hang on the exact rounding of CPU kernels (optimizer numerics, the golden curve, run-to-run
# determinism, parallel-layout parity against one process): `.ci/run` runs them a second time under another
# ATEN_CPU_CAPABILITY than the machine's own, so that a tolerance that holds on one kernel set only fails at once.
CPU_NUMERICS_PATHS = (
    # the optimizer tests that step or clip real tensors (not the schedules', configs' and names' arithmetic)
    "tests/optimizer/test_flat_adam.py",
    "tests/optimizer/test_precision_aware_optimizer.py",
    "tests/optimizer/test_optimizers_distributed.py",
    "tests/optimizer/test_layer_wise_optimizer.py",
    "tests/optimizer/test_mup.py",
    "tests/optimizer/test_qk_clip.py",
    "tests/optimizer/test_non_finite_guard.py",
    "tests/optimizer/test_grad_norm_coalescing.py",
    "tests/optimizer/test_grad_norm_skip_threshold.py",
    "tests/optimizer/test_fused_clipping.py",
    "tests/optimizer/test_clip_grads_parallel.py",
    "tests/optimizer/test_distrib_optimizer_grad_stats.py",
    "tests/reliability/test_golden_loss_curve.py",
    "tests/reliability/test_determinism.py",
    "tests/pipeline_parallel/test_gpt_pipeline.py",
    "tests/distributed/test_data_parallel.py",
    "tests/tensor_parallel/test_layers.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
        if item.nodeid.startswith(CPU_NUMERICS_PATHS):
            item.add_marker(pytest.mark.cpu_numerics)
    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    _longest_files_first(items)


def _left_behind() -> dict[int, str]:
    out = {}
    for pid in descendants(os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if not cmdline.strip():  # a zombie: exited, only not yet reaped
            continue
        # The fork server is the interpreter's own child; the processes it forked (the rank pools' workers) carry
        # its command line but are its children, and count.
        forked = "multiprocessing.forkserver" in cmdline and parent_pid(pid) != os.getpid()
        if forked or not any(helper in cmdline for helper in _INTERPRETER_HELPERS):
            out[pid] = cmdline.strip()[:200]
    return out


@pytest.fixture(autouse=True)
def _recycle_bloated_rank_pools(request):
    """Before each test, pick its pools' debug mode (``distributed_debug_off``); after it, replace rank pools
    whose workers accumulated too many threads (see the harness)."""
    set_debug_off_for_current_test(request.node.get_closest_marker("distributed_debug_off") is not None)
    yield
    recycle_bloated_pools()


def pytest_sessionfinish(session, exitstatus):
    close_all_pools()
    # How long processes get to exit before they count as left behind (the suite-hygiene test's inner session,
    # whose child never exits, sets it short).
    deadline = time.monotonic() + float(os.environ.get("MCORE_TEST_LEFT_BEHIND_GRACE_S", "15"))
    left = _left_behind()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _left_behind()
    if left:
        lines = "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in sorted(left.items()))
        print(f"\nERROR: processes left behind by the test session:\n{lines}", flush=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
