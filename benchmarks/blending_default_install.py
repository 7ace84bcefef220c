"""Blending indices in a default install: ours (numba, now a core dependency; and the plain-Python path) vs
megatron-core's compiled C++ helper, back to back on the same weights.

``python benchmarks/blending_default_install.py`` -> best-of-N seconds for 977,000 samples over 10 datasets,
and whether the three index arrays are equal. The plain path runs in a subprocess with
``MEGATRON_CORE_DISABLE_NUMBA=1`` (numba is imported once per process). The first numba call of a fresh
process also pays the compile (or the on-disk cache load): reported separately as ``first call``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy

SAMPLES, DATASETS = 977_000, 10


def _weights() -> numpy.ndarray:
    raw = numpy.random.default_rng(0).random(DATASETS) + 0.1
    return raw / raw.sum()


def _run(module, size: int) -> tuple[numpy.ndarray, numpy.ndarray]:
    dataset_index = numpy.zeros(size, dtype=numpy.int16)
    dataset_sample_index = numpy.zeros(size, dtype=numpy.int64)
    module.build_blending_indices(dataset_index, dataset_sample_index, _weights(), DATASETS, size, False)
    return dataset_index, dataset_sample_index


def _best(module, repeats: int) -> tuple[float, float, tuple[numpy.ndarray, numpy.ndarray]]:
    start = time.perf_counter()
    result = _run(module, SAMPLES)
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _run(module, SAMPLES)
        times.append(time.perf_counter() - start)
    return first, min(times), result


def _ours(repeats: int) -> None:
    from megatron_core.datasets import helpers
    from megatron_core.datasets.blending_jit import compiled_kernels

    first, best, (index, sample) = _best(helpers, repeats)
    digest = int(numpy.int64(index.astype(numpy.int64) @ numpy.arange(SAMPLES) + sample.sum()))
    print(json.dumps({"first": first, "best": best, "numba": compiled_kernels() is not None, "digest": digest}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ours-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ours_only:
        _ours(args.repeats)
        return
    from megatron.core.datasets import helpers_cpp

    cpp_first, cpp_best, (index, sample) = _best(helpers_cpp, args.repeats)
    cpp_digest = int(numpy.int64(index.astype(numpy.int64) @ numpy.arange(SAMPLES) + sample.sum()))
    rows = [("megatron-core 0.16.1 helpers_cpp (C++)", cpp_first, cpp_best, cpp_digest)]
    for label, env in (("ours, default install (numba)", {}), ("ours, plain Python (numba disabled)",
                                                              {"MEGATRON_CORE_DISABLE_NUMBA": "1"})):
        out = subprocess.run([sys.executable, __file__, "--ours-only", "--repeats", str(args.repeats)],
                             env={**os.environ, **env}, capture_output=True, text=True, check=True)
        ours = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append((label, ours["first"], ours["best"], ours["digest"]))
    print(f"{SAMPLES:,} samples over {DATASETS} datasets, best of {args.repeats}:")
    for label, first, best, digest in rows:
        print(f"  {label:40s} {best:8.4f} s  ({best / cpp_best:5.2f}x C++; first call {first:.3f} s; "
              f"equal to C++: {digest == cpp_digest})")


if __name__ == "__main__":
    main()
