"""The Triton Adam kernel against torch's Adam/AdamW (shared by the CPU-interpreter and GPU tests).

Run as a script (``python -m tests.optimizer.triton_adam_check``) it checks on the CPU through Triton's
interpreter; ``TRITON_INTERPRET=1`` must be set before Triton is imported, hence the separate process.
"""

from __future__ import annotations

import torch

from megatron_core.optimizer.triton_adam import triton_adam_step


def check(device: str, adamw: bool) -> None:
    """Four steps (one skipped by ``found_inf``, one with a clip factor) equal torch's update and state."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(37, 19), (5000,), (3,)]
    ours = [torch.randn(s, generator=gen).to(device).requires_grad_() for s in shapes]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    kind = torch.optim.AdamW if adamw else torch.optim.Adam
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    reference = kind(ref, **kwargs, foreach=False)
    fused = kind(ours, **kwargs, fused=device == "cuda") if device == "cuda" else kind(ours, **kwargs)
    if device != "cuda":
        for group in fused.param_groups:
            group["fused"] = True  # the interpreter path: the kernel does not look at the flag itself
    model_copies = {id(p): torch.empty(p.shape, dtype=torch.bfloat16, device=device) for p in ours}
    for step, (scale, skip) in enumerate([(1.0, 0.0), (4.0, 0.0), (1.0, 1.0), (2.5, 0.0)]):
        grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g / scale
        written = triton_adam_step(fused, torch.tensor([scale], device=device), torch.tensor([skip], device=device),
                                   model_copies)
        if not skip:
            reference.step()
        assert written == set(model_copies), step
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=f"param, step {step}")
            # The updated main param, rounded to nearest on a GPU (Triton's interpreter truncates: one ulp).
            ulp = 0 if device == "cuda" else 2.0 ** -7
            torch.testing.assert_close(model_copies[id(p)].float(), p.detach().to(torch.bfloat16).float(),
                                       rtol=ulp, atol=0, msg=f"bf16 copy, step {step}")
            mine, theirs = fused.state[p], reference.state[q]
            for name in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-7, msg=f"{name}, {step}")
            assert float(mine["step"]) == float(theirs["step"]), (step, mine["step"], theirs["step"])


if __name__ == "__main__":
    for adamw in (False, True):
        check("cpu", adamw)
    print("triton adam ok")
