"""Time GPT index building for a 1-billion-token corpus: our numpy helpers vs megatron-core's compiled ones.

The corpus is synthetic (document lengths only, no token file is written): ``--tokens`` tokens in
documents of random length in [1, 2 * mean). Timed, each as the median of ``--repeats`` runs:

* ``document index``: one epoch of document ids, shuffled (the same numpy code in both libraries);
* ``sample index``: ``build_sample_idx`` (ours: numpy ``cumsum`` + ``repeat``; megatron-core:
  ``helpers_cpp`` C++ loop), asserted equal;
* ``shuffle index``: a shuffled ``arange`` over the samples (the same numpy code in both);
* ``blending``: ``build_blending_indices`` for the samples of the corpus spread over 3 datasets
  (ours: a Python loop; megatron-core: C++), asserted equal.

    python benchmarks/datasets_index_build.py                 # 1e9 tokens, sequence length 4096
    python benchmarks/datasets_index_build.py --tokens 1e8    # quicker

megatron-core's side is skipped when it cannot be imported (``pip install --no-deps --target DIR
megatron-core==0.16.1`` and put DIR on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy

from megatron_core.datasets import helpers


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, default=1e9, help="corpus size in tokens")
    parser.add_argument("--mean-document-length", type=int, default=1000)
    parser.add_argument("--sequence-length", type=int, default=4096)
    parser.add_argument("--datasets", type=int, default=3, help="datasets in the blend")
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def timed(function: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median wall time of ``repeats`` calls and the last result."""
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def reference_helpers() -> Any:
    """megatron-core's compiled helpers module, or None."""
    try:
        from megatron.core.datasets import helpers_cpp
    except ImportError:
        return None
    return helpers_cpp


def blend(module: Any, weights: numpy.ndarray, size: int) -> tuple[numpy.ndarray, numpy.ndarray]:
    dataset_index = numpy.zeros(size, dtype=numpy.int16)
    dataset_sample_index = numpy.zeros(size, dtype=numpy.int64)
    module.build_blending_indices(dataset_index, dataset_sample_index, weights, len(weights), size, False)
    return dataset_index, dataset_sample_index


def main() -> None:
    args = parse_args()
    total_tokens = int(args.tokens)
    rng = numpy.random.default_rng(0)
    num_documents = total_tokens // args.mean_document_length
    sizes = rng.integers(1, 2 * args.mean_document_length, num_documents, dtype=numpy.int32)
    tokens = int(sizes.sum(dtype=numpy.int64))
    print(f"{platform.node()} | {platform.processor() or platform.machine()} | {os.cpu_count()} CPUs | "
          f"load {os.getloadavg()[0]:.1f} | numpy {numpy.__version__}")
    print(f"corpus: {num_documents:,} documents, {tokens:,} tokens, sequence length {args.sequence_length}")

    state = numpy.random.RandomState(1234)

    def document_index() -> numpy.ndarray:
        index = numpy.arange(num_documents, dtype=numpy.int32)
        state.shuffle(index)
        return index

    seconds, documents = timed(document_index, args.repeats)
    print(f"document index (shared numpy): {seconds:.3f} s")

    arguments = (sizes, documents, args.sequence_length, 1, tokens)
    ours_seconds, ours = timed(lambda: helpers.build_sample_idx(*arguments, True, True), args.repeats)
    print(f"sample index, ours (numpy):         {ours_seconds:.3f} s  ({len(ours) - 1:,} samples)")
    reference = reference_helpers()
    if reference is not None:
        cpp_seconds, theirs = timed(lambda: reference.build_sample_idx_int32(*arguments, True, True), args.repeats)
        assert numpy.array_equal(ours, theirs), "sample indices differ"
        print(f"sample index, megatron-core (C++):  {cpp_seconds:.3f} s  (equal: yes)")

    num_samples = len(ours) - 1
    seconds, _ = timed(lambda: state.permutation(numpy.arange(num_samples, dtype=numpy.uint32)), args.repeats)
    print(f"shuffle index (shared numpy): {seconds:.3f} s")

    weights = rng.random(args.datasets)
    weights /= weights.sum()
    ours_seconds, ours_blend = timed(lambda: blend(helpers, weights, num_samples), args.repeats)
    path = "numba" if helpers.compiled_kernels() else "Python loop"
    print(f"blending {num_samples:,} samples over {args.datasets}, ours ({path}): {ours_seconds:.3f} s")
    if reference is not None:
        cpp_seconds, their_blend = timed(lambda: blend(reference, weights, num_samples), args.repeats)
        assert all(numpy.array_equal(a, b) for a, b in zip(ours_blend, their_blend)), "blending indices differ"
        print(f"blending, megatron-core (C++): {cpp_seconds:.3f} s  (equal: yes)")


if __name__ == "__main__":
    main()
