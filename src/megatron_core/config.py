"""Library-wide switches. ``ENABLE_EXPERIMENTAL`` gates APIs marked ``@experimental_api``."""

ENABLE_EXPERIMENTAL: bool = False
