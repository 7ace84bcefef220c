"""Megatron-Core 0.19's ``inference/batch_dimensions_utils.py`` as an oracle, run in its own process.

Point ``MCORE019_PATH`` at an unpacked megatron-core 0.19 wheel (``unzip megatron_core-0.19.*.whl -d DIR``).
The module imports only ``get_pg_size`` / ``round_up_to_nearest_multiple`` from ``megatron.core.utils`` and
(lazily) ``CudaGraphSizingDistribution`` from ``megatron.core.inference.config``; this process gives it
stand-ins for those two modules (with the same definitions), so the rest of 0.19 -- which needs Python 3.12 and
GPU packages -- is never imported, and the megatron-core 0.16 oracle installed in the venv is not touched.

Usage: ``python mcore019_batch_dims_oracle.py < cases.json > results.json``. Each case is
``{"args": [...generate_cuda_graph_batch_dimensions_list's positional args...], "real": [[t, p, d], ...]}``
(the distribution as its string value); each result is ``{"error": "AssertionError"}`` or
``{"dims": [[t, p, d], ...], "tokens": [...] | null, "match": [[strict False, strict True], ...]}``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import types
from enum import Enum
from typing import Any

MODULE = os.path.join("megatron", "core", "inference", "batch_dimensions_utils.py")


class CudaGraphSizingDistribution(str, Enum):
    """0.19's enum (two string values)."""

    EXPONENTIAL = "exponential"
    LINEAR = "linear"


def load(root: str) -> Any:
    """0.19's module from ``root``, with stand-ins for the two modules it imports."""
    for name in ("megatron", "megatron.core", "megatron.core.inference"):
        sys.modules[name] = types.ModuleType(name)
    utils = types.ModuleType("megatron.core.utils")
    utils.get_pg_size = lambda group=None: 1 if group is None else group.size()
    utils.round_up_to_nearest_multiple = lambda value, multiple: math.ceil(value / multiple) * multiple
    config = types.ModuleType("megatron.core.inference.config")
    config.CudaGraphSizingDistribution = CudaGraphSizingDistribution
    sys.modules[utils.__name__], sys.modules[config.__name__] = utils, config
    spec = importlib.util.spec_from_file_location("megatron.core.inference.batch_dimensions_utils",
                                                  os.path.join(root, MODULE))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_case(module: Any, case: dict[str, Any]) -> dict[str, Any]:
    """0.19's list, token counts and matches for one case."""
    builder, dims_cls = module.CUDAGraphBatchDimensionBuilder, module.InferenceBatchDimensions
    args = list(case["args"])
    args[-1] = CudaGraphSizingDistribution(args[-1])
    try:
        dims, tokens = builder.generate_cuda_graph_batch_dimensions_list(*args)
    except AssertionError:
        return {"error": "AssertionError"}
    as_lists = [[d.token_count, d.prefill_req_count, d.decode_req_count] for d in dims]
    matches = []
    for real in case["real"]:
        picks = [builder.match_graph_config(dims_cls(*real), dims, strict=strict) for strict in (False, True)]
        matches.append([None if g is None else [g.token_count, g.prefill_req_count, g.decode_req_count]
                        for g in picks])
    return {"dims": as_lists, "tokens": tokens, "match": matches}


if __name__ == "__main__":
    oracle = load(os.environ["MCORE019_PATH"])
    json.dump([run_case(oracle, case) for case in json.load(sys.stdin)], sys.stdout)
