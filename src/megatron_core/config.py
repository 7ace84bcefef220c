"""Library-wide switches. ``ENABLE_EXPERIMENTAL`` gates APIs marked ``@experimental_api``."""

ENABLE_EXPERIMENTAL: bool = False


def set_experimental_flag(flag: bool) -> None:
    """Turn experimental APIs on or off (sets ``ENABLE_EXPERIMENTAL``)."""
    global ENABLE_EXPERIMENTAL
    ENABLE_EXPERIMENTAL = bool(flag)


def is_experimental_enabled() -> bool:
    """Whether experimental APIs are enabled."""
    return ENABLE_EXPERIMENTAL
