"""Exact integer division with an error that names what did not divide."""

from __future__ import annotations


def ensure_divisibility(numerator: int, denominator: int, what: str = "") -> None:
    """Raise ``ValueError`` unless ``numerator`` is divisible by ``denominator``."""
    if denominator <= 0 or numerator % denominator != 0:
        label = f"{what}: " if what else ""
        raise ValueError(f"{label}{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int, what: str = "") -> int:
    """Integer division that raises ``ValueError`` when it is not exact."""
    ensure_divisibility(numerator, denominator, what)
    return numerator // denominator
