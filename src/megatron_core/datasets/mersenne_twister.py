"""The raw output streams of C++'s ``std::mt19937`` and ``std::mt19937_64``, in numpy.

Megatron's C++ ``helpers.build_mapping`` draws target lengths from ``std::mt19937(seed)`` and
shuffles the samples with ``std::mt19937_64(seed + 1)``; reproducing its indices bit for bit
needs the same streams. The 32-bit engine is numpy's own ``MT19937`` given the state that C++'s
integer seeding produces (numpy's legacy ``RandomState(seed)`` seeds the same way). numpy has no
64-bit Mersenne Twister, so :class:`MT19937_64` implements it, generating 312 words per step with
three vectorised slices of the twist.
"""

from __future__ import annotations

import numpy

_U64 = numpy.uint64


def mt19937_stream(seed: int) -> numpy.random.MT19937:
    """numpy's ``MT19937`` in the state of ``std::mt19937(seed)``; ``random_raw`` gives its 32-bit draws."""
    legacy = numpy.random.RandomState(seed % 2**32).get_state(legacy=False)
    generator = numpy.random.MT19937()
    generator.state = {"bit_generator": "MT19937", "state": legacy["state"]}
    return generator


class MT19937_64:  # noqa: N801 - named after std::mt19937_64
    """``std::mt19937_64`` seeded with an integer (taken modulo 2**64, as C++ converts it)."""

    _N = 312
    _M = 156
    _MATRIX_A = _U64(0xB5026F5AA96619E9)
    _UPPER = _U64(0xFFFFFFFF80000000)
    _LOWER = _U64(0x7FFFFFFF)

    def __init__(self, seed: int) -> None:
        state = [seed % 2**64]
        for i in range(1, self._N):
            previous = state[-1]
            state.append((6364136223846793005 * (previous ^ (previous >> 62)) + i) % 2**64)
        self._state = numpy.array(state, dtype=_U64)
        self._buffer = numpy.empty(0, dtype=_U64)

    def _mix(self, upper: numpy.ndarray, lower: numpy.ndarray, far: numpy.ndarray) -> numpy.ndarray:
        x = (upper & self._UPPER) | (lower & self._LOWER)
        return far ^ (x >> _U64(1)) ^ ((x & _U64(1)) * self._MATRIX_A)

    def _twist(self) -> None:
        s, n, m = self._state, self._N, self._M
        # Word i needs word i + 1 (old) and word i + m (old below n - m, already new above).
        s[: n - m] = self._mix(s[: n - m], s[1 : n - m + 1], s[m:])
        s[n - m : n - 1] = self._mix(s[n - m : n - 1], s[n - m + 1 :], s[: m - 1])
        s[n - 1 :] = self._mix(s[n - 1 :], s[:1], s[m - 1 : m])

    def _temper(self) -> numpy.ndarray:
        y = self._state.copy()
        y ^= (y >> _U64(29)) & _U64(0x5555555555555555)
        y ^= (y << _U64(17)) & _U64(0x71D67FFFEDA60000)
        y ^= (y << _U64(37)) & _U64(0xFFF7EEE000000000)
        y ^= y >> _U64(43)
        return y

    def draw(self, count: int) -> numpy.ndarray:
        """The next ``count`` 64-bit outputs as uint64."""
        blocks = [self._buffer]
        available = self._buffer.shape[0]
        while available < count:
            self._twist()
            blocks.append(self._temper())
            available += self._N
        stream = numpy.concatenate(blocks)
        self._buffer = stream[count:]
        return stream[:count]
