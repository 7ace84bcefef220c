"""Copy services and refit entry points that need no ranks: unavailable transports and bad arguments.

NVSHMEM and NIXL are not provided: constructing their services (or asking ``get_or_create_service`` for
them) raises ``ImportError`` naming the missing library, as does the MXFP8 transform; an unknown backend
name raises ``ValueError``; unpaired same-rank copies raise ``RuntimeError``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.resharding import MXFP8ReshardTransform, get_or_create_service, swap_model_weights
from megatron_core.resharding.copy_services import NixlCopyService, NVSHMEMCopyService
from megatron_core.resharding.copy_services.base import RecvOp, SendOp, match_local_ops_by_task_id


def test_unavailable_transports_raise_import_error():
    with pytest.raises(ImportError, match="NVSHMEM"):
        NVSHMEMCopyService()
    with pytest.raises(ImportError, match="NIXL"):
        NixlCopyService()
    with pytest.raises(ImportError, match="NVSHMEM"):
        get_or_create_service("nvshmem")
    with pytest.raises(ImportError, match="MXFP8"):
        MXFP8ReshardTransform(convertible_params=set(), persistent_buffers={})


def test_bad_backend_arguments():
    with pytest.raises(ValueError, match="unknown refit backend 'mpi'"):
        get_or_create_service("mpi")
    with pytest.raises(TypeError, match="refit_method"):
        swap_model_weights(None, None, 3)


def test_local_ops_pair_by_task_id():
    t = torch.zeros(2)
    sends = [SendOp(1, t, 0), SendOp(2, t, 0)]
    recvs = [RecvOp(2, t, 0), RecvOp(1, t, 0)]
    pairs = match_local_ops_by_task_id(sends, recvs, "X", 0)
    assert [(s.task_id, r.task_id) for s, r in pairs] == [(2, 2), (1, 1)]
    with pytest.raises(RuntimeError, match="unmatched local ops"):
        match_local_ops_by_task_id(sends, recvs[:1], "X", 0)
    with pytest.raises(RuntimeError, match="needs a task_id"):
        match_local_ops_by_task_id([SendOp(None, t, 0)], [RecvOp(None, t, 0)], "X", 0)
    with pytest.raises(RuntimeError, match="no local send for task_id=3"):
        match_local_ops_by_task_id(sends, [RecvOp(2, t, 0), RecvOp(3, t, 0)], "X", 0)
