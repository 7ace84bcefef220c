"""How a parallel training run of the audit's features differs from the one-process run (shared by the audit files).

``per_rank`` is each rank's result of :func:`tests.training.parallel_step_runner.train_features` for one feature;
``reference`` the one-process run's assembled tensors, losses and grad norms.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.training.parallel_step_runner import assemble

TOL = dict(rtol=1e-5, atol=1e-5)


def mean_losses(per_rank: list[dict[str, Any]]) -> torch.Tensor:
    """Each step's token-mean loss over the global batch, from the loss-holding ranks' ``[sum, count]``."""
    sums = sum(torch.stack(r["losses"]) for r in per_rank if r["losses"] is not None)
    return sums[:, 0] / sums[:, 1]


def differences_from_one_process(name: str, reference: dict[str, Any], per_rank: list[dict[str, Any]]) -> list[str]:
    """Everything in which the parallel run of feature ``name`` differs from the one-process run."""
    final, problems = assemble([r["final"] for r in per_rank])
    out = [f"{name}: {p}" for p in problems]
    if final.keys() != reference["final"].keys():
        out.append(f"{name}: tensors differ: {sorted(final.keys() ^ reference['final'].keys())}")
    for key in sorted(final.keys() & reference["final"].keys()):
        try:
            torch.testing.assert_close(final[key], reference["final"][key], **TOL)
        except AssertionError as error:
            out.append(f"{name}: {key} after the steps: {str(error).splitlines()[2:4]}")
    losses = mean_losses(per_rank)
    if not torch.allclose(losses, reference["losses"], **TOL):
        out.append(f"{name}: step losses {losses.tolist()} != one process {reference['losses'].tolist()}")
    for rank, r in enumerate(per_rank):
        if not torch.allclose(torch.tensor(r["grad_norms"]), torch.tensor(reference["grad_norms"]), **TOL):
            out.append(f"{name}: rank {rank} grad norms {r['grad_norms']} != one process {reference['grad_norms']}")
    return out
