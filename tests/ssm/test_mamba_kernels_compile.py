"""The hybrid inference kernels compile for a Hopper GPU (sm_90) on a machine without one.

Triton's interpreter (the CPU checks of these kernels) runs the kernels' Python, not their compilation: a layout,
type or barrier that the GPU backend refuses would only show on a GPU. Here each kernel is compiled ahead of time
down to a cubin for ``GPUTarget("cuda", 90, 32)``: the fused decode step's two kernels (bf16 and fp32 activations,
``D`` per head and per channel), the scan's state walk with and without the initial / final state, and the gated
group RMSNorm; and every kernel of the training scan's forward and backward as its launcher issues them (block
shapes, warps, stages and argument specialisation from ``SCAN_BLOCKS``), through ``benchmarks/triton_resources.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.triton_interpreter import needs_triton

_HOPPER = ("cuda", 90, 32)


def _compile(kernel, pointers: dict[str, str], constexprs: dict) -> dict:
    """Compile ``kernel`` with the given pointer types (other runtime arguments i32); its assembly by stage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in kernel.arg_names:
        signature[name] = "constexpr" if name in constexprs else pointers.get(name, "i32")
    return triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget(*_HOPPER)).asm


@needs_triton
@pytest.mark.parametrize("act", ["bf16", "fp32"])
def test_fused_decode_kernels_compile_for_hopper(monkeypatch: pytest.MonkeyPatch, act: str) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from megatron_core.ssm.mamba_decode_triton import _kernels

    conv_kernel, ssm_kernel = _kernels()
    asm = _compile(conv_kernel, {"xbc_ptr": f"*{act}", "slot_ptr": "*i64", "state_ptr": f"*{act}", "w_ptr": "*fp32",
                                 "bias_ptr": "*fp32", "out_ptr": f"*{act}"}, {"K": 4, "KP": 4, "BC": 128})
    assert asm["cubin"]
    for per_channel in (True, False):
        asm = _compile(ssm_kernel, {"xbc_ptr": f"*{act}", "dt_ptr": f"*{act}", "slot_ptr": "*i64",
                                    "state_ptr": f"*{act}", "dt_bias_ptr": "*fp32", "A_log_ptr": "*fp32",
                                    "D_ptr": "*fp32", "y_ptr": f"*{act}"},
                       {"BP": 16, "BN": 128, "D_HAS_P": per_channel})
        assert asm["cubin"]


@needs_triton
@pytest.mark.parametrize("with_state", [True, False], ids=["prefill", "training"])
def test_scan_state_walk_compiles_for_hopper(monkeypatch: pytest.MonkeyPatch, with_state: bool) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from megatron_core.ssm.ssd_scan_triton_forward import forward_kernels

    pointers = {"x_ptr": "*bf16", "dt_ptr": "*fp32", "A_ptr": "*fp32", "B_ptr": "*bf16", "st_ptr": "*fp32",
                "init_ptr": "*bf16", "final_ptr": "*fp32"}
    asm = _compile(forward_kernels()[0], pointers, {"Q": 64, "BP": 32, "BN": 64, "PREC": "tf32",
                                                    "HAS_INIT": with_state, "HAS_FINAL": with_state})
    assert asm["cubin"]


@needs_triton
@pytest.mark.parametrize("before", [False, True])
def test_gated_rmsnorm_kernel_compiles_for_hopper(monkeypatch: pytest.MonkeyPatch, before: bool) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from megatron_core.ssm.gated_rmsnorm_triton import _kernel

    pointers = {"y_ptr": "*bf16", "z_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"}
    assert _compile(_kernel(), pointers, {"BG": 512, "NORM_BEFORE_GATE": before})["cubin"]


@needs_triton
@pytest.mark.parametrize("change", [{}, {"bwd_fused": 1}, {"states_lowp": 0}], ids=["defaults", "fused", "fp32-states"])
def test_every_training_scan_kernel_compiles_for_hopper(monkeypatch: pytest.MonkeyPatch, change: dict) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from ssd_scan_resources import scan_resources

    from megatron_core.ssm import ssd_scan_triton

    for key, value in change.items():
        monkeypatch.setitem(ssd_scan_triton.SCAN_BLOCKS, key, value)
    # The Nemotron-H-shaped model's head_dim, state_dim and heads per group at a short length.
    compiled = scan_resources(1, 256, 16, 64, 2, 128)
    backward = (["ssd_chunk_bwd_group_kernel"] if change.get("bwd_fused")
                else ["ssd_chunk_dx_kernel", "ssd_chunk_dbc_kernel"])
    assert [k.name for k in compiled] == ["ssd_state_kernel", "ssd_chunk_forward_kernel", "ssd_state_grad_kernel",
                                          *backward]
    for kernel in compiled:  # each fits an SM: registers and shared memory for at least one program
        assert 0 < kernel.registers <= 255 and kernel.resident_warps >= kernel.warps, kernel
